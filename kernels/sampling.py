"""The accept/resample step of speculative decoding's rejection sampler (arXiv 2211.17192).

Per sequence ``b`` with ``n = num_drafts[b]`` draft tokens ``d_0..d_{n-1}``:

- draft ``i`` is accepted while every earlier one was and ``u[b, i] * q_i(d_i) < p_i(d_i)``
  (``p``: target probabilities, ``q``: draft probabilities, a point mass on ``d_i`` when the
  proposer has none, as for n-gram drafts);
- at the first rejection ``i`` a token is drawn from ``max(p_i - q_i, 0)`` (renormalised; from
  ``p_i`` if that is all zero), and after ``n`` acceptances a bonus token is drawn from ``p_n``.

Draws use the exponential race: ``argmax_v(w_v / E_v)`` with ``E ~ Exp(1)`` samples exactly from
``w / sum(w)``. The uniforms and exponentials are inputs, so the Triton kernel and the torch
reference see the same randomness and must return identical tokens (per-request seeded
generators can make them reproducible). Greedy rows pass one-hot ``p``.

Shapes: ``draft_tokens[B, K]`` (int), ``num_drafts[B]`` (``<= K``), ``target_probs[B, K+1, V]``,
``draft_probs[B, K, V]`` or ``None``, ``uniforms[B, K]`` in ``[0, 1)``, ``exponentials[B, K+1, V]``.
Returns ``(tokens[B, K+1], num_accepted[B])``: accepted drafts, then the resampled or bonus
token, then ``-1``; ``num_accepted[b] + 1`` tokens are valid.
"""

from __future__ import annotations

import torch


def rejection_sample_torch(
    draft_tokens: torch.Tensor,
    num_drafts: torch.Tensor,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    uniforms: torch.Tensor,
    exponentials: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference (and CPU path), vectorised over sequences, looping over draft positions."""
    batch, k = draft_tokens.shape
    device = draft_tokens.device
    rows = torch.arange(batch, device=device)
    drafts = draft_tokens.long()
    tokens = torch.full((batch, k + 1), -1, dtype=torch.long, device=device)
    num_accepted = torch.zeros(batch, dtype=torch.long, device=device)
    running = torch.ones(batch, dtype=torch.bool, device=device)
    for i in range(k):
        running &= num_drafts.to(device) > i
        p = target_probs[rows, i, drafts[:, i]]
        q = draft_probs[rows, i, drafts[:, i]] if draft_probs is not None else torch.ones_like(p)
        running &= uniforms[:, i] * q < p
        tokens[running, i] = drafts[running, i]
        num_accepted += running.long()

    pos = num_accepted  # where each row's resampled or bonus token goes
    rejected = pos < num_drafts.to(device).long()
    p = target_probs[rows, pos].float()
    if draft_probs is not None:
        q = draft_probs[rows, pos.clamp(max=k - 1)].float() if k else torch.zeros_like(p)
    else:
        q = torch.zeros_like(p)
        if k:
            q[rows, drafts[rows, pos.clamp(max=k - 1)]] = 1.0
    residual = (p - q).clamp(min=0)
    use_residual = rejected & (residual.sum(dim=1) > 0)
    weights = torch.where(use_residual[:, None], residual, p)
    tokens[rows, pos] = (weights / exponentials[rows, pos]).argmax(dim=1)
    return tokens, num_accepted


def rejection_sample_triton(
    draft_tokens: torch.Tensor,
    num_drafts: torch.Tensor,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    uniforms: torch.Tensor,
    exponentials: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton ``rejection_sample_torch``: one program per sequence (see ``kernels._triton_sampling``)."""
    from kernels import _triton_sampling

    return _triton_sampling.rejection_sample(
        draft_tokens, num_drafts, target_probs, draft_probs, uniforms, exponentials
    )
