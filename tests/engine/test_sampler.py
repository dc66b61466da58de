import math

import pytest
import torch

from engine.detokenizer import StopChecker
from engine.sampler import SampleRow, Sampler, filter_and_normalise
from engine.sampling_params import SamplingParams
from tests.helpers.tiny_models import make_byte_tokenizer
from tests.engine.fakes import make_seq

EOS = 3


def row(params: SamplingParams, tokens=(1, 2), output=()):
    seq = make_seq(list(tokens))
    seq.request.params = params
    seq.token_ids.extend(output)
    return SampleRow(seq, [])


def sampler() -> Sampler:
    return Sampler({EOS})


def test_greedy_takes_argmax():
    logits = torch.tensor([[0.1, 2.0, 0.3, -1.0], [5.0, 0.0, 0.0, 0.0]])
    rows = [row(SamplingParams(temperature=0)), row(SamplingParams(temperature=0))]
    assert sampler().sample(logits, rows) == [1, 0]


def empirical(logits: torch.Tensor, params: SamplingParams, draws: int = 4000) -> torch.Tensor:
    s = sampler()
    r = row(params)
    counts = torch.zeros(logits.shape[-1])
    for i in range(draws):  # the noise is a function of (seed, sample, position): vary the seed
        r.seq.request.seed = i
        counts[s.sample(logits[None], [r])[0]] += 1
    return counts / draws


def test_temperature_sampling_follows_the_softmax():
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0])
    freq = empirical(logits, SamplingParams(temperature=0.7))
    expected = torch.softmax(logits / 0.7, -1)
    assert torch.allclose(freq, expected, atol=0.03)


def test_top_k_keeps_only_the_k_best():
    logits = torch.tensor([1.0, 0.9, 0.8, 0.7, 0.6, 0.5])
    freq = empirical(logits, SamplingParams(temperature=1.0, top_k=2), draws=1500)
    assert freq[2:].sum() == 0 and freq[0] > 0 and freq[1] > 0


def test_top_p_keeps_the_smallest_nucleus():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    p = filter_and_normalise(probs.log()[None], [row(SamplingParams(top_p=0.8))])[0]
    # 0.5 + 0.3 reaches 0.8: the nucleus is the first two tokens, renormalised.
    assert torch.allclose(p, torch.tensor([0.625, 0.375, 0.0, 0.0]), atol=1e-6)
    p = filter_and_normalise(probs.log()[None], [row(SamplingParams(top_p=0.81))])[0]
    assert (p > 0).tolist() == [True, True, True, False]


def test_min_p_drops_tokens_below_the_scaled_threshold():
    probs = torch.tensor([0.6, 0.3, 0.07, 0.03])
    p = filter_and_normalise(probs.log()[None], [row(SamplingParams(min_p=0.1))])[0]
    assert (p > 0).tolist() == [True, True, True, False]
    assert math.isclose(float(p.sum()), 1.0, rel_tol=1e-6)


def test_repetition_penalty_matches_its_definition():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    r = row(SamplingParams(temperature=0, repetition_penalty=2.0), tokens=(0,), output=(1,))
    out = sampler().processed_logits(logits, [r])
    assert out.tolist() == [[1.0, -4.0, 1.0, 0.5]]


def test_presence_and_frequency_penalties_count_output_tokens_only():
    logits = torch.zeros(1, 4)
    params = SamplingParams(temperature=0, presence_penalty=0.5, frequency_penalty=0.25)
    r = row(params, tokens=(3, 3), output=(1, 1, 2))
    out = sampler().processed_logits(logits, [r])
    assert out.tolist() == [[0.0, -1.0, -0.75, 0.0]]


def test_min_tokens_bans_eos_and_stop_ids_until_reached():
    logits = torch.tensor([[0.0, 1.0, 5.0, 10.0]])
    params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[2])
    early = row(params, output=(1,))
    late = row(params, output=(1, 1))
    assert sampler().sample(logits, [early]) == [1]
    assert sampler().sample(logits, [late]) == [EOS]


def test_seeded_rows_are_reproducible_and_independent_of_neighbours():
    torch.manual_seed(0)
    logits = torch.randn(1, 50)
    params = SamplingParams(temperature=1.0, seed=1234)
    positions = [row(params, output=(5,) * i) for i in range(20)]  # 20 successive positions
    alone = [sampler().sample(logits, [r])[0] for r in positions]
    assert len(set(alone)) > 1  # positions draw independent noise
    crowd = row(SamplingParams(temperature=1.0))
    together = [sampler().sample(torch.cat([torch.randn(1, 50), logits]), [crowd, r])[1] for r in positions]
    assert alone == together
    assert [sampler().sample(logits, [r])[0] for r in positions] == alone  # no generator state
    others = [row(SamplingParams(temperature=1.0, seed=4321), output=(5,) * i) for i in range(20)]
    assert [sampler().sample(logits, [r])[0] for r in others] != alone


def test_unseeded_requests_get_a_fresh_seed_each():
    rows = [row(SamplingParams(temperature=1.0)) for _ in range(8)]
    sampler().sample(torch.zeros(8, 10), rows)
    seeds = [r.seq.request.seed for r in rows]
    assert None not in seeds and len(set(seeds)) == 8


def test_logprobs_report_the_sampled_token_and_top_alternatives():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    lp = Sampler.logprobs(logits, [1], [2])[0]
    ref = torch.log_softmax(logits[0], -1)
    assert set(lp) == {1, 3, 2}
    assert all(math.isclose(lp[t], float(ref[t]), rel_tol=1e-6) for t in lp)


@pytest.fixture(scope="module")
def tokenizer():
    return make_byte_tokenizer()


def feed(checker: StopChecker, seq, text: str) -> int:
    """Append ``text`` byte-token by byte-token; return how many were taken before stopping."""
    ids = checker.tokenizer.encode(text)
    for i, t in enumerate(ids):
        if checker.append(seq, t):
            return i + 1
    return len(ids)


def test_stop_string_split_across_tokens_is_found(tokenizer):
    checker = StopChecker(tokenizer, {tokenizer.eos_token_id}, max_model_len=1000)
    seq = make_seq(tokenizer.encode("prompt"))
    seq.request.params = SamplingParams(max_tokens=100, stop=["END"])
    taken = feed(checker, seq, "hello ENDING more")
    assert taken == len("hello END")
    assert seq.finish_reason == "stop" and seq.stop_reason == "END"
    assert checker.final_text(seq) == "hello "


def test_stop_string_can_be_kept_in_output(tokenizer):
    checker = StopChecker(tokenizer, {tokenizer.eos_token_id}, max_model_len=1000)
    seq = make_seq(tokenizer.encode("p"))
    seq.request.params = SamplingParams(max_tokens=100, stop=["\n\n", "xyz"], include_stop_str_in_output=True)
    feed(checker, seq, "ab\n\ncd")
    assert checker.final_text(seq) == "ab\n\n"


def test_multibyte_characters_survive_incremental_decoding(tokenizer):
    checker = StopChecker(tokenizer, {tokenizer.eos_token_id}, max_model_len=1000)
    seq = make_seq(tokenizer.encode("p"))
    seq.request.params = SamplingParams(max_tokens=100, stop=["é!"])
    feed(checker, seq, "caf\u00e9 ol\u00e9!x")
    assert checker.final_text(seq) == "caf\u00e9 ol"


def test_stop_token_ids_eos_and_max_tokens(tokenizer):
    eos = tokenizer.eos_token_id
    checker = StopChecker(tokenizer, {eos}, max_model_len=1000)
    seq = make_seq([1])
    seq.request.params = SamplingParams(max_tokens=3, stop_token_ids=[42])
    assert not checker.append(seq, 5) and checker.append(seq, 42)
    assert (seq.finish_reason, seq.stop_reason) == ("stop", 42)
    seq = make_seq([1])
    seq.request.params = SamplingParams(max_tokens=3)
    assert checker.append(seq, eos) and seq.finish_reason == "stop"
    seq = make_seq([1])
    seq.request.params = SamplingParams(max_tokens=3, ignore_eos=True)
    assert [checker.append(seq, eos) for _ in range(3)] == [False, False, True]
    assert seq.finish_reason == "length"
