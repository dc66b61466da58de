"""The engine end to end on a tiny random model: parity with HF, n > 1, logprobs, bad input."""

import pytest
import torch

from engine import LLM, SamplingParams
from engine.model_hub import load_causal_lm


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(tiny_model_dir, device="cpu", max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def hf(tiny_model_dir):
    return load_causal_lm(tiny_model_dir, dtype=torch.float32).eval()


PROMPTS = ["hello world", "a", "the quick brown fox jumps over the lazy dog " * 3, "0123456789", "zz top", "é"]


def test_greedy_matches_hf_generate_for_a_mixed_batch(llm, hf):
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (5, 17, 9, 30, 1, 12)]
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    for out, p in zip(outs, params):
        ids = torch.tensor([out.prompt_token_ids])
        ref = hf.generate(ids, max_new_tokens=p.max_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert out.outputs[0].token_ids == ref[0, ids.shape[1] :].tolist()
        assert out.outputs[0].finish_reason == "length"
        assert out.metrics.num_output_tokens == p.max_tokens


def test_outputs_come_back_in_input_order_with_metrics(llm):
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert [o.prompt for o in outs] == PROMPTS
    for o in outs:
        m = o.metrics
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
        assert m.num_prompt_tokens == len(o.prompt_token_ids)


def test_token_id_prompts_and_chat(llm):
    ids = llm.tokenizer.encode("hello world")
    a = llm.generate([ids], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)[0]
    b = llm.generate(["hello world"], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)[0]
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    chat = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    expected = llm.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    expected = expected["input_ids"] if isinstance(expected, dict) or hasattr(expected, "input_ids") else expected
    assert chat[0].prompt_token_ids == list(expected)


def test_n_samples_share_the_prompt_blocks(llm):
    engine = llm.engine
    prompt = "shared system prompt that spans several blocks of sixteen tokens each, " * 2
    request = engine.make_request(prompt, params=SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8))
    engine.add(request)
    shared_seen = False
    while engine.has_unfinished():
        engine.step()
        tables = [s.block_table for s in request.seqs if not s.is_finished]
        if len(tables) == 3 and all(t for t in tables):
            full = len(request.prompt_token_ids) // engine.block_manager.block_size
            shared_seen |= tables[0][:full] == tables[1][:full] == tables[2][:full]
    assert shared_seen
    out = engine.make_output(request)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # different samples
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_each_of_n_samples_is_its_own_seeds_one_sample_request(llm):
    """Sample i of a request seeded s draws what a one-sample request seeded sample_seed(s, i)
    draws: the seed a table output records per sample reruns that sample alone."""
    from engine.sampler import sample_seed

    params = dict(temperature=1.0, max_tokens=12, ignore_eos=True)
    together = llm.generate(["hello world"], SamplingParams(n=3, seed=11, **params), use_tqdm=False)[0]
    seeds = [sample_seed(11, i) for i in range(3)]
    assert seeds[0] == 11 and len(set(seeds)) == 3 and all(0 <= s < 2**63 for s in seeds)
    alone = llm.generate(["hello world"] * 3, [SamplingParams(seed=s, **params) for s in seeds], use_tqdm=False)
    assert [c.token_ids for c in together.outputs] == [o.outputs[0].token_ids for o in alone]
    assert len({tuple(c.token_ids) for c in together.outputs}) > 1


def test_prefix_cache_hit_is_counted_and_gives_the_same_tokens(llm):
    prompt = "a long shared prefix for the prefix cache, a long shared prefix! " * 2
    params = SamplingParams(temperature=0, max_tokens=8)
    first = llm.generate([prompt], params, use_tqdm=False)[0]
    second = llm.generate([prompt], params, use_tqdm=False)[0]
    assert second.metrics.num_cached_tokens >= 16
    assert first.outputs[0].token_ids == second.outputs[0].token_ids


def test_logprobs_and_stop_strings(llm):
    out = llm.generate(["hello"], SamplingParams(temperature=0, max_tokens=5, logprobs=3), use_tqdm=False)[0]
    lps = out.outputs[0].logprobs
    assert len(lps) == 5
    for token, lp in zip(out.outputs[0].token_ids, lps):
        assert token in lp and len(lp) >= 3 and all(v <= 0 for v in lp.values())
    text = llm.generate(["hello"], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)[0]
    full = text.outputs[0].text
    stop = full[3:5]
    stopped = llm.generate(["hello"], SamplingParams(temperature=0, max_tokens=20, stop=[stop]), use_tqdm=False)[0]
    assert stopped.outputs[0].text == full[: full.find(stop)]
    assert stopped.outputs[0].finish_reason == "stop" and stopped.outputs[0].stop_reason == stop


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"prompt": ""}, "prompt"),
        ({"prompt": 12}, "prompt"),
        ({"prompt": [1, "a"]}, "prompt"),
        ({"prompt": "x" * 5000}, "context"),
        ({"prompt": "ok", "params": {"max_tokens": 0}}, "max_tokens"),
        ({"prompt": "ok", "params": {"temperature": -1.0}}, "temperature"),
        ({"prompt": "ok", "params": {"top_p": 0.0}}, "top_p"),
        ({"prompt": "ok", "params": {"top_p": 1.5}}, "top_p"),
        ({"prompt": "ok", "params": {"max_tokens": "10"}}, "max_tokens"),
        ({"prompt": "ok", "params": {"temperature": "hot"}}, "temperature"),
        ({"prompt": "ok", "params": {"bogus": 1}}, "bogus"),
        ({"messages": [{"role": "user"}]}, "content"),
    ],
)
def test_bad_input_is_a_value_error_naming_the_field(llm, kwargs, field):
    with pytest.raises(ValueError, match=field):
        llm.engine.make_request(**kwargs)


def test_a_bad_prompt_in_generate_fails_before_any_work(llm):
    with pytest.raises(ValueError, match="prompt"):
        llm.generate(["fine", ""], SamplingParams(max_tokens=2), use_tqdm=False)
    assert not llm.engine.has_unfinished()


def test_request_that_outgrows_the_kv_cache_fails_alone(tiny_model_dir):
    # 4 blocks of 16 tokens: the long request can start but never finish; the short ones do.
    small = LLM(tiny_model_dir, device="cpu", dtype="float32", kv_cache_memory_bytes=4 * 2 * 2 * 16 * 2 * 16 * 4)
    assert small.engine.block_manager.num_blocks == 4
    outs = small.generate(
        ["ab", "cd", "long request"],
        [SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)] * 2
        + [SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)],
        use_tqdm=False,
    )
    assert [o.outputs[0].finish_reason for o in outs] == ["length", "length", "error"]
    assert "KV-cache blocks" in outs[2].error
    assert small.engine.block_manager.num_free_blocks == 4
