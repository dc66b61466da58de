"""The rejection sampler: same decisions as the kernels' reference, greedy-exact, and lossless.

The lossless test drives the sampler directly at fixed contexts of two tiny models that
disagree (a flat target, a sharp draft from other weights), with the requests' own transforms
(temperature, top-k) on both, and compares the joint distribution of the first two emitted
tokens with the target's by a chi-square test. A deliberately broken sampler (resampling from
p instead of the residual) must fail the same test, which shows it has the power to notice.
"""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare
from transformers import AutoModelForCausalLM

from engine.sampler import SampleRow, filter_and_normalise
from engine.sampling_params import SamplingParams
from engine.spec.rejection import accept_greedy, accept_resample
from engine.testing import make_tiny_model
from kernels.sampling import rejection_sample_torch
from tests.engine.fakes import make_seq


def random_case(gen: torch.Generator, n: int, vocab: int, with_q: bool):
    p = torch.softmax(2 * torch.randn(n + 1, vocab, generator=gen), -1)
    q = torch.softmax(2 * torch.randn(n, vocab, generator=gen), -1) if with_q else None
    drafts = torch.randint(0, vocab, (n,), generator=gen)
    likely = torch.rand(n, generator=gen) < 0.6
    drafts = torch.where(likely, p[:n].argmax(-1), drafts).tolist()
    uniforms = torch.rand(n, generator=gen)
    exponentials = torch.empty(vocab).exponential_(generator=gen)
    return p, q, drafts, uniforms, exponentials


@pytest.mark.parametrize("with_q", [True, False])
def test_decisions_match_the_kernel_reference(with_q):
    gen = torch.Generator().manual_seed(0)
    for trial in range(300):
        n = trial % 6
        p, q, drafts, u, e = random_case(gen, n, 13, with_q)
        tokens, accepted = accept_resample(p, drafts, q, u, e)
        ref_tokens, ref_accepted = rejection_sample_torch(
            torch.tensor([drafts], dtype=torch.long).view(1, n),
            torch.tensor([n]),
            p[None],
            q[None] if q is not None else None,
            u[None],
            e.expand(1, n + 1, 13),
        )
        assert accepted == int(ref_accepted[0])
        assert tokens == ref_tokens[0, : accepted + 1].tolist()


def test_greedy_accepts_the_agreeing_prefix_then_the_argmax():
    assert accept_greedy([4, 2, 7, 1], [4, 2, 5]) == ([4, 2, 7], 2)
    assert accept_greedy([4, 2, 7, 1], [4, 2, 7]) == ([4, 2, 7, 1], 3)
    assert accept_greedy([9], []) == ([9], 0)
    assert accept_greedy([3, 3], [5]) == ([3], 0)


def broken_accept_resample(p, drafts, q, uniforms, exponentials):
    """Test-only bug: after a rejection, resample from p instead of the residual max(0, p - q)."""
    tokens, accepted = accept_resample(p, drafts, q, uniforms, exponentials)
    if accepted < len(drafts):
        tokens[-1] = int((p[accepted] / exponentials).argmax())
    return tokens, accepted


def broken_accept_ratio(p, drafts, q, uniforms, exponentials):
    """Test-only bug: accept with min(1, q/p) instead of min(1, p/q) (residual kept right)."""
    accepted = len(drafts)
    for i, d in enumerate(drafts):
        if not uniforms[i] * p[i, d] < q[i, d]:
            accepted = i
            break
    weights = p[accepted]
    if accepted < len(drafts):
        residual = (p[accepted] - q[accepted]).clamp(min=0)
        weights = residual if residual.sum() > 0 else weights
    return drafts[:accepted] + [int((weights / exponentials).argmax())], accepted


PARAMS = SamplingParams(temperature=1.0, top_k=6)
N_SAMPLES = 20_000


@pytest.fixture(scope="module")
def contexts(tmp_path_factory):
    """p0, P1[v] (target after ctx, ctx+v), q0, Q1[v] (draft), all after the request's transforms."""
    target_dir = make_tiny_model(tmp_path_factory.mktemp("target"), seed=1, logit_scale=0.5)
    draft_dir = make_tiny_model(tmp_path_factory.mktemp("draft"), seed=5, logit_scale=3.0)
    ctx = list(b"spec")
    out = []
    for path in (target_dir, draft_dir):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        vocab = model.config.vocab_size
        with torch.no_grad():
            first = model(torch.tensor([ctx])).logits[0, -1]
            batch = torch.tensor([ctx + [v] for v in range(vocab)])
            second = model(batch).logits[:, -1]
        seq = make_seq(ctx)
        seq.request.params = PARAMS
        rows = lambda m: [SampleRow(seq, [])] * m  # noqa: E731
        out.append(filter_and_normalise(first[None], rows(1))[0])
        out.append(filter_and_normalise(second, rows(vocab)))
    return out  # p0, P1, q0, Q1


def emitted_pairs(sampler, contexts, seed: int) -> torch.Tensor:
    """Counts of the first two emitted tokens over ``N_SAMPLES`` runs with k = 2 drafts.

    When a step emits only one token, the next comes from a plain step, as the engine would do.
    """
    p0, P1, q0, Q1 = contexts
    vocab = p0.shape[0]
    gen = torch.Generator().manual_seed(seed)
    d1 = torch.multinomial(q0, N_SAMPLES, replacement=True, generator=gen)
    d2 = torch.multinomial(Q1[d1], 1, generator=gen)[:, 0]
    filler = torch.full((vocab,), 1.0 / vocab)
    counts = torch.zeros(vocab, vocab)
    for a, b in zip(d1.tolist(), d2.tolist()):
        target = torch.stack([p0, P1[a], filler])
        draft = torch.stack([q0, Q1[a]])
        uniforms = torch.rand(2, generator=gen)
        exponentials = torch.empty(vocab).exponential_(generator=gen)
        tokens, _ = sampler(target, [a, b], draft, uniforms, exponentials)
        x1 = tokens[0]
        x2 = tokens[1] if len(tokens) > 1 else int(torch.multinomial(P1[x1], 1, generator=gen))
        counts[x1, x2] += 1
    return counts


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Chi-square goodness of fit; cells expecting fewer than 5 samples are pooled into one."""
    counts, expected = counts.flatten().double(), probs.flatten().double() * counts.sum()
    big = expected >= 5
    obs, exp = counts[big], expected[big]
    rest_obs, rest_exp = counts[~big].sum(), expected[~big].sum()
    if rest_exp > 0 or rest_obs > 0:
        obs, exp = torch.cat([obs, rest_obs[None]]), torch.cat([exp, rest_exp[None]])
    assert int(big.sum()) >= 5  # enough cells for the test to mean something
    if bool(((exp == 0) & (obs > 0)).any()):
        return 0.0  # a token the target never emits: as far from it as can be
    return float(chisquare(obs.numpy(), (exp * obs.sum() / exp.sum()).numpy()).pvalue)


def chi_square_p(counts: torch.Tensor, contexts) -> float:
    p0, P1, _, _ = contexts
    return chi2_pvalue(counts, p0[:, None] * P1)


def test_target_and_draft_really_differ(contexts):
    p0, _, q0, _ = contexts
    assert 0.5 * (p0 - q0).abs().sum() > 0.3


def test_emitted_tokens_follow_the_target_distribution(contexts):
    counts = emitted_pairs(accept_resample, contexts, seed=1)
    assert chi_square_p(counts, contexts) > 0.001


@pytest.mark.parametrize("broken", [broken_accept_resample, broken_accept_ratio])
def test_the_chi_square_test_rejects_a_broken_sampler(contexts, broken):
    counts = emitted_pairs(broken, contexts, seed=1)
    assert chi_square_p(counts, contexts) < 0.001


def test_point_mass_drafts_are_lossless(contexts):
    """n-gram style drafts (no probabilities): the first token still follows p0."""
    p0, P1, _, _ = contexts
    vocab = p0.shape[0]
    gen = torch.Generator().manual_seed(2)
    draft = int(p0.argsort()[-2])  # a plausible but not the likeliest token
    counts = torch.zeros(vocab)
    for _ in range(N_SAMPLES):
        target = torch.stack([p0, P1[draft]])
        tokens, _ = accept_resample(target, [draft], None, torch.rand(1, generator=gen),
                                    torch.empty(vocab).exponential_(generator=gen))
        counts[tokens[0]] += 1
    assert chi2_pvalue(counts, p0) > 0.001
