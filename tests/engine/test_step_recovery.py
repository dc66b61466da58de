"""A step that raises: its requests are recomputed, a poison request fails alone, the loop
survives; a loop that dies hands every pending request back as ``EngineDied``."""

from __future__ import annotations

import threading

import pytest

from engine import EngineDied, EngineLoop, LLMEngine, SamplingParams
from engine.config import EngineConfig
from engine.faults import Faults

PROMPTS = [f"request number {i} asks something" for i in range(6)]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def run_all(engine: LLMEngine, prompts: list[str]) -> dict[str, object]:
    ids = {engine.add_request(p, params=GREEDY, request_id=f"r{i}"): p for i, p in enumerate(prompts)}
    outputs = {}
    while engine.has_unfinished():
        for request in engine.step():
            if request.is_finished:
                outputs[ids[request.request_id]] = engine.make_output(request)
    return outputs


@pytest.fixture
def engine(tiny_model_dir):
    return LLMEngine(EngineConfig(model=tiny_model_dir, device="cpu"))


def test_poison_request_fails_alone_and_the_rest_match_a_clean_run(engine, tiny_model_dir):
    clean = run_all(LLMEngine(EngineConfig(model=tiny_model_dir, device="cpu")), PROMPTS)
    engine.faults = Faults(poison="POISON")
    outputs = run_all(engine, PROMPTS[:3] + ["a POISON request"] + PROMPTS[3:])
    poisoned = outputs.pop("a POISON request")
    assert poisoned.error and "InjectedFault" in poisoned.error
    assert poisoned.outputs[0].finish_reason == "error"
    assert set(outputs) == set(PROMPTS)
    for prompt in PROMPTS:
        assert outputs[prompt].error is None
        assert outputs[prompt].outputs[0].token_ids == clean[prompt].outputs[0].token_ids
    # Failed once together, then twice alone (bounded), never more.
    assert engine.stats["failed_steps"] == 1 + engine.recovery.max_failures
    assert not engine.recovery.has_work()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_a_transient_step_failure_loses_nothing(engine, tiny_model_dir):
    clean = run_all(LLMEngine(EngineConfig(model=tiny_model_dir, device="cpu")), PROMPTS)
    forward = engine.runner.forward
    calls = {"n": 0}

    def flaky_forward(inputs):  # the 5th forward raises once, mid-decode, with all requests in it
        calls["n"] += 1
        if calls["n"] == 5:
            raise RuntimeError("device hiccup")
        return forward(inputs)

    engine.runner.forward = flaky_forward
    outputs = run_all(engine, PROMPTS)
    assert engine.stats["failed_steps"] == 1
    for prompt in PROMPTS:
        assert outputs[prompt].error is None
        assert outputs[prompt].outputs[0].token_ids == clean[prompt].outputs[0].token_ids
        assert outputs[prompt].metrics.num_preemptions >= 1  # recomputed, not restarted from scratch
        assert len(outputs[prompt].outputs[0].token_ids) == GREEDY.max_tokens


def test_a_dying_loop_hands_requests_back_as_engine_died(tiny_model_dir, monkeypatch):
    monkeypatch.setenv("SPECBATCH_FAULTS", '{"loop_dies_after_steps": 3}')
    died = threading.Event()
    # Every request is queued before the loop takes its first step, so all of them are in flight
    # when it dies after three: none can be refused at submit because the loop died first.
    loop = EngineLoop(LLMEngine(EngineConfig(model=tiny_model_dir, device="cpu")),
                      on_death=lambda exc: died.set())
    handles = [loop.submit(p, params=SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
               for p in PROMPTS]
    loop.start()
    for handle in handles:
        with pytest.raises(EngineDied):
            handle.result(timeout=60)
    assert died.wait(10) and loop.died
    loop._thread.join(10)
    assert not loop.running
    with pytest.raises(RuntimeError):
        loop.submit("too late", params=GREEDY)
