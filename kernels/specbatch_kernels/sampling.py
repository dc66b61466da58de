"""Coupled sampling: each row's token is ``argmax_v p_v / E_v`` with counter-based noise.

``E_v`` is Exp(1) noise that is a pure function of the row's key (seed, sample index, absolute
position; see ``specbatch_kernels.counter_rng``) and the token ``v``, so a row's token depends on its
distribution and its coordinates only: the same alone or in any batch, with or without
speculation, on any worker. The exponential race draws exactly from ``p``; zero-probability
tokens never win. Verification samples every target row this way and accepts a draft iff it
equals the sampled token (the engine's ``accept_prefix``), so speculative output *is* the
non-speculative output.

Shapes: ``probs[R, V]`` (any float dtype, rows summing to 1), ``keys[R]`` int64. Returns
``tokens[R]`` int64. Ties (two scores equal in float64) go to the lowest token id on both
backends.
"""

from __future__ import annotations

import torch

from specbatch_kernels.counter_rng import exponentials


def noised_scores_torch(probs: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Float64 race scores ``p / E`` (0 where ``p`` is 0), computed only over the support.

    Sampling truncates most rows (top-p, top-k, min-p) to a few tokens; hashing only those keeps
    the CPU cost proportional to the support, not the vocabulary.
    """
    rows, cols = probs.nonzero(as_tuple=True)
    scores = torch.zeros(probs.shape, dtype=torch.float64, device=probs.device)
    scores[rows, cols] = probs[rows, cols].double() / exponentials(keys[rows], cols)
    return scores


def coupled_sample_torch(probs: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Reference (and CPU path): one token per row."""
    return noised_scores_torch(probs, keys).argmax(dim=-1)


def coupled_sample_triton(probs: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Triton ``coupled_sample_torch``: one program per row (see ``specbatch_kernels._triton_sampling``)."""
    from specbatch_kernels import _triton_sampling

    return _triton_sampling.coupled_sample(probs, keys)
