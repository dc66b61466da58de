"""EngineLoop: live submission from other threads into the running batch."""

import threading
import time

import pytest

from engine import EngineLoop, LLMEngine, SamplingParams
from engine.config import EngineConfig


@pytest.fixture
def loop(tiny_model_dir):
    engine = LLMEngine(EngineConfig(model=tiny_model_dir, device="cpu"))
    loop = EngineLoop(engine).start()
    yield loop
    loop.shutdown(drain_timeout=5)


def long_params(n=400):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def test_request_submitted_while_another_runs_joins_the_next_step(loop):
    first = loop.submit("first request", params=long_params(300))
    stream = iter(first)
    got = next(stream)  # the first request is decoding now
    assert got
    steps_before = loop.engine.stats["steps"]
    second = loop.submit("second request", params=long_params(20))
    out2 = second.result(timeout=60)
    out1 = first.result(timeout=120)
    # The second request ran in steps that also held the first one.
    assert out2.metrics.max_batch_size == 2
    assert out2.metrics.first_scheduled_time < out1.metrics.finished_time
    assert out2.metrics.arrival_time > out1.metrics.first_token_time
    # It joined promptly: within a few steps of its arrival, not after the first finished.
    assert out2.metrics.num_steps == 20
    assert loop.engine.stats["steps"] - steps_before < 300
    assert len(out1.outputs[0].token_ids) == 300 and len(out2.outputs[0].token_ids) == 20


def test_stream_yields_every_token_in_order(loop):
    handle = loop.submit("streaming", params=long_params(25))
    streamed = [t for chunk in handle for t in chunk]
    assert streamed == handle.result(timeout=5).outputs[0].token_ids


def test_abort_frees_blocks_and_ends_the_request(loop):
    handle = loop.submit("to be aborted", params=long_params(1000))
    next(iter(handle))
    loop.abort(handle.request_id)
    out = handle.result(timeout=30)
    assert out.outputs[0].finish_reason == "abort" and out.finished
    deadline = time.time() + 10
    while loop.engine.block_manager.num_free_blocks != loop.engine.block_manager.num_blocks:
        assert time.time() < deadline
        time.sleep(0.01)


def test_bad_input_raises_at_submit_and_the_loop_keeps_serving(loop):
    good = loop.submit("good one", params=long_params(30))
    with pytest.raises(ValueError, match="max_tokens"):
        loop.submit("bad", params={"max_tokens": 0})
    with pytest.raises(ValueError, match="prompt"):
        loop.submit("", params=long_params(3))
    assert good.result(timeout=60).outputs[0].finish_reason == "length"


def test_many_threads_submit_concurrently(loop):
    handles, errors = [], []

    def worker(i):
        try:
            handles.append(loop.submit(f"thread {i}", params=SamplingParams(temperature=0, max_tokens=5 + i % 7)))
        except Exception as exc:  # pragma: no cover - surfaced by the assert below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(40)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    outs = [h.result(timeout=120) for h in handles]
    assert all(o.finished and o.error is None for o in outs)
    assert max(o.metrics.max_batch_size for o in outs) > 1


class FailingEngine(LLMEngine):
    """Post-processing of one chosen request raises, as a bug in per-request code would."""

    poison = "poison"

    def _append_tokens(self, seq, tokens):
        if seq.request.request_id == self.poison:
            raise RuntimeError("boom")
        return super()._append_tokens(seq, tokens)


def test_an_exception_in_one_request_fails_only_that_request(tiny_model_dir):
    loop = EngineLoop(FailingEngine(EngineConfig(model=tiny_model_dir, device="cpu"))).start()
    try:
        ok = loop.submit("fine", params=long_params(30))
        bad = loop.submit("doomed", params=long_params(30), request_id="poison")
        bad_out = bad.result(timeout=60)
        assert bad_out.error and "boom" in bad_out.error
        assert bad_out.outputs[0].finish_reason == "error"
        ok_out = ok.result(timeout=60)
        assert ok_out.error is None and len(ok_out.outputs[0].token_ids) == 30
        later = loop.submit("after", params=long_params(5)).result(timeout=60)
        assert later.error is None
    finally:
        loop.shutdown(drain_timeout=5)


def test_shutdown_drains_running_requests(tiny_model_dir):
    loop = EngineLoop(LLMEngine(EngineConfig(model=tiny_model_dir, device="cpu"))).start()
    handle = loop.submit("drain me", params=long_params(50))
    loop.shutdown(drain_timeout=60)
    assert handle.result(timeout=1).outputs[0].finish_reason == "length"
    with pytest.raises(RuntimeError, match="shutting down"):
        loop.submit("too late", params=long_params(2))


def test_build_makes_the_engine_in_the_loop_thread_and_serves(tiny_model_dir):
    """All of the engine's torch work happens in one thread (one OpenMP team on the cores)."""
    built_in: list[threading.Thread] = []

    def factory():
        built_in.append(threading.current_thread())
        return LLMEngine(EngineConfig(model=tiny_model_dir, device="cpu"))

    loop = EngineLoop.build(factory, timeout=60)
    try:
        assert built_in == [loop._thread] and loop._thread is not threading.main_thread()
        out = loop.submit("hello", params=long_params(7)).result(timeout=60)
        assert len(out.outputs[0].token_ids) == 7
    finally:
        loop.shutdown(drain_timeout=5)


def test_build_raises_the_load_error(tmp_path):
    def factory():
        return LLMEngine(EngineConfig(model=str(tmp_path / "no-such-model"), device="cpu"))

    with pytest.raises(RuntimeError, match="building the engine failed"):
        EngineLoop.build(factory, timeout=60)
