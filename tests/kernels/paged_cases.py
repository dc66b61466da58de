"""Random paged-attention inputs for the kernel tests, and the error bounds per dtype."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from hypothesis import strategies as st

DEVICE = os.environ.get("SPECBATCH_TEST_DEVICE", "cpu")
# Hypothesis examples per property: small by default (the interpreter is slow); raise it on a
# GPU or for a one-off stress run.
EXAMPLES = int(os.environ.get("SPECBATCH_KERNEL_EXAMPLES", "20"))

# Max |triton - fp32 truth| allowed, as (atol, rtol), for outputs of magnitude ~1. fp32 computes
# exactly (IEEE dot, fp32 softmax): only summation order differs. bf16/fp16 round the softmax
# weights to the input dtype before P@V (as flash attention does) and round the output once:
# a few ulps of the dtype (bf16 ulp at 1.0 is 7.8e-3, fp16's 9.8e-4).
TOLERANCE = {
    torch.float32: (1e-4, 1e-4),
    torch.float16: (4e-3, 4e-3),
    torch.bfloat16: (3e-2, 3e-2),
}
DTYPES = list(TOLERANCE)


@dataclass
class PagedCase:
    query: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    query_start_loc: torch.Tensor
    scale: float
    sliding_window: int | None

    def args(self) -> tuple:
        return (self.query, self.k_cache, self.v_cache, self.block_tables, self.context_lens,
                self.query_start_loc, self.scale, self.sliding_window)

    def upcast_args(self) -> tuple:
        """The same inputs in fp32: the reference on these is the 'truth' for low precisions."""
        a = list(self.args())
        a[0], a[1], a[2] = (t.float() for t in a[:3])
        return tuple(a)


def make_case(
    context_lens: list[int],
    query_lens: list[int],
    *,
    num_kv_heads: int = 2,
    group: int = 2,
    head_dim: int = 64,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    sliding_window: int | None = None,
    seed: int = 0,
    device: str = DEVICE,
) -> PagedCase:
    """Sequences with shuffled, non-contiguous blocks, spare table columns and spare blocks."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-c // block_size) for c in context_lens]
    num_blocks = sum(blocks_per_seq) + 3  # spare blocks hold garbage nobody may read
    width = max(blocks_per_seq) + 1  # a spare column: unused entries hold valid ids
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.randint(0, num_blocks, (len(context_lens), width), generator=gen)
    used = 0
    for i, n in enumerate(blocks_per_seq):
        tables[i, :n] = perm[used : used + n]
        used += n
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    query = torch.randn(starts[-1], num_kv_heads * group, head_dim, generator=gen).to(dtype)
    return PagedCase(
        query=query.to(device),
        k_cache=k_cache.to(device),
        v_cache=v_cache.to(device),
        block_tables=tables.to(torch.int32).to(device),
        context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        scale=head_dim**-0.5,
        sliding_window=sliding_window,
    )


def spy(monkeypatch, module, name: str, calls: list[str]) -> None:
    """Record ``name`` in ``calls`` on each call of ``module.name``, still running it."""
    real = getattr(module, name)

    def wrapper(*args, **kwargs):
        calls.append(name)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapper)


def assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol)


# ------------------------------------------------------------------ strategies


@st.composite
def context_len(draw, block_size: int, max_blocks: int = 4) -> int:
    """Any length up to ``max_blocks`` blocks, or a block boundary (k*bs - 1, k*bs, k*bs + 1)."""
    if draw(st.booleans()):
        k = draw(st.integers(1, max_blocks))
        return max(1, k * block_size + draw(st.sampled_from([-1, 0, 1])))
    return draw(st.integers(1, max_blocks * block_size))


@st.composite
def layouts(draw) -> dict:
    """Head layout, block size and dtype for one case."""
    return dict(
        num_kv_heads=draw(st.sampled_from([1, 2, 4])),
        group=draw(st.sampled_from([1, 2, 3, 4, 8])),
        head_dim=draw(st.sampled_from([16, 32, 64, 128, 80])),
        block_size=draw(st.sampled_from([16, 32])),
        dtype=draw(st.sampled_from(DTYPES)),
        seed=draw(st.integers(0, 2**16)),
    )


def window(draw, context_lens: list[int]) -> int | None:
    if draw(st.booleans()):
        return None
    return draw(st.integers(1, max(context_lens) + 2))
