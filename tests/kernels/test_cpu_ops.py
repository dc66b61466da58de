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
def test_decode_attention_equals_reference(dtype, window, group):
    ctx = [1, 15, 16, 17, 50, 33]
    case = make_case(ctx, [1] * len(ctx), group=group, dtype=dtype, sliding_window=window, seed=len(ctx) + group)
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
