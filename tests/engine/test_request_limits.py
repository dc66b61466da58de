"""Request limits at the engine: a ``max_tokens`` past the context is clamped (the sample ends
with ``length``), a prompt that alone fills the context is an error, and a running loop fed
fuzzed bad requests between good ones never stalls: every good one finishes."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from engine import EngineLoop, LLMEngine, SamplingParams
from engine.config import EngineConfig
from worker.request.convert import request_from_row

CONTEXT = 48


@pytest.fixture(scope="module")
def loop(tiny_model_dir):
    engine = LLMEngine(EngineConfig(model=tiny_model_dir, device="cpu", max_model_len=CONTEXT, max_num_seqs=8))
    loop = EngineLoop(engine).start()
    yield loop
    loop.shutdown(drain_timeout=5)


def test_max_tokens_past_the_context_ends_with_length(loop):
    prompt = list(range(40, 50))
    out = loop.submit(prompt, params=SamplingParams(temperature=0, max_tokens=10**9, min_tokens=10**6,
                                                    ignore_eos=True)).result(timeout=300)
    assert out.error is None and out.outputs[0].finish_reason == "length"
    assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == CONTEXT
    with pytest.raises(ValueError, match="over the model's context"):
        loop.submit(list(range(CONTEXT)), params=SamplingParams(max_tokens=1))


def _bad_rows(rng: random.Random) -> list[dict]:
    """Hostile job rows: wrong types, out-of-range numbers, broken prompts and messages."""
    return [
        {}, {"prompt": ""}, {"prompt": []}, {"prompt": [10**9]}, {"prompt": [-1, 2]},
        {"prompt": [True]}, {"prompt": "x", "messages": [{"role": "user", "content": "y"}]},
        {"messages": []}, {"messages": [{"role": "user"}]}, {"messages": "hi"}, {"messages": [["user", "hi"]]},
        {"prompt": "x", "params": {"temperature": float("nan")}}, {"prompt": "x", "params": {"n": 10**6}},
        {"prompt": "x", "params": {"max_tokens": -1}}, {"prompt": "x", "params": {"frobnicate": 1}},
        {"prompt": "x", "params": "max_tokens=3"}, {"prompt": "x", "params": {"seed": 2**70}},
        {"prompt": "x" * (CONTEXT + rng.randrange(100))}, {"prompt": "x", "params": {"stop": [""]}},
        {"prompt_token_ids_in": [rng.randrange(-10, 10**6) for _ in range(rng.randrange(1, 5))]},
    ]


@settings(max_examples=12, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(st.randoms(use_true_random=False))
def test_loop_never_stalls_on_bad_requests(loop, rng):
    """Bad job rows interleaved with good ones through the task's own path: each bad one fails
    at submission (``ValueError``), and every request the loop accepted finishes."""
    bad = _bad_rows(rng)
    rng.shuffle(bad)
    handles = []
    for i, row in enumerate(bad):
        good = json.loads(json.dumps({"prompt": f"good {i}", "params": {
            "max_tokens": 1 + rng.randrange(6), "temperature": rng.random(), "seed": rng.randrange(2**63)}}))
        for item in (good, row):
            try:
                req = request_from_row(item)
                handles.append((item is good, loop.submit(req.prompt, messages=req.messages, params=req.params)))
            except ValueError:
                assert item is not good
    assert sum(is_good for is_good, _ in handles) == len(bad)
    for is_good, handle in handles:
        out = handle.result(timeout=300)  # a hang guard, not a timing assertion
        assert out.error is None and out.outputs[0].finish_reason in ("stop", "length")
    assert loop.running
