import pytest
import torch
from torch import nn

from engine.cpu_linear import PackedLinear, pack_linears


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("rows", [1, 2, 7, 64])
def test_packed_linear_computes_what_linear_computes(bias, rows):
    torch.manual_seed(rows)
    linear = nn.Linear(96, 200, bias=bias)
    packed = PackedLinear(linear)
    x = torch.randn(1, rows, 96)
    torch.testing.assert_close(packed(x), linear(x), atol=1e-5, rtol=1e-5)
    assert packed(x).shape == (1, rows, 200)
    torch.testing.assert_close(packed.weight, linear.weight)


def test_pack_linears_replaces_every_linear():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Sequential(nn.Linear(16, 4)))
    x = torch.randn(3, 8)
    want = model(x)
    assert pack_linears(model) == 2
    assert not any(type(m) is nn.Linear for m in model.modules())
    torch.testing.assert_close(model(x), want, atol=1e-5, rtol=1e-5)
