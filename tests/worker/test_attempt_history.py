"""Attempt history on SQLite and PostgreSQL: each attempt that ended without ending its job is
kept with its worker, end, cause and whether it was charged; ``specbatch status JOB`` shows
them with the attempt that ended the job."""

from __future__ import annotations

import json
import time

from click.testing import CliRunner

from worker.api.cli import cli
from worker.store.models import FAILED, QUEUED, RUNNING, SUCCEEDED
from worker.store.rows import job_row
from worker.store.store import Store


def _claim(store: Store, job_id: str, worker: str, lease_s: float = 60.0):
    claim = store.claim(job_id, worker=worker, device="cpu:0", lease_s=lease_s, max_attempts=2)
    assert claim.ok, claim.reason
    return claim.attempt


def test_each_ended_attempt_is_kept_with_its_worker_end_cause_and_charge(db_url):
    store = Store(db_url, auto_upgrade=True)
    store.upsert_jobs([job_row(model="m", prompt="hi", id="h1")])
    a1 = _claim(store, "h1", "w1")
    assert store.give_back("h1", a1, "drained: the worker is shutting down", forgive=True)
    a2 = _claim(store, "h1", "w2")
    assert store.give_back("h1", a2, "the broker went away", forgive=True)
    a3 = _claim(store, "h1", "w3")
    with store._write() as conn:  # w3 stops heartbeating: its lease is long expired
        conn.exec_driver_sql("UPDATE jobs SET heartbeat_at = heartbeat_at - 100 WHERE id = 'h1'")
    a4 = _claim(store, "h1", "w4")  # a redelivered copy takes over the expired attempt
    assert store.finish("h1", a4, {"status": SUCCEEDED, "output_text": "ok", "finished_at": time.time()})
    history = store.attempt_history("h1")
    assert [(h.attempt, h.worker, h.outcome, h.charged) for h in history] == [
        (a1, "w1", "given back", False), (a2, "w2", "given back", False), (a3, "w3", "lost", True)]
    assert "drained" in history[0].cause and "lease expired" in history[2].cause
    assert all(h.ended_at >= h.started_at for h in history)
    job = store.get_job("h1")
    # Two forgiven give-backs and one lost attempt: max_attempts 2 was not reached.
    assert (job.status, job.attempts, job.attempts - job.attempts_forgiven) == (SUCCEEDED, 4, 2)


def test_a_reaped_attempt_is_lost_and_charged(db_url):
    store = Store(db_url, auto_upgrade=True)
    store.upsert_jobs([job_row(model="m", prompt="hi", id="h2", queue="q")])
    a1 = _claim(store, "h2", "w1")
    with store._write() as conn:
        conn.exec_driver_sql("UPDATE jobs SET heartbeat_at = heartbeat_at - 100 WHERE id = 'h2'")
    assert [r["id"] for r in store.reap_expired(1.0, ["q"], 5)] == ["h2"]
    (h,) = store.attempt_history("h2")
    assert (h.attempt, h.worker, h.outcome, h.charged) == (a1, "w1", "lost", True)
    assert store.get_job("h2").status == QUEUED


def test_status_job_shows_the_history(sqlite_url):
    store = Store(sqlite_url, auto_upgrade=True)
    store.upsert_jobs([job_row(model="m", prompt="hi", id="h3")])
    a1 = _claim(store, "h3", "w1")
    store.give_back("h3", a1, "engine loop died: killed", forgive=False)
    a2 = _claim(store, "h3", "w2")
    running = CliRunner().invoke(cli, ["--database-url", sqlite_url, "status", "h3"])
    assert running.exit_code == 0, running.output
    view = json.loads(running.stdout)
    assert view["status"] == RUNNING
    assert view["attempts"]["charged"] == 2 and [h["end"] for h in view["attempts"]["history"]] == [
        "given back", RUNNING]
    store.fail("h3", a2, "boom", "generation_error")
    ended = json.loads(CliRunner().invoke(cli, ["--database-url", sqlite_url, "status", "h3"]).stdout)
    attempts = ended["specbatch"]["attempts"]
    assert [(h["attempt"], h["worker"], h["end"], h["charged"]) for h in attempts["history"]] == [
        (1, "w1", "given back", True), (2, "w2", FAILED, True)]
    assert "engine loop died" in attempts["history"][0]["cause"] and attempts["history"][1]["cause"] == "boom"
