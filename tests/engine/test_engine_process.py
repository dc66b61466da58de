"""``EngineProcess``: the engine loop in a child process, killed and stopped for real."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from functools import partial
from pathlib import Path

import pytest

from engine import LLM, EngineDied, EngineLoop, SamplingParams
from engine.process import EngineProcess, llm_engine

ROOT = Path(__file__).resolve().parents[2]
GREEDY = dict(max_tokens=12, temperature=0.0, ignore_eos=True)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by its parent) counts as gone.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_gone(pid: int, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not pid_alive(pid):
            return True
        time.sleep(0.05)
    return False


@pytest.fixture
def engine_process(tiny_model_dir):
    deaths: list[BaseException] = []
    steps: list[tuple] = []
    engine = EngineProcess.build(partial(llm_engine, tiny_model_dir, "cpu", {"max_num_seqs": 4}),
                                 on_death=deaths.append, on_step=lambda *a: steps.append(a))
    engine.deaths, engine.steps = deaths, steps
    yield engine
    engine.shutdown(drain_timeout=1.0)


def test_outputs_match_the_in_process_loop_and_bad_input_raises_at_submit(engine_process, tiny_model_dir):
    prompts = ["the quick brown fox", "hello world", "one two three four five"]
    handles = [engine_process.submit(p, params=SamplingParams(**GREEDY), request_id=f"r{i}", priority=i)
               for i, p in enumerate(prompts)]
    got = [h.result(timeout=60) for h in handles]

    loop = EngineLoop(LLM(tiny_model_dir, device="cpu", max_num_seqs=4).engine).start()
    try:
        want = [loop.submit(p, params=SamplingParams(**GREEDY)).result(timeout=60) for p in prompts]
    finally:
        loop.shutdown(drain_timeout=1.0)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert all(o.metrics.num_output_tokens == 12 and o.metrics.ttft is not None for o in got)

    with pytest.raises(ValueError, match="max_tokens"):
        engine_process.submit("x", params={"max_tokens": 0})
    with pytest.raises(ValueError, match="already running"):
        slow = engine_process.submit("a", params=SamplingParams(max_tokens=400, ignore_eos=True), request_id="dup")
        engine_process.submit("b", params=SamplingParams(max_tokens=4), request_id="dup")
    engine_process.abort("dup")
    assert slow.result(timeout=60).outputs[0].finish_reason == "abort"

    stats = engine_process.stats()
    assert stats["steps"] > 0 and stats["running"] == 0 and stats["num_blocks"] > 0
    assert [text for text, _ in engine_process.token_pieces([5, 6])] == [
        text for text, _ in loop.engine.token_bytes.pieces([5, 6])]
    deadline = time.monotonic() + 5
    while not engine_process.steps and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine_process.steps and all(batch >= 1 for _s, _t, batch in engine_process.steps)
    assert engine_process.running and not engine_process.deaths


def test_a_killed_engine_process_fails_its_requests_as_engine_died_once(engine_process):
    handle = engine_process.submit("long", params=SamplingParams(max_tokens=100_000, ignore_eos=True))
    os.kill(engine_process.pid, signal.SIGKILL)
    with pytest.raises(EngineDied, match="exited unexpectedly"):
        handle.result(timeout=30)
    deadline = time.monotonic() + 5
    while not engine_process.deaths and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(engine_process.deaths) == 1 and isinstance(engine_process.deaths[0], EngineDied)
    assert not engine_process.running
    with pytest.raises(RuntimeError, match="died"):
        engine_process.submit("after", params=SamplingParams(max_tokens=2))
    with pytest.raises(RuntimeError):
        engine_process.stats()


def test_the_engine_process_ignores_sigterm_and_drains_on_shutdown(engine_process):
    """A systemd stop signals the whole group: the engine must keep going until the worker,
    having drained, stops it."""
    handle = engine_process.submit("steady", params=SamplingParams(**GREEDY))
    os.kill(engine_process.pid, signal.SIGTERM)
    os.kill(engine_process.pid, signal.SIGINT)
    assert handle.result(timeout=60).outputs[0].finish_reason == "length"
    long = engine_process.submit("long", params=SamplingParams(max_tokens=100_000, ignore_eos=True))
    pid = engine_process.pid
    engine_process.shutdown(drain_timeout=0.5)
    assert long.result(timeout=30).outputs[0].finish_reason == "abort"  # aborted at the drain's end
    assert wait_gone(pid, timeout=10)
    assert not engine_process.running and not engine_process.deaths
    with pytest.raises(RuntimeError):
        engine_process.submit("late", params=SamplingParams(max_tokens=2))


def test_the_engine_process_exits_when_its_worker_is_sigkilled(tiny_model_dir):
    script = textwrap.dedent(f"""
        import time
        from functools import partial
        from engine.process import EngineProcess, llm_engine
        engine = EngineProcess.build(partial(llm_engine, {tiny_model_dir!r}, "cpu", {{}}))
        engine.submit("busy", params={{"max_tokens": 100000, "ignore_eos": True}})
        print(engine.pid, flush=True)
        time.sleep(600)
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=ROOT,
                              env=dict(os.environ, PYTHONPATH=str(ROOT)))
    try:
        child = int(parent.stdout.readline())
        assert pid_alive(child)
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=10)
        assert wait_gone(child, timeout=15), "the engine process outlived its worker"
    finally:
        parent.kill()


def test_an_engine_that_cannot_be_built_raises_its_error(tmp_path):
    with pytest.raises(RuntimeError, match="building the engine failed"):
        EngineProcess.build(partial(llm_engine, str(tmp_path / "no-such-model"), "cpu", {}), timeout=120)


def test_a_loop_that_dies_in_the_child_reports_why(tiny_model_dir, monkeypatch):
    monkeypatch.setenv("SPECBATCH_FAULTS", json.dumps({"loop_dies_after_steps": 3}))
    died = threading.Event()
    engine = EngineProcess.build(partial(llm_engine, tiny_model_dir, "cpu", {}), on_death=lambda _e: died.set())
    try:
        handle = engine.submit("x", params=SamplingParams(max_tokens=50, ignore_eos=True))
        with pytest.raises(EngineDied, match="engine loop killed after 3 steps"):
            handle.result(timeout=60)
        assert died.wait(10) and not engine.running
    finally:
        engine.shutdown(drain_timeout=0.5)


def test_the_engine_child_spins_briefly_unless_openmp_is_configured(engine_process, monkeypatch):
    """The child's OpenMP threads sleep after a short spin, leaving the worker's threads the cores."""
    from engine.process import child_env

    environ = dict(kv.split("=", 1) for kv in
                   open(f"/proc/{engine_process.pid}/environ").read().split("\0") if "=" in kv)
    assert environ.get("GOMP_SPINCOUNT") == child_env().get("GOMP_SPINCOUNT")
    for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "SPECBATCH_ENGINE_SPINCOUNT"):
        monkeypatch.delenv(name, raising=False)
    assert child_env()["GOMP_SPINCOUNT"] == "1000"
    monkeypatch.setenv("SPECBATCH_ENGINE_SPINCOUNT", "0")
    assert child_env()["GOMP_SPINCOUNT"] == "0"
    monkeypatch.setenv("OMP_WAIT_POLICY", "active")  # the operator's own OpenMP settings win
    assert "GOMP_SPINCOUNT" not in child_env()
