"""Verification: which drafts a step keeps, and the one token it adds after them.

Default (``acceptance="coupled"``): every target row is sampled with the request's
counter-based noise (``Sampler.sample``), exactly as a step without speculation would sample
that position, and drafts are accepted while they equal those tokens (``accept_prefix``); the
first sampled token that differs (or the one after the last draft) is emitted too. The output
is therefore the non-speculative output, token for token, whatever k, batch or proposer, and
follows the target's distribution exactly. Greedy rows are the same rule with the argmax.

Opt-in (``acceptance="rejection"``): Leviathan et al. 2023 / Chen et al. 2023. Draft ``x_i`` is
accepted with probability ``min(1, p_i(x_i) / q_i(x_i))``; at the first rejection a token is
drawn from ``norm(max(0, p_i - q_i))``; when all drafts pass, a bonus token is drawn from
``p_n``. Drafts without probabilities are point masses. Its noise is counter-based too (streams
``ACCEPT`` and ``RESAMPLE``, independent of the draft's own ``SAMPLE`` noise), so a seeded
request is reproducible for a given configuration, but its text depends on k and on the
proposer: that is the price of its (slightly) higher acceptance.
"""

from __future__ import annotations

import torch

from specbatch_kernels.counter_rng import exponentials, keys_tensor, uniforms


def accept_prefix(sampled: list[int], drafts: list[int]) -> tuple[list[int], int]:
    """``(tokens, num_accepted)``: the drafts that equal the sampled tokens, then the next sampled one."""
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == sampled[accepted]:
        accepted += 1
    return drafts[:accepted] + [sampled[accepted]], accepted


accept_greedy = accept_prefix  # greedy rows are sampled by argmax: the same rule


def accept_resample(
    target_probs: torch.Tensor,
    drafts: list[int],
    draft_probs: torch.Tensor | None,
    uniforms_: torch.Tensor,
    exponentials_: torch.Tensor,
) -> tuple[list[int], int]:
    """Leviathan/Chen for one sequence: ``(tokens, num_accepted)``.

    ``target_probs[n + 1, V]``, ``draft_probs[n, V]`` or None, ``uniforms_[n]``, and
    ``exponentials_[V]`` (the final draw's noise) or ``[n + 1, V]`` (row ``num_accepted`` used).
    """
    n = len(drafts)
    accepted = n
    if n:
        idx = torch.tensor(drafts, device=target_probs.device)
        rows = torch.arange(n, device=target_probs.device)
        p = target_probs[rows, idx].double()
        q = draft_probs[rows, idx].double() if draft_probs is not None else torch.ones_like(p)
        rejected = ~(uniforms_.double() * q < p)
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
    noise = exponentials_[accepted] if exponentials_.dim() == 2 else exponentials_
    token = int((weights.double() / noise).argmax())
    return drafts[:accepted] + [token], accepted


def sample_rejection(
    target_probs: torch.Tensor,
    drafts: list[int],
    draft_probs: torch.Tensor | None,
    accept_keys: list[int],
    resample_keys: list[int],
) -> tuple[list[int], int]:
    """``accept_resample`` with counter-based noise: ``accept_keys[i]`` gives draft i's uniform,
    ``resample_keys[j]`` the noise of a resampled or bonus token at row j."""
    device = target_probs.device
    n, vocab = len(drafts), target_probs.shape[-1]
    u = uniforms(keys_tensor(accept_keys[:n], device), torch.zeros(n, dtype=torch.long, device=device))
    e = exponentials(keys_tensor(resample_keys, device)[:, None], torch.arange(vocab, device=device)[None])
    return accept_resample(target_probs, drafts, draft_probs, u, e)
