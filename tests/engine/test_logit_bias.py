"""``logit_bias`` in the batched sampler and in speculative verification, and logprobs that
speculation leaves unchanged (issue #16), on tiny random models."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from engine import LLM, SamplingParams
from engine.sampler import SampleRow, Sampler, apply_logit_bias
from engine.sequence import Request, Sequence
from engine.outputs import RequestMetrics

PROMPTS = ["hello world hello world hello", "abcabcabcabcabc", "0123456789", "the quick brown fox"]
NGRAM = {"method": "ngram", "num_speculative_tokens": 4}


def _row(params: SamplingParams) -> SampleRow:
    request = Request("r", None, [1, 2], params, RequestMetrics(arrival_time=0.0))
    return SampleRow(Sequence(request, 0, [1, 2], 2), [])


def test_bias_is_added_bans_and_forces_per_row():
    logits = torch.zeros(3, 6)
    rows = [_row(SamplingParams(logit_bias={1: 2.5, 2: -100})), _row(SamplingParams()),
            _row(SamplingParams(logit_bias={4: 100, 5: 100, 0: -3}))]
    apply_logit_bias(logits, rows)
    inf = float("-inf")
    assert logits[0].tolist() == [0, 2.5, inf, 0, 0, 0]
    assert logits[1].tolist() == [0] * 6
    assert logits[2].tolist() == [inf, inf, inf, inf, 100, 100]


def test_sampler_never_draws_a_banned_token(flat_model_dir):
    """Sampled (flat distribution) and greedy: the most frequent token without bias never appears with -100."""
    llm = LLM(flat_model_dir, device="cpu")
    base = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True, n=3, seed=5)
    outs = llm.generate(PROMPTS, base, use_tqdm=False)
    counts = Counter(t for o in outs for c in o.outputs for t in c.token_ids)
    banned = counts.most_common(1)[0][0]
    assert counts[banned] >= 3
    for temperature in (1.0, 0.0):
        params = SamplingParams(temperature=temperature, max_tokens=24, ignore_eos=True, n=3, seed=5,
                                logit_bias={banned: -100})
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        assert all(banned not in c.token_ids for o in outs for c in o.outputs)


def test_plus_100_forces_the_token(flat_model_dir):
    llm = LLM(flat_model_dir, device="cpu")
    params = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True, seed=3, logit_bias={"65": 100})
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert all(o.outputs[0].token_ids == [65] * 10 for o in outs)


def test_out_of_vocabulary_bias_fails_at_submission(tiny_model_dir):
    llm = LLM(tiny_model_dir, device="cpu")
    with pytest.raises(ValueError, match=r"^logit_bias: token id 100000 is outside the vocabulary"):
        llm.engine.make_request("x", params=SamplingParams(logit_bias={100000: 1}))


def test_a_bias_that_bans_every_token_is_refused_at_submission(tiny_model_dir):
    llm = LLM(tiny_model_dir, device="cpu")
    vocab = llm.engine.vocab_size
    with pytest.raises(ValueError, match=r"^logit_bias bans every token of the vocabulary"):
        llm.engine.make_request("x", params=SamplingParams(logit_bias={t: -100 for t in range(vocab)}))
    # One token left: allowed (it is the only candidate).
    llm.engine.make_request("x", params=SamplingParams(logit_bias={t: -100 for t in range(1, vocab)}))


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_a_sample_left_no_token_ends_at_eos(tiny_model_dir, temperature):
    """Every token but EOS banned by the bias and EOS banned by min_tokens: nothing is left to
    sample. The sample ends there with EOS ("stop"), not max_tokens copies of token 0 reported
    as a success; greedy and sampled, with speculation too."""
    for spec in (None, NGRAM):
        llm = LLM(tiny_model_dir, device="cpu", speculative_config=spec)
        eos = min(llm.engine.eos_ids)
        params = SamplingParams(temperature=temperature, max_tokens=20, min_tokens=10, seed=3,
                                logit_bias={t: -100 for t in range(llm.engine.vocab_size) if t != eos})
        for out in llm.generate(PROMPTS, params, use_tqdm=False):
            sample = out.outputs[0]
            assert (sample.token_ids, sample.finish_reason) == ([eos], "stop"), sample


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_speculation_samples_from_the_same_biased_distribution(tiny_model_dir, temperature):
    """Greedy and seeded sampling with a bias: ngram speculation gives the same tokens as none,
    and the tokens the bias bans or forces behave the same under verification."""
    plain = LLM(tiny_model_dir, device="cpu")
    reference = plain.generate(PROMPTS, SamplingParams(temperature=temperature, max_tokens=30, ignore_eos=True,
                                                       seed=11), use_tqdm=False)
    # Ban the token the unbiased run used most: the biased run must differ, and equal across speculation.
    banned = Counter(t for o in reference for t in o.outputs[0].token_ids).most_common(1)[0][0]
    params = SamplingParams(temperature=temperature, max_tokens=30, ignore_eos=True, seed=11,
                            logit_bias={banned: -100, (banned + 1) % 256: 3.0})
    want = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, params, use_tqdm=False)]
    spec = LLM(tiny_model_dir, device="cpu", speculative_config=NGRAM)
    got = [o.outputs[0].token_ids for o in spec.generate(PROMPTS, params, use_tqdm=False)]
    assert got == want
    assert all(banned not in ids for ids in got)
    assert spec.engine.stats["spec_draft_tokens"] > 0


def test_logprobs_are_unchanged_by_speculation(tiny_model_dir):
    """Tokens accepted from drafts get the logprobs (and top alternatives) of a plain run."""
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=5)
    want = LLM(tiny_model_dir, device="cpu").generate(PROMPTS, params, use_tqdm=False)
    spec = LLM(tiny_model_dir, device="cpu", speculative_config=NGRAM)
    got = spec.generate(PROMPTS, params, use_tqdm=False)
    assert spec.engine.stats["spec_accepted_tokens"] > 0
    for w, g in zip(want, got):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        for lw, lg, token in zip(w.outputs[0].logprobs, g.outputs[0].logprobs, w.outputs[0].token_ids):
            assert list(lg) == list(lw)  # same tokens, same order (the sampled one first)
            assert lg == pytest.approx(lw, abs=1e-4)  # the same rows' log-softmax, up to float rounding
            assert max(lw, key=lw.get) == token  # greedy: top-1 is the chosen token
