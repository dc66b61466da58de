"""Rejection sampler step: Triton vs the torch reference (identical tokens), and the reference
is lossless (its first token follows the target distribution) and greedy-exact."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kernels
from kernels.sampling import rejection_sample_torch
from paged_cases import DEVICE, EXAMPLES


def random_step(seed: int, batch: int, k: int, vocab: int, has_draft: bool, greedy_rows: int = 0):
    gen = torch.Generator().manual_seed(seed)
    target = torch.softmax(3 * torch.randn(batch, k + 1, vocab, generator=gen), dim=-1)
    target[:greedy_rows] = torch.nn.functional.one_hot(target[:greedy_rows].argmax(-1), vocab).float()
    draft_probs = torch.softmax(3 * torch.randn(batch, k, vocab, generator=gen), dim=-1) if has_draft else None
    drafts = torch.randint(0, vocab, (batch, k), generator=gen)
    likely = torch.rand(batch, k, generator=gen) < 0.6  # make acceptances common
    drafts = torch.where(likely, target[:, :k].argmax(-1), drafts)
    num_drafts = torch.randint(0, k + 1, (batch,), generator=gen)
    uniforms = torch.rand(batch, k, generator=gen)
    exponentials = torch.empty(batch, k + 1, vocab).exponential_(generator=gen)
    tensors = (drafts, num_drafts, target, draft_probs, uniforms, exponentials)
    return tuple(t.to(DEVICE) if t is not None else None for t in tensors)


@settings(max_examples=EXAMPLES, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    batch=st.integers(1, 6),
    k=st.integers(0, 5),
    vocab=st.sampled_from([1, 2, 7, 64, 300]),
    has_draft=st.booleans(),
    block_v=st.sampled_from([16, 1024]),
)
def test_triton_matches_reference(seed, batch, k, vocab, has_draft, block_v):
    from kernels import _triton_sampling

    step = random_step(seed, batch, k, vocab, has_draft, greedy_rows=batch // 2)
    want = rejection_sample_torch(*step)
    got = _triton_sampling.rejection_sample(*step, block_v=block_v)  # 16: many vocab chunks
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(kernels.rejection_sample(*step, backend="triton")[0], want[0])


def test_reference_is_lossless():
    """Draft ~ q, one draft: the first output token is distributed as p (total variation)."""
    gen = torch.Generator().manual_seed(0)
    n, vocab = 40_000, 5
    p = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])
    for q in (torch.tensor([0.1, 0.1, 0.2, 0.3, 0.3]), None):  # None: a point mass on token 3
        drafts = (torch.multinomial(q, n, replacement=True, generator=gen) if q is not None
                  else torch.full((n,), 3))[:, None]
        target = p.expand(n, 2, vocab)
        draft_probs = q.expand(n, 1, vocab) if q is not None else None
        uniforms = torch.rand(n, 1, generator=gen)
        exponentials = torch.empty(n, 2, vocab).exponential_(generator=gen)
        tokens, _ = rejection_sample_torch(drafts, torch.ones(n, dtype=torch.long), target,
                                           draft_probs, uniforms, exponentials)
        freq = torch.bincount(tokens[:, 0], minlength=vocab).float() / n
        assert 0.5 * (freq - p).abs().sum() < 0.015, (q, freq)


def test_greedy_rows_accept_exactly_the_argmax_prefix():
    target_ids = torch.tensor([[4, 2, 7, 1]])
    target = torch.nn.functional.one_hot(target_ids, 8).float()
    drafts = torch.tensor([[4, 2, 5]])  # the third draft is wrong
    tokens, accepted = rejection_sample_torch(drafts, torch.tensor([3]), target, None,
                                              torch.rand(1, 3), torch.ones(1, 4, 8))
    assert accepted.tolist() == [2] and tokens.tolist() == [[4, 2, 7, -1]]
    tokens, accepted = rejection_sample_torch(torch.tensor([[4, 2, 7]]), torch.tensor([3]), target,
                                              None, torch.rand(1, 3), torch.ones(1, 4, 8))
    assert accepted.tolist() == [3] and tokens.tolist() == [[4, 2, 7, 1]]  # plus the bonus token
