"""Verification is lossless: coupled (default) and Leviathan/Chen rejection (opt-in).

The lossless tests drive verification directly at fixed contexts of two tiny models that
disagree (a flat target, a sharp draft from other weights), with the requests' own transforms
(temperature, top-k) on both, and compare the joint distribution of the first two emitted
tokens with the target's by a chi-square test over 20,000 runs. Deliberately broken samplers
(noise reused across positions, a wrong acceptance rule, resampling from p instead of the
residual) must fail the same test, which shows it has the power to notice.
"""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from engine.model_hub import load_causal_lm
from engine.sampler import SampleRow, filter_and_normalise
from engine.sampling_params import SamplingParams
from engine.spec.rejection import accept_greedy, accept_prefix, accept_resample, sample_rejection
from tests.helpers.tiny_models import make_tiny_model
from specbatch_kernels.counter_rng import ACCEPT, RESAMPLE, keys_tensor, row_key
from specbatch_kernels.sampling import coupled_sample_torch
from tests.engine.fakes import make_seq


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
        model = load_causal_lm(path, dtype=torch.float32).eval()
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


POSITION = 4  # the absolute position of the first sampled token (the context is 4 tokens)


def race(probs: torch.Tensor, keys: list[int]) -> torch.Tensor:
    return coupled_sample_torch(probs, keys_tensor(keys, "cpu"))


def position_keys(seed: int, position: int) -> int:
    return row_key(seed, 0, position)


def broken_keys(seed: int, position: int) -> int:
    """Test-only bug: the noise ignores the position (reused at every step)."""
    return row_key(seed, 0, POSITION)


def broken_accept_in_support(sampled: list[int], drafts: list[int], target_rows: torch.Tensor):
    """Test-only bug: accept a draft whenever the target gives it any probability."""
    accepted = 0
    while accepted < len(drafts) and target_rows[accepted, drafts[accepted]] > 0:
        accepted += 1
    return drafts[:accepted] + [sampled[accepted]], accepted


def coupled_pairs(contexts, keys_of=position_keys, accept=None) -> torch.Tensor:
    """Counts of the first two emitted tokens over ``N_SAMPLES`` seeds with k = 2 coupled drafts.

    Seed s drafts d1, d2 from the draft model with the request's noise at positions 4 and 5,
    the target samples its rows (row 1 after d1) with the same noise, verification keeps the
    agreeing prefix; when a step emits one token the next is a plain step at position 5.
    """
    p0, P1, q0, Q1 = contexts
    vocab = p0.shape[0]
    k0 = [keys_of(s, POSITION) for s in range(N_SAMPLES)]
    k1 = [keys_of(s, POSITION + 1) for s in range(N_SAMPLES)]
    d1 = race(q0.expand(N_SAMPLES, vocab), k0)
    d2 = race(Q1[d1], k1)
    t0 = race(p0.expand(N_SAMPLES, vocab), k0).tolist()
    t1 = race(P1[d1], k1).tolist()
    counts = torch.zeros(vocab, vocab)
    first = []
    for s, (a, b) in enumerate(zip(d1.tolist(), d2.tolist())):
        sampled = [t0[s], t1[s], 0]  # the third row is never reached with two drafts ...
        if accept is None:
            tokens, _ = accept_prefix(sampled, [a, b])
        else:
            tokens, _ = accept(sampled, [a, b], torch.stack([p0, P1[a]]))
        first.append(tokens if len(tokens) < 3 else tokens[:2])  # ... its bonus token is not counted
    x1 = torch.tensor([t[0] for t in first])
    plain = race(P1[x1], k1).tolist()
    for s, tokens in enumerate(first):
        x2 = tokens[1] if len(tokens) > 1 else plain[s]
        counts[tokens[0], x2] += 1
    return counts


def test_coupled_emitted_tokens_follow_the_target_distribution(contexts):
    counts = coupled_pairs(contexts)
    assert chi_square_p(counts, contexts) > 0.001


def test_coupled_drafts_are_often_accepted_and_sometimes_not(contexts):
    """The draft really differs, and the coupling still makes it agree a fair share of the time."""
    p0, _, q0, _ = contexts
    keys = [position_keys(s, POSITION) for s in range(N_SAMPLES)]
    agree = float((race(p0.expand(N_SAMPLES, -1), keys) == race(q0.expand(N_SAMPLES, -1), keys)).float().mean())
    tv = 0.5 * float((p0 - q0).abs().sum())
    assert (1 - tv) / (1 + tv) - 0.02 < agree < 1 - tv + 0.02  # Gumbel coupling's known bounds


@pytest.mark.parametrize("broken", ["noise_reused", "accept_in_support"])
def test_the_chi_square_test_rejects_a_broken_coupled_sampler(contexts, broken):
    if broken == "noise_reused":
        counts = coupled_pairs(contexts, keys_of=broken_keys)
    else:
        counts = coupled_pairs(contexts, accept=broken_accept_in_support)
    assert chi_square_p(counts, contexts) < 0.001


def test_point_mass_drafts_are_lossless_coupled(contexts):
    """n-gram style drafts (a fixed token): the first emitted token still follows p0."""
    p0, P1, _, _ = contexts
    vocab = p0.shape[0]
    draft = int(p0.argsort()[-2])  # a plausible but not the likeliest token
    keys = [position_keys(s, POSITION) for s in range(N_SAMPLES)]
    t0 = race(p0.expand(N_SAMPLES, vocab), keys).tolist()
    counts = torch.zeros(vocab)
    for t in t0:
        tokens, _ = accept_prefix([t, 0], [draft])
        counts[tokens[0]] += 1
    assert chi2_pvalue(counts, p0) > 0.001


def rejection_with_counter_noise(p, drafts, q, uniforms, exponentials, seed=[0]):
    """``sample_rejection`` as the engine calls it (counter noise), with a fresh seed per call."""
    seed[0] += 1
    positions = range(POSITION, POSITION + len(drafts) + 1)
    return sample_rejection(p, drafts, q, [row_key(seed[0], 0, pos, ACCEPT) for pos in positions][:-1],
                            [row_key(seed[0], 0, pos, RESAMPLE) for pos in positions])


def test_rejection_with_counter_noise_follows_the_target_distribution(contexts):
    counts = emitted_pairs(rejection_with_counter_noise, contexts, seed=3)
    assert chi_square_p(counts, contexts) > 0.001


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
