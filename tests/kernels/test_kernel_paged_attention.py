"""Triton paged attention against the torch reference (interpreter on CPU, compiled on CUDA)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specbatch_kernels.paged_attention import paged_attention_torch, paged_attention_triton
from paged_cases import DTYPES, EXAMPLES, assert_close, context_len, layouts, make_case, window

SETTINGS = settings(max_examples=EXAMPLES, deadline=None)


def check(case, dtype, **kwargs) -> None:
    """Triton in ``dtype`` vs the reference in fp32 on the same inputs, within dtype's bound."""
    got = paged_attention_triton(*case.args(), **kwargs)
    assert got.dtype == dtype and got.shape == case.query.shape
    want = paged_attention_torch(*case.upcast_args())
    assert_close(got, want, dtype)


@SETTINGS
@given(data=st.data())
def test_decode_matches_reference(data):
    layout = data.draw(layouts())
    batch = data.draw(st.integers(1, 5))
    ctx = [data.draw(context_len(layout["block_size"])) for _ in range(batch)]
    split = data.draw(st.sampled_from([None, 16, 40, 64]))
    case = make_case(ctx, [1] * batch, sliding_window=window(data.draw, ctx), **layout)
    check(case, layout["dtype"], kv_split_len=split)


@SETTINGS
@given(data=st.data())
def test_varlen_matches_reference(data):
    layout = data.draw(layouts())
    batch = data.draw(st.integers(1, 4))
    ctx = [data.draw(context_len(layout["block_size"])) for _ in range(batch)]
    # Query chunks: a whole prompt, a chunk after cached tokens, a single decode token.
    q = [data.draw(st.sampled_from([c, 1, min(c, 5), data.draw(st.integers(1, c))])) for c in ctx]
    if max(q) == 1:
        q[0] = ctx[0]  # keep it a varlen step (possibly of one token if ctx[0] == 1)
    case = make_case(ctx, q, sliding_window=window(data.draw, ctx), **layout)
    check(case, layout["dtype"])


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("delta", [-1, 0, 1])
@pytest.mark.parametrize("dtype", DTYPES)
def test_block_boundaries(block_size, delta, dtype):
    """Contexts at 1, 2 and 3 blocks +-1, decode and a 3-token verification chunk."""
    ctx = [k * block_size + delta for k in (1, 2, 3)]
    for q in ([1, 1, 1], [3, 3, 3]):
        case = make_case(ctx, q, block_size=block_size, dtype=dtype, seed=block_size + delta)
        check(case, dtype)
        if q[0] == 1:
            check(case, dtype, kv_split_len=block_size)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_long_context_decode_with_splits(head_dim):
    """Split-KV decode over a longer context, GQA 4:1, sliding window and many splits."""
    case = make_case([700, 1, 333], [1, 1, 1], num_kv_heads=2, group=4, head_dim=head_dim,
                     block_size=32, dtype=torch.bfloat16, seed=head_dim)
    check(case, torch.bfloat16, kv_split_len=128)
    case.sliding_window = 200
    check(case, torch.bfloat16, kv_split_len=64)


def test_prefill_from_scratch_and_mixed_batch():
    """Whole-prompt prefill, a chunk on top of a cached prefix and decodes in one step."""
    case = make_case([37, 64, 10, 1], [37, 20, 1, 1], group=3, seed=5)
    check(case, torch.float32)
    check(case, torch.float32, max_query_len=37)  # host-supplied maximum


def test_sequence_without_query_tokens_is_skipped():
    case = make_case([9, 3, 4], [2, 0, 1], seed=1)
    check(case, torch.float32)
    case = make_case([9, 3, 4], [1, 0, 1], seed=1)
    check(case, torch.float32, kv_split_len=16)


def test_empty_step():
    case = make_case([4], [0])
    assert paged_attention_triton(*case.args()).shape == (0, 4, 64)
