"""Triton kernel for coupled sampling (see ``specbatch_kernels.sampling`` and ``specbatch_kernels.counter_rng``).

Imported lazily, like the other ``specbatch_kernels._triton_*`` modules. The noise is generated in the
kernel from the row key (no ``[R, V]`` noise tensor in memory), with the same SplitMix64 bits,
the same float64 ``-log(u)`` and the same float64 division as the torch reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _coupled_sample_kernel(probs_ptr, keys_ptr, tokens_ptr, V, stride, BLOCK_V: tl.constexpr):
    """One row: a running argmax of ``p / E`` over vocabulary chunks (earliest index wins ties)."""
    r = tl.program_id(0).to(tl.int64)
    key = tl.load(keys_ptr + r).to(tl.uint64)
    best = tl.full((), -1.0, tl.float64)
    best_idx = tl.full((), 0, tl.int64)
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        mask = offs < V
        p = tl.load(probs_ptr + r * stride + offs, mask=mask, other=0.0).to(tl.float64)
        z = key + (offs.to(tl.uint64) + 1) * 0x9E3779B97F4A7C15
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
        z = (z ^ (z >> 27)) * 0x94D049BB133111EB
        z = z ^ (z >> 31)
        u = ((z >> 11).to(tl.float64) + 0.5) * 1.1102230246251565e-16  # 2**-53
        e = -tl.log(u)
        score = tl.where(p > 0, p / e, 0.0)
        score = tl.where(mask, score, -1.0)
        s = tl.max(score, axis=0)
        j = tl.argmax(score, axis=0)
        best_idx = tl.where(s > best, v0 + j.to(tl.int64), best_idx)  # strict: an earlier chunk keeps a tie
        best = tl.maximum(s, best)
    tl.store(tokens_ptr + r, best_idx.to(tl.int64))


def coupled_sample(probs: torch.Tensor, keys: torch.Tensor, block_v: int = 2048) -> torch.Tensor:
    rows, vocab = probs.shape
    tokens = torch.empty(rows, dtype=torch.long, device=probs.device)
    if rows == 0:
        return tokens
    probs = probs.contiguous()
    _coupled_sample_kernel[(rows,)](
        probs, keys.to(torch.int64).contiguous(), tokens, vocab, probs.stride(0),
        BLOCK_V=min(block_v, triton.next_power_of_2(vocab)),
    )
    return tokens
