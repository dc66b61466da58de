"""Speculation inside the engine on tiny models: greedy and seeded sampled outputs equal
non-speculative ones with every method, through stops, logprobs, preemption and n > 1; the draft model's own KV cache
catches up exactly; a failing proposer fails nothing; metrics and stats add up."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, EngineLoop, SamplingParams, SpeculativeConfig
from tests.helpers.tiny_models import make_tiny_model

PROMPTS = [
    "hello world hello world hello",
    "the quick brown fox jumps over the lazy dog, the quick brown fox",
    "abcabcabcabcabc",
    "0123456789",
    "z",
]
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def other_model_dir(tmp_path_factory) -> str:
    """Same tokenizer as ``tiny_model_dir``, other weights: a draft that is often wrong."""
    return str(make_tiny_model(tmp_path_factory.mktemp("other"), seed=3, logit_scale=8.0))


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    llm = LLM(tiny_model_dir, device="cpu", dtype="float32")
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def configs(tiny_dir: str, other_dir: str) -> dict[str, dict]:
    return {
        "ngram-k4": {"method": "ngram", "num_speculative_tokens": 4},
        "ngram-auto": {"method": "ngram"},
        "suffix-k5": {"method": "suffix", "num_speculative_tokens": 5},
        "suffix-auto": {"method": "suffix"},
        "draft-self-k3": {"method": "draft", "draft_model": tiny_dir, "num_speculative_tokens": 3},
        "draft-other-k2": {"method": "draft", "draft_model": other_dir, "num_speculative_tokens": 2},
        "draft-other-auto": {"method": "draft", "draft_model": other_dir},
    }


@pytest.mark.parametrize("name", list(configs("", "")))
def test_greedy_outputs_equal_non_speculative(name, tiny_model_dir, other_model_dir, reference):
    config = configs(tiny_model_dir, other_model_dir)[name]
    llm = LLM(tiny_model_dir, device="cpu", dtype="float32", speculative_config=config)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference
    stats = llm.engine.stats
    assert stats["spec_accepted_tokens"] <= stats["spec_draft_tokens"]
    assert sum(o.metrics.num_draft_tokens for o in outs) == stats["spec_draft_tokens"]
    assert sum(o.metrics.num_accepted_tokens for o in outs) == stats["spec_accepted_tokens"]
    if "auto" not in name:
        assert stats["spec_draft_tokens"] > 0
    if name == "draft-self-k3":  # the target drafting for itself is always right
        assert stats["spec_accepted_tokens"] == stats["spec_draft_tokens"]
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_stops_and_logprobs_under_speculation(tiny_model_dir):
    plain = LLM(tiny_model_dir, device="cpu", dtype="float32")
    spec = LLM(tiny_model_dir, device="cpu", dtype="float32", speculative_config={"method": "ngram", "num_speculative_tokens": 6})
    full = plain.generate(PROMPTS[:1], GREEDY, use_tqdm=False)[0].outputs[0]
    stop = full.text[10:13]
    params = [
        SamplingParams(temperature=0, max_tokens=40, stop=[stop]),
        SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[full.token_ids[7]], ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=13, ignore_eos=True, logprobs=2),
    ]
    want = plain.generate(PROMPTS[:1] * 3, params, use_tqdm=False)
    got = spec.generate(PROMPTS[:1] * 3, params, use_tqdm=False)
    for w, g in zip(want, got):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert g.outputs[0].text == w.outputs[0].text
        assert g.outputs[0].finish_reason == w.outputs[0].finish_reason
    assert got[0].outputs[0].stop_reason == stop
    assert len(got[2].outputs[0].logprobs) == 13
    for lw, lg in zip(want[2].outputs[0].logprobs, got[2].outputs[0].logprobs):
        assert lw.keys() == lg.keys()
        assert all(abs(lw[t] - lg[t]) < 1e-4 for t in lw)
    assert got[2].metrics.num_accepted_tokens > 0


def test_preemption_with_a_draft_model_keeps_outputs(tiny_model_dir, reference):
    # 12 blocks of 16 tokens for five sequences growing to ~60 tokens: preemption is certain.
    kv = 12 * 2 * 2 * 16 * 2 * 16 * 4
    llm = LLM(tiny_model_dir, device="cpu", dtype="float32", kv_cache_memory_bytes=kv,
              speculative_config={"method": "draft", "draft_model": tiny_model_dir, "num_speculative_tokens": 4})
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_draft_kv_cache_catches_up_on_accepted_tokens(tiny_model_dir):
    """With the target as its own draft, the draft cache must hold the target's K/V wherever it
    claims to be valid, step after step (same weights, same tokens, same positions)."""
    llm = LLM(tiny_model_dir, device="cpu", dtype="float32",
              speculative_config={"method": "draft", "draft_model": tiny_model_dir, "num_speculative_tokens": 3})
    engine = llm.engine
    proposer = engine.speculator.proposer
    for prompt in PROMPTS[:3]:
        engine.add_request(prompt, params=GREEDY)
    checked = 0
    while engine.has_unfinished():
        engine.step()
        for seq in engine.scheduler.running:
            state = proposer.states.get(seq.seq_id)
            if state is None:
                continue
            valid = min(state.base, seq.num_computed_tokens)
            pos = torch.arange(valid)
            table = torch.tensor(seq.block_table)
            slots = table[pos // 16] * 16 + pos % 16
            for (tk, tv), (dk, dv) in zip(engine.runner.kv_caches, proposer.runner.kv_caches):
                kt, kd = tk.view(-1, *tk.shape[2:])[slots], dk.view(-1, *dk.shape[2:])[slots]
                torch.testing.assert_close(kd, kt, atol=1e-4, rtol=1e-4)
            checked += valid
    assert checked > 100


SAMPLED = SamplingParams(n=3, temperature=0.8, top_p=0.9, seed=11, max_tokens=20, ignore_eos=True,
                         repetition_penalty=1.2, logprobs=0)


@pytest.fixture(scope="module")
def sampled_reference(tiny_model_dir):
    llm = LLM(tiny_model_dir, device="cpu", dtype="float32")
    return [[c.token_ids for c in o.outputs] for o in llm.generate(PROMPTS, SAMPLED, use_tqdm=False)]


@pytest.mark.parametrize("name", list(configs("", "")))
def test_seeded_sampled_outputs_equal_non_speculative(name, tiny_model_dir, other_model_dir, sampled_reference):
    """Coupled verification: the same noise per (seed, sample, position), so the same tokens."""
    config = configs(tiny_model_dir, other_model_dir)[name]
    llm = LLM(tiny_model_dir, device="cpu", dtype="float32", speculative_config=config)
    outs = llm.generate(PROMPTS, SAMPLED, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in outs] == sampled_reference
    assert all(len(c.logprobs) == 20 for o in outs for c in o.outputs)
    if "auto" not in name:
        assert llm.engine.stats["spec_draft_tokens"] > 0


def test_rejection_mode_is_reproducible_and_reports_its_seed(tiny_model_dir, other_model_dir):
    llm = LLM(tiny_model_dir, device="cpu", dtype="float32", speculative_config={
        "method": "draft", "draft_model": other_model_dir, "num_speculative_tokens": 3, "acceptance": "rejection"})
    unseeded = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=20, ignore_eos=True)
    first = llm.generate(PROMPTS[:3], unseeded, use_tqdm=False)
    assert len({o.seed for o in first}) == 3  # a fresh seed per request, reported
    again = llm.generate(PROMPTS[:3], [SamplingParams(**{**unseeded.to_dict(), "seed": o.seed}) for o in first],
                         use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in first]
    assert llm.engine.stats["spec_draft_tokens"] > 0


def test_a_failing_proposer_fails_nothing(tiny_model_dir, reference, caplog):
    llm = LLM(tiny_model_dir, device="cpu", dtype="float32", speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    calls = {"n": 0}
    real = llm.engine.speculator.proposer.propose

    def flaky(seqs, ks):
        calls["n"] += 1
        if calls["n"] % 2:
            raise RuntimeError("proposer exploded")
        return real(seqs, ks)

    llm.engine.speculator.proposer.propose = flaky
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert all(o.error is None for o in outs)
    assert llm.engine.stats["spec_proposer_failures"] > 0
    assert "proposer exploded" in caplog.text


def test_engine_loop_takes_the_config_through_the_engine(tiny_model_dir, reference):
    llm = LLM(tiny_model_dir, device="cpu", dtype="float32", speculative_config=SpeculativeConfig("suffix", 4))
    loop = EngineLoop(llm.engine).start()
    try:
        handles = [loop.submit(p, params=GREEDY) for p in PROMPTS]
        assert [h.result(timeout=60).outputs[0].token_ids for h in handles] == reference
    finally:
        loop.shutdown(drain_timeout=5)


def test_auto_counts_the_draft_steps_overhead(tiny_model_dir):
    """Time spent around the draft's forwards (layout, sampling) is measured and priced into
    every draft step of the cost model, so a draft that is slow only outside its forward still
    switches speculation off."""
    llm = LLM(tiny_model_dir, device="cpu", dtype="float32",
              speculative_config={"method": "draft", "draft_model": tiny_model_dir, "num_speculative_tokens": 3})
    spec = llm.engine.speculator
    for prompt in PROMPTS[:2]:
        llm.engine.add_request(prompt, params=GREEDY)
    while llm.engine.has_unfinished():
        llm.engine.step()
    assert llm.engine.stats["spec_draft_tokens"] > 0
    assert spec.draft_overhead_per_step > 0  # measured around the draft's forwards
    base = spec.step_ratios(1, 3)
    plain = spec.target_cost.predict(1, 1)
    spec.draft_overhead_per_step += 0.5 * plain
    slower = spec.step_ratios(1, 3)
    for k in (1, 2, 3):
        assert slower[k] == pytest.approx(base[k] + k * 0.5)


@pytest.mark.parametrize("name", [None, "ngram-k4", "draft-other-k2"])
def test_compiled_decode_step_keeps_outputs(name, tiny_model_dir, other_model_dir, reference, sampled_reference):
    """With ``compile_step`` decode and verification steps run compiled (a verification step as
    one decode row per token): greedy and seeded sampled outputs still equal the eager
    non-speculative ones."""
    from specbatch_kernels.cpu_ops import load_cpu_ops

    assert load_cpu_ops(), "the specbatch CPU ops did not build (a C++ compiler is on every machine we test on)"
    config = configs(tiny_model_dir, other_model_dir)[name] if name else None
    llm = LLM(tiny_model_dir, device="cpu", dtype="float32", speculative_config=config, compile_step=True)
    compiled = llm.engine.runner.compiled
    assert compiled is not None
    verifications = []
    run = compiled.run
    compiled.run = lambda inputs: verifications.append(inputs.metadata.max_query_len > 1) or run(inputs)
    try:
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == reference
        outs = llm.generate(PROMPTS, SAMPLED, use_tqdm=False)
    finally:
        del compiled.run
    assert [[c.token_ids for c in o.outputs] for o in outs] == sampled_reference
    assert llm.engine.runner.compiled is compiled  # nothing fell back to eager
    assert any(verifications) == (name is not None)  # verification steps ran compiled too


@pytest.mark.parametrize("name", ["ngram-k4", "suffix-k5"])
def test_speculation_is_exact_in_bfloat16_through_the_compiled_step(name, flat_model_dir, tiny_model_dir,
                                                                      other_model_dir):
    """A verification row runs the decode graph as the step at its position would, so greedy
    speculation equals no speculation bit for bit in bfloat16 too, on a model whose choices are
    near ties (flat logits). Verification through the eager prefill path rounds otherwise: it
    changed one of these five outputs under ngram-k4."""
    from specbatch_kernels.cpu_ops import load_cpu_ops

    assert load_cpu_ops(), "the specbatch CPU ops did not build"
    plain = LLM(flat_model_dir, device="cpu", dtype="bfloat16", compile_step=True)
    want = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, GREEDY, use_tqdm=False)]
    llm = LLM(flat_model_dir, device="cpu", dtype="bfloat16", compile_step=True,
              speculative_config=configs(tiny_model_dir, other_model_dir)[name])
    compiled = llm.engine.runner.compiled
    assert compiled is not None and plain.engine.runner.compiled is not None
    verifications = []
    run = compiled.run
    compiled.run = lambda inputs: verifications.append(inputs.metadata.max_query_len > 1) or run(inputs)
    try:
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == want
    finally:
        del compiled.run
    assert any(verifications) and llm.engine.runner.compiled is compiled
