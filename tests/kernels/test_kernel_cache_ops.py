"""Triton cache operations against their torch references."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specbatch_kernels.cache_ops import write_kv_torch, write_kv_triton
from paged_cases import DEVICE, DTYPES, EXAMPLES

SETTINGS = settings(max_examples=EXAMPLES, deadline=None)
# Cache ops only move data (with at most one cast to the cache dtype): results must be bit-exact,
# except that triton 3.9's CPU interpreter casts fp32 -> bf16 by truncation (compiled Triton and
# torch round to nearest even), so there a cast into a bf16 cache may differ by one bf16 ulp.
INTERPRETED = DEVICE == "cpu"


def assert_written(got: torch.Tensor, want: torch.Tensor, src_dtype: torch.dtype) -> None:
    if INTERPRETED and got.dtype == torch.bfloat16 and src_dtype != torch.bfloat16:
        torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=0)
    else:
        assert torch.equal(got, want)


@st.composite
def cache_shapes(draw) -> dict:
    return dict(
        num_blocks=draw(st.integers(1, 6)),
        block_size=draw(st.sampled_from([16, 32])),
        num_kv_heads=draw(st.sampled_from([1, 2, 3, 4, 8])),
        head_dim=draw(st.sampled_from([16, 64, 128, 80])),
        dtype=draw(st.sampled_from(DTYPES)),
    )


def make_cache(gen: torch.Generator, num_blocks, block_size, num_kv_heads, head_dim, dtype):
    return torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)


@SETTINGS
@given(shape=cache_shapes(), data=st.data())
def test_write_kv_matches_reference(shape, data):
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    num_slots = shape["num_blocks"] * shape["block_size"]
    num_tokens = data.draw(st.integers(1, min(num_slots, 40)))
    slots = torch.randperm(num_slots, generator=gen)[:num_tokens]
    padding = data.draw(st.lists(st.booleans(), min_size=num_tokens, max_size=num_tokens))
    slots[torch.tensor(padding)] = -1
    kv_dtype = data.draw(st.sampled_from(DTYPES))  # the new rows may differ from the cache dtype
    rows = (num_tokens, shape["num_kv_heads"], shape["head_dim"])
    key = torch.randn(rows, generator=gen).to(kv_dtype).to(DEVICE)
    value = torch.randn(rows, generator=gen).to(kv_dtype).to(DEVICE)
    if data.draw(st.booleans()):  # a strided view, as when K and V are slices of one projection
        key = torch.cat([key, value], dim=1)[:, : shape["num_kv_heads"]]
    slot_mapping = slots.to(DEVICE)
    caches = [make_cache(gen, **shape) for _ in range(2)]
    want = [c.clone() for c in caches]
    write_kv_torch(key, value, *want, slot_mapping)
    write_kv_triton(key, value, *caches, slot_mapping)
    assert_written(caches[0], want[0], kv_dtype)
    assert_written(caches[1], want[1], kv_dtype)
