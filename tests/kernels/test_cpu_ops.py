"""The C++ CPU ops (``specbatch_kernels.cpu_ops``) compute what the torch references compute:
decode attention over shuffled blocks (GQA, sliding window, a padding row attending to nothing,
bf16) and the KV write (padding slots skipped); and torch.compile keeps them in one graph."""

from __future__ import annotations

import pytest
import torch
from paged_cases import DTYPES, assert_close, make_case

from specbatch_kernels import cpu_ops
from specbatch_kernels.cache_ops import write_kv_torch
from specbatch_kernels.paged_attention import paged_attention_torch

@pytest.fixture(autouse=True, scope="module")
def _cpu_ops_built():
    """This project's machines and CI have a C++ compiler: an op that does not build is a failure."""
    assert cpu_ops.load_cpu_ops(), "the specbatch CPU ops did not build (see the log above)"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 5, 40])
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("head_dim,batch", [(64, 6), (64, 70), (128, 1), (128, 70), (48, 6)])
def test_decode_attention_equals_reference(dtype, window, group, head_dim, batch):
    """Head sizes 64 and 128 take the vectorized path on AVX-512 builds (48 the generic one), a
    few sequences split by KV head and many (70: more than 4 per thread on any machine we run)
    whole; contexts around the 16-token tiles and blocks."""
    ctx = ([1, 15, 16, 17, 50, 33] * 12)[:batch] if batch > 1 else [77]
    case = make_case(ctx, [1] * len(ctx), num_kv_heads=3, group=group, head_dim=head_dim, dtype=dtype,
                     sliding_window=window, seed=len(ctx) + group)
    want = paged_attention_torch(*case.upcast_args())
    got = cpu_ops.paged_decode_attention(case.query, case.k_cache, case.v_cache, case.block_tables,
                                         case.context_lens, case.scale, window)
    assert got.dtype == dtype
    assert_close(got, want, dtype if dtype in DTYPES else torch.float32)


def test_padding_row_attends_to_nothing():
    case = make_case([20, 9], [1, 1])
    ctx = case.context_lens.clone()
    ctx[1] = 0
    got = cpu_ops.paged_decode_attention(case.query, case.k_cache, case.v_cache, case.block_tables, ctx, case.scale)
    assert torch.equal(got[1], torch.zeros_like(got[1]))
    want = paged_attention_torch(*case.args())
    assert_close(got[0], want[0], torch.float32)


def test_write_kv_equals_reference_and_skips_padding():
    k_cache = torch.randn(6, 4, 2, 8)
    v_cache = torch.randn(6, 4, 2, 8)
    key, value = torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    slots = torch.tensor([3, -1, 17, 0, -1])
    want_k, want_v = k_cache.clone(), v_cache.clone()
    write_kv_torch(key, value, want_k, want_v, slots)
    torch.ops.specbatch.write_kv(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


def test_ops_compile_into_one_graph():
    """No graph break around the ops, and the compiled call writes the cache in place."""
    case = make_case([20, 7, 33], [1, 1, 1])
    k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
    key, value = torch.randn(3, 2, 64), torch.randn(3, 2, 64)
    slots = torch.tensor([2, 40, 70])

    def step(q, key, value, k_cache, v_cache, slots, tables, ctx):
        torch.ops.specbatch.write_kv(key, value, k_cache, v_cache, slots)
        return torch.ops.specbatch.paged_decode_attention(q * 1.0, k_cache, v_cache, tables, ctx, 0.125, 0) + 1.0

    args = (case.query, key, value, k_cache, v_cache, slots, case.block_tables, case.context_lens)
    compiled = torch.compile(step, fullgraph=True)
    got = compiled(*args)
    ref_k, ref_v = case.k_cache.clone(), case.v_cache.clone()
    want = step(case.query, key, value, ref_k, ref_v, slots, case.block_tables, case.context_lens)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)
    assert_close(got, want, torch.float32)


@pytest.mark.parametrize("kind", ["float", "int8"])
def test_packed_linear_by_handle_equals_the_eager_linear(kind):
    """The handle op runs the very kernel eager runs (oneDNN packed, or int8 quantized::linear_dynamic),
    with and without the residual add, and refuses a released handle."""
    from engine.quantization import Int8DynamicLinear

    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 80)
    if kind == "float":  # oneDNN's packed layout (what PackedLinear keeps where our ops do not build)
        packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), 64)
        bias = linear.bias.detach()
        eager = lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")  # noqa: E731
        handle = cpu_ops.register_packed_linear(packed, bias, 80)
    else:
        eager = Int8DynamicLinear(linear)
        handle = cpu_ops.register_int8_linear(eager.packed_params, eager.reduce_range, 80)
    x, residual = torch.randn(5, 96), torch.randn(5, 80)
    try:
        assert torch.equal(torch.ops.specbatch.packed_linear(x, handle), eager(x))
        assert torch.equal(torch.ops.specbatch.packed_linear(x, handle, residual), residual + eager(x))
    finally:
        cpu_ops.release_packed_linear(handle)
    with pytest.raises(RuntimeError, match="was released"):
        torch.ops.specbatch.packed_linear(x, handle)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(576, 960), (1536, 577), (37, 5)], ids=["qkv", "odd-out", "tiny-odd"])
def test_small_linear_computes_the_linear_and_a_row_never_depends_on_its_batch(dtype, shape):
    """The decode kernel: float64's answer within the dtype's rounding, bias and residual added as
    the eager ops add them, and each row bit for bit the same alone or among 1..64 others."""
    k, n = shape
    torch.manual_seed(k + n)
    weight, bias = torch.randn(n, k).to(dtype), torch.randn(n).to(dtype)
    packed = torch.ops.specbatch.pack_small_linear(weight)
    x, residual = torch.randn(64, k).to(dtype), torch.randn(64, n).to(dtype)
    got = torch.ops.specbatch.small_linear(x, packed, n, bias)
    want = x.double() @ weight.double().t() + bias.double()
    rounding = 2.0 ** -8 if dtype == torch.bfloat16 else 1e-6
    assert ((got.double() - want).abs() <= rounding * (want.abs() + 1) + 1e-5 * k ** 0.5).all()
    for rows in (1, 2, 5, 6, 7, 13):
        assert torch.equal(torch.ops.specbatch.small_linear(x[:rows], packed, n, bias), got[:rows])
    assert torch.equal(torch.ops.specbatch.small_linear(x[3:4], packed, n, bias), got[3:4])
    with_residual = torch.ops.specbatch.small_linear(x, packed, n, bias, residual)
    assert torch.equal(with_residual, residual + got)  # float32: one sum; bfloat16: two roundings


def test_packed_linear_keeps_one_copy_of_its_weight_and_gives_it_back():
    from engine.cpu_linear import PackedLinear

    linear = torch.nn.Linear(37, 21).to(torch.bfloat16)
    packed = PackedLinear(linear)
    assert packed.small_weight is not None and packed.packed_weight is None
    assert torch.equal(packed.weight, linear.weight.detach())
    x = torch.randn(3, 37, dtype=torch.bfloat16)
    assert torch.equal(packed(x), torch.ops.specbatch.small_linear(x, packed.small_weight, 21, linear.bias.detach()))
