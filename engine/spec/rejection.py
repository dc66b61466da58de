"""The engine's rejection sampler: accept or resample drafts so outputs follow the target exactly.

Leviathan et al. 2023 / Chen et al. 2023: draft ``x_i`` is accepted with probability
``min(1, p_i(x_i) / q_i(x_i))``; at the first rejection a token is drawn from
``norm(max(0, p_i - q_i))``; when all drafts pass, a bonus token is drawn from ``p_n``. Drafts
without probabilities are point masses (``q_i = onehot(x_i)``). Greedy requests need no
randomness: drafts are accepted while they equal the target's argmax, which is also the
correction or bonus token.

This is ``kernels.sampling.rejection_sample_torch`` for one sequence at a time (same comparison
``u * q < p``, same residual, same exponential race), drawing its uniforms and one row of
exponentials from the request's own generator instead of taking a full ``[K + 1, V]`` noise
tensor: on the CPU that noise would cost more than the rest of verification.
"""

from __future__ import annotations

import torch


def accept_resample(
    target_probs: torch.Tensor,
    drafts: list[int],
    draft_probs: torch.Tensor | None,
    uniforms: torch.Tensor,
    exponentials: torch.Tensor,
) -> tuple[list[int], int]:
    """``(tokens, num_accepted)`` for one sequence: the accepted drafts then one more token.

    ``target_probs[n + 1, V]``, ``draft_probs[n, V]`` or None, ``uniforms[n]``, ``exponentials[V]``.
    """
    n = len(drafts)
    accepted = n
    if n:
        idx = torch.tensor(drafts, device=target_probs.device)
        rows = torch.arange(n, device=target_probs.device)
        p = target_probs[rows, idx]
        q = draft_probs[rows, idx] if draft_probs is not None else torch.ones_like(p)
        rejected = ~(uniforms * q < p)
        if bool(rejected.any()):
            accepted = int(rejected.int().argmax())
    weights = target_probs[accepted]
    if accepted < n:
        if draft_probs is not None:
            residual = (weights - draft_probs[accepted]).clamp(min=0)
        else:
            residual = weights.clone()
            residual[drafts[accepted]] = 0.0
        if float(residual.sum()) > 0:
            weights = residual
    token = int((weights / exponentials).argmax())
    return drafts[:accepted] + [token], accepted


def sample_with_generator(
    target_probs: torch.Tensor,
    drafts: list[int],
    draft_probs: torch.Tensor | None,
    generator: torch.Generator | None,
) -> tuple[list[int], int]:
    """``accept_resample`` with noise drawn from ``generator`` (the request's, when seeded)."""
    device = target_probs.device
    uniforms = torch.rand(len(drafts), generator=generator, device=device)
    exponentials = torch.empty(target_probs.shape[-1], device=device).exponential_(1.0, generator=generator)
    return accept_resample(target_probs, drafts, draft_probs, uniforms, exponentials)


def accept_greedy(target_argmax: list[int], drafts: list[int]) -> tuple[list[int], int]:
    """Greedy verification: the longest agreeing prefix, then the target's own token."""
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == target_argmax[accepted]:
        accepted += 1
    return drafts[:accepted] + [target_argmax[accepted]], accepted
