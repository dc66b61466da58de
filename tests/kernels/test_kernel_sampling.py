"""Coupled sampling step: Triton equals the torch reference token for token (same counter noise,
same float64 race), on dense, truncated, one-hot and low-precision rows; the reference draws
exactly from ``p`` across seeds."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import specbatch_kernels
from specbatch_kernels.counter_rng import keys_tensor, row_key
from specbatch_kernels.sampling import coupled_sample_torch
from paged_cases import DEVICE, EXAMPLES


def random_rows(seed: int, rows: int, vocab: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    probs = torch.softmax(3 * torch.randn(rows, vocab, generator=gen), dim=-1)
    for r in range(rows):
        kind = r % 3
        if kind == 1:  # truncated (top-k/top-p): most of the vocabulary has probability 0
            keep = torch.rand(vocab, generator=gen) < 0.2
            keep[int(probs[r].argmax())] = True
            probs[r] = probs[r] * keep / (probs[r] * keep).sum()
        elif kind == 2:  # one-hot (greedy)
            probs[r] = torch.nn.functional.one_hot(probs[r].argmax(), vocab).float()
    keys = keys_tensor([row_key(seed, r % 2, 7 + r) for r in range(rows)], "cpu")
    return probs.to(dtype).to(DEVICE), keys.to(DEVICE)


@settings(max_examples=EXAMPLES, deadline=None)
@given(
    seed=st.integers(0, 2**40),
    rows=st.integers(1, 7),
    vocab=st.sampled_from([1, 2, 7, 64, 300, 1000]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    block_v=st.sampled_from([16, 2048]),
)
def test_triton_matches_reference(seed, rows, vocab, dtype, block_v):
    from specbatch_kernels import _triton_sampling

    probs, keys = random_rows(seed, rows, vocab, dtype)
    want = coupled_sample_torch(probs, keys)
    got = _triton_sampling.coupled_sample(probs, keys, block_v=block_v)  # 16: many vocab chunks
    assert torch.equal(got, want)
    assert torch.equal(specbatch_kernels.coupled_sample(probs, keys, backend="triton"), want)
    assert bool((probs.float()[torch.arange(rows), want] > 0).all())  # never a token outside the support


def test_reference_draws_from_p_across_seeds():
    p = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05, 0.0])
    n = 40_000
    keys = keys_tensor([row_key(seed, 0, 3) for seed in range(n)], "cpu")
    tokens = coupled_sample_torch(p.expand(n, 6), keys)
    freq = torch.bincount(tokens, minlength=6).float() / n
    assert freq[5] == 0
    assert 0.5 * (freq - p).abs().sum() < 0.015, freq
