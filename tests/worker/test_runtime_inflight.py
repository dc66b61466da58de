"""The worker's record of in-flight requests (``Runtime.inflight``) under a warm shutdown and
re-claims: the drain timeout aborts what is in flight and whatever is submitted after its
sweep; an older attempt's end never drops the record of a newer attempt of the same job."""

from __future__ import annotations

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.loop import EngineLoop
from worker.run.runtime import Runtime

LONG = SamplingParams(temperature=0, max_tokens=3000, ignore_eos=True)


@pytest.fixture(scope="module")
def loop(tiny_model_dir):
    engine = LLMEngine(EngineConfig(model=tiny_model_dir, device="cpu", max_model_len=4096, max_num_seqs=4))
    loop = EngineLoop(engine).start()
    yield loop
    loop.shutdown(drain_timeout=5)


def _runtime(loop) -> Runtime:
    return Runtime(model="tiny", device="cpu", label="cpu", loop=loop, queue="q")


def test_drain_timeout_aborts_what_is_in_flight(loop):
    rt = _runtime(loop)
    handle = loop.submit([5, 6, 7], params=LONG, request_id="a#1")
    rt.add_inflight("a", "a#1")
    assert rt.abort_inflight() == ["a"]
    out = handle.result(timeout=120)
    assert out.outputs[0].finish_reason == "abort" and len(out.outputs[0].token_ids) < 3000


def test_a_request_recorded_after_the_drain_sweep_is_aborted_at_once(loop):
    """Its task passed the draining check just before SIGTERM and the sweep found nothing in
    flight: it once ran to the end while the worker waited (CI: a drained job succeeded)."""
    rt = _runtime(loop)
    assert rt.abort_inflight() == []  # the sweep: nothing recorded yet
    handle = loop.submit([5, 6, 7], params=LONG, request_id="late#1")
    rt.add_inflight("late", "late#1")
    out = handle.result(timeout=120)
    assert out.outputs[0].finish_reason == "abort" and len(out.outputs[0].token_ids) < 3000


def test_an_older_attempts_end_keeps_the_newer_attempt_recorded(loop):
    rt = _runtime(loop)
    rt.add_inflight("x", "x#1")
    rt.add_inflight("x", "x#2")  # claimed again by this process
    rt.forget_inflight("x", "x#1")
    assert rt.inflight == {"x": "x#2"}
    rt.forget_inflight("x", "x#2")
    assert rt.inflight == {}


def test_a_worker_that_must_restart_gives_its_jobs_back_forgiven(loop, sqlite_url):
    """The stop watchdog's last act (a stop that never finished: exit 6): the jobs in flight
    go back to the queue at once, their attempts forgiven, instead of waiting for their leases
    to expire and being charged an attempt each."""
    from worker.store.models import QUEUED
    from worker.store.rows import job_row
    from worker.store.store import Store

    store = Store(sqlite_url, auto_upgrade=True)
    store.upsert_jobs([job_row(model="tiny", prompt="p", id="r")])
    claim = store.claim("r", worker="w", device="cpu", lease_s=60, max_attempts=1)
    rt = _runtime(loop)
    request_id = f"r#{claim.attempt}"
    handle = loop.submit([5, 6, 7], params=LONG, request_id=request_id)
    rt.add_inflight("r", request_id)
    assert rt.give_back_inflight(store, "the worker's stop did not finish") == ["r"]
    assert handle.result(timeout=120).outputs[0].finish_reason == "abort"
    job = store.get_job("r")
    assert (job.status, job.attempts, job.attempts_forgiven) == (QUEUED, 1, 1)
    (h,) = store.attempt_history("r")
    assert h.outcome == "given back" and not h.charged and "stop did not finish" in h.cause
    # max_attempts 1 and the attempt forgiven: the job can still be claimed.
    assert store.claim("r", worker="w2", device="cpu", lease_s=60, max_attempts=1).ok
