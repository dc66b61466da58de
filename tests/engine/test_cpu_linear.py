import pytest
import torch
from torch import nn

from engine.cpu_linear import PackedLinear, can_pack, onednn_bf16_supported, pack_linears

needs_onednn_bf16 = pytest.mark.skipif(
    not onednn_bf16_supported(),
    reason="oneDNN's bfloat16 linear needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT, which this CPU lacks")


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


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("rows", [1, 3, 8, 64])
def test_forward_add_is_the_residual_plus_the_linear_bit_for_bit(bias, rows):
    """The fused residual add (one oneDNN call) must be exactly ``residual + linear(x)`` in float32:
    the decoder layers rely on it for outputs identical to transformers'. The residual is kept."""
    torch.manual_seed(rows)
    packed = PackedLinear(nn.Linear(96, 200, bias=bias))
    x, residual = torch.randn(rows, 96), torch.randn(rows, 200)
    kept = residual.clone()
    got = packed.forward_add(x, residual)
    assert torch.equal(got, residual + packed(x))
    assert torch.equal(residual, kept)


def test_bfloat16_is_packed_only_where_a_kernel_computes_it():
    """bfloat16 linears are packed where ``small_linear`` builds (any AVX2 or AVX-512 CPU) or oneDNN
    has a bfloat16 path; elsewhere they stay torch's (oneDNN's packing would raise at the first
    step). Packed, they compute what torch's linear does, on this CPU."""
    from engine.cpu_linear import small_gemm_available

    assert can_pack(torch.device("cpu"), torch.bfloat16) == (small_gemm_available() or onednn_bf16_supported())
    assert can_pack(torch.device("cpu"), torch.float32)
    if can_pack(torch.device("cpu"), torch.bfloat16):
        torch.manual_seed(0)
        linear = nn.Linear(96, 200).to(torch.bfloat16)
        x = torch.randn(5, 96, dtype=torch.bfloat16)
        got, want = PackedLinear(linear)(x).float(), linear(x).float()
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


@needs_onednn_bf16
def test_forward_add_keeps_two_roundings_in_bfloat16():
    torch.manual_seed(0)
    packed = PackedLinear(nn.Linear(96, 200).to(torch.bfloat16))
    x, residual = torch.randn(4, 96, dtype=torch.bfloat16), torch.randn(4, 200, dtype=torch.bfloat16)
    assert torch.equal(packed.forward_add(x, residual), residual + packed(x))


def test_forward_add_takes_strided_residuals():
    torch.manual_seed(0)
    packed32 = PackedLinear(nn.Linear(96, 200))
    strided_residual = torch.randn(4, 400)[:, ::2]
    strided_x = torch.randn(96, 4).t()
    assert not strided_residual.is_contiguous() and not strided_x.is_contiguous()
    assert torch.equal(packed32.forward_add(strided_x, strided_residual), strided_residual + packed32(strided_x))


def test_a_bfloat16_engine_runs_where_onednn_has_no_bfloat16(tiny_model_dir):
    """An AVX2-only CPU, as oneDNN sees it (``ONEDNN_MAX_CPU_ISA=AVX2`` caps its instruction set
    even on an AVX-512 machine): a bfloat16 engine keeps torch's linears and generates, instead
    of failing at the first packed weight ("bf16 path needs the cpu support avx_ne_convert …")."""
    import os
    import subprocess
    import sys

    code = ("import sys; from engine import LLM, SamplingParams; from engine.cpu_linear import onednn_bf16_supported\n"
            "assert not onednn_bf16_supported()\n"
            "out = LLM(sys.argv[1], device='cpu', dtype='bfloat16', max_num_seqs=2).generate(['hello'], "
            "SamplingParams(temperature=0, max_tokens=4))\n"
            "print(len(out[0].outputs[0].token_ids))")
    done = subprocess.run([sys.executable, "-c", code, tiny_model_dir], env=dict(os.environ, ONEDNN_MAX_CPU_ISA="AVX2"),
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0 and done.stdout.strip().splitlines()[-1] == "4", done.stderr[-3000:]


# ---- dtype "auto": bf16 where the CPU computes it natively ---------------------------------
def test_auto_dtype_is_bfloat16_exactly_where_the_cpu_has_native_bf16(monkeypatch):
    from engine.config import EngineConfig
    from engine.cpu_features import cpu_flags, native_bf16

    native = bool({"avx512_bf16", "amx_bf16"} & cpu_flags())
    assert native_bf16() == native
    auto = EngineConfig(model="m", device="cpu")
    assert auto.dtype == (torch.bfloat16 if native else torch.float32) and auto.dtype_auto
    assert EngineConfig(model="m", device="cpu", quantization="int8").dtype == torch.float32  # its kernels take fp32
    named = EngineConfig(model="m", device="cpu", dtype="float32")
    assert named.dtype == torch.float32 and not named.dtype_auto
    # oneDNN capped below bf16 (an AVX2-only CPU as oneDNN sees it): float32.
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert not native_bf16() and EngineConfig(model="m", device="cpu").dtype == torch.float32


def test_the_cache_key_names_the_dtype_auto_picks(monkeypatch):
    """A producer and a worker on machines whose ``auto`` differs must never share results."""
    from engine.cpu_features import native_bf16
    from worker.request.cache_key import model_key

    key = lambda dtype: model_key("w", dtype=dtype, quantization=None, device="cpu", engine_kwargs=None)  # noqa: E731
    assert key(None) == key("bfloat16" if native_bf16() else "float32")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert key(None) == key("float32")


def test_the_runner_reports_an_auto_dtype(tiny_model_dir):
    from engine import LLM

    described = LLM(tiny_model_dir, device="cpu", max_num_seqs=2).engine.runner.describe()
    assert "(auto for this CPU)" in described
    assert "auto" not in LLM(tiny_model_dir, device="cpu", dtype="float32", max_num_seqs=2).engine.runner.describe()
