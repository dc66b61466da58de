"""Triton kernel for the rejection sampler's accept/resample step (see ``kernels.sampling``).

Imported lazily, like the other ``kernels._triton_*`` modules.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rejection_sample_kernel(
    draft_ptr, num_drafts_ptr, target_ptr, draft_probs_ptr, uniforms_ptr, exp_ptr,
    tokens_ptr, num_accepted_ptr,
    K: tl.constexpr, V, HAS_DRAFT_PROBS: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """One sequence: walk its drafts until the first rejection, then one draw over the vocab.

    The draw keeps two running argmaxes of ``w / E`` in a single pass over the vocabulary (``w``
    the residual and ``w`` the target distribution) and the residual's sum, which decides
    between them at the end (an all-zero residual falls back to the target).
    """
    b = tl.program_id(0).to(tl.int64)
    n = tl.load(num_drafts_ptr + b).to(tl.int32)
    i = 0
    accepting = n > 0
    while accepting:
        d = tl.load(draft_ptr + b * K + i).to(tl.int64)
        p = tl.load(target_ptr + (b * (K + 1) + i) * V + d)
        if HAS_DRAFT_PROBS:
            q = tl.load(draft_probs_ptr + (b * K + i) * V + d)
        else:
            q = 1.0
        accepting = tl.load(uniforms_ptr + b * K + i) * q < p
        tl.store(tokens_ptr + b * (K + 1) + i, d, mask=accepting)
        i += accepting.to(tl.int32)
        accepting = accepting & (i < n)

    rejected = i < n
    last = tl.minimum(i, K - 1)  # the rejected draft's position (unused for a bonus draw)
    if K > 0:
        d_last = tl.load(draft_ptr + b * K + last).to(tl.int64)
    else:
        d_last = -1
    row = (b * (K + 1) + i) * V
    best_res, idx_res = -1.0, 0
    best_tgt, idx_tgt = -1.0, 0
    residual_sum = 0.0
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        mask = offs < V
        p = tl.load(target_ptr + row + offs, mask=mask, other=0.0)
        e = tl.load(exp_ptr + row + offs, mask=mask, other=1.0)
        if HAS_DRAFT_PROBS:
            q = tl.load(draft_probs_ptr + (b * K + last) * V + offs, mask=mask, other=0.0)
            q = tl.where(rejected, q, 0.0)
        else:
            q = tl.where(rejected & (offs == d_last), 1.0, 0.0)
        residual = tl.maximum(p - q, 0.0)
        residual_sum += tl.sum(residual, axis=0)
        score = tl.where(mask, residual / e, -1.0)
        j = tl.argmax(score, axis=0)
        s = tl.max(score, axis=0)
        idx_res = tl.where(s > best_res, v0 + j, idx_res)  # strict: the earliest index wins ties
        best_res = tl.maximum(s, best_res)
        score = tl.where(mask, p / e, -1.0)
        j = tl.argmax(score, axis=0)
        s = tl.max(score, axis=0)
        idx_tgt = tl.where(s > best_tgt, v0 + j, idx_tgt)
        best_tgt = tl.maximum(s, best_tgt)
    token = tl.where(rejected & (residual_sum > 0), idx_res, idx_tgt)
    tl.store(tokens_ptr + b * (K + 1) + i, token.to(tl.int64))
    tl.store(num_accepted_ptr + b, i.to(tl.int64))


def rejection_sample(
    draft_tokens: torch.Tensor, num_drafts: torch.Tensor, target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None, uniforms: torch.Tensor, exponentials: torch.Tensor,
    block_v: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:
    batch, k = draft_tokens.shape
    vocab = target_probs.shape[-1]
    device = target_probs.device
    tokens = torch.full((batch, k + 1), -1, dtype=torch.long, device=device)
    num_accepted = torch.empty(batch, dtype=torch.long, device=device)
    if batch == 0:
        return tokens, num_accepted
    target_probs = target_probs.float().contiguous()
    has_draft = draft_probs is not None and k > 0  # with no drafts there is nothing to reject
    draft_probs = draft_probs.float().contiguous() if has_draft else target_probs  # unused if absent
    _rejection_sample_kernel[(batch,)](
        draft_tokens.contiguous(), num_drafts.contiguous(), target_probs, draft_probs,
        uniforms.float().contiguous(), exponentials.float().contiguous(), tokens, num_accepted,
        K=k, V=vocab, HAS_DRAFT_PROBS=has_draft,
        BLOCK_V=min(block_v, triton.next_power_of_2(vocab)),
    )
    return tokens, num_accepted
