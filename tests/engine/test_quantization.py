"""int8 linears: opt-in only, close to the fp32 maths, and wired through LLM(quantization=...)."""

import pytest
import torch
from torch import nn

from engine import LLM, EngineConfig, SamplingParams
from engine.cpu_linear import PackedLinear
from engine.quantization import Int8DynamicLinear, quantize_linears

pytestmark = pytest.mark.skipif(
    not {"fbgemm", "x86", "onednn"} & set(torch.backends.quantized.supported_engines),
    reason="this torch build has no quantized CPU engine",
)


@pytest.mark.parametrize("rows", [1, 8, 33])
@pytest.mark.parametrize("bias", [True, False])
def test_int8_linear_is_close_to_linear(rows, bias):
    torch.manual_seed(rows)
    linear = nn.Linear(192, 320, bias=bias)
    q = Int8DynamicLinear(linear)
    x = torch.randn(1, rows, 192)
    want, got = linear(x), q(x)
    assert got.shape == want.shape == (1, rows, 320)
    rel = (got - want).norm() / want.norm()
    assert rel < 0.02, f"relative error {rel:.4f}"
    assert not torch.equal(got, want)  # it really is quantized, not a float copy


def test_quantize_linears_replaces_every_linear_but_down_projections():
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Sequential(nn.Linear(64, 16)))
    model.down_proj = nn.Linear(16, 8)
    assert quantize_linears(model) == 2
    assert type(model.down_proj) is nn.Linear  # outlier-heavy input: kept in float
    assert sum(isinstance(m, Int8DynamicLinear) for m in model.modules()) == 2


def test_config_rejects_unknown_or_unsupported_quantization():
    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(model="x", quantization="int3", device="cpu")
    with pytest.raises(ValueError, match="CPU only"):
        EngineConfig(model="x", quantization="int8", device="meta")
    assert EngineConfig(model="x", quantization="none", device="cpu").quantization is None


def test_default_stays_exact_and_int8_is_opt_in(tiny_model_dir):
    exact = LLM(tiny_model_dir, device="cpu", max_num_seqs=4)
    quant = LLM(tiny_model_dir, device="cpu", max_num_seqs=4, quantization="int8")
    assert not any(isinstance(m, Int8DynamicLinear) for m in exact.engine.model.modules())
    assert any(isinstance(m, PackedLinear) for m in exact.engine.model.modules())
    named = dict(quant.engine.model.named_modules())
    kinds = {name.rpartition(".")[2]: type(m) for name, m in named.items() if isinstance(m, (Int8DynamicLinear, PackedLinear, nn.Linear))}
    assert kinds["qkv_proj"] is kinds["gate_up_proj"] is kinds["o_proj"] is kinds["lm_head"] is Int8DynamicLinear
    assert kinds["down_proj"] is PackedLinear  # kept in float, still prepacked
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = ["hello there", "the cat sat on", "1 2 3 4"]
    a = [o.outputs[0].token_ids for o in exact.generate(prompts, params, use_tqdm=False)]
    b = [o.outputs[0].token_ids for o in quant.generate(prompts, params, use_tqdm=False)]
    assert all(len(x) == 12 for x in b)
    # The tiny model's logits are sharp (logit_scale 8): int8 error must not flip its first choices.
    assert [x[:4] for x in a] == [x[:4] for x in b]
