"""A worker whose engine cannot serve never burns the queue: an engine that cannot be built
takes no message and exits non-zero; a loop that dies fails no job, gives its jobs back and
exits non-zero; a poison request fails alone while the rest of its step finish."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import redis

from tests.faults.conftest import LEASE, engine_pid, stored_results, wait_until
from worker.api.client import Client
from worker.store.models import FAILED, QUEUED, SUCCEEDED
from worker.run.exit_codes import EXIT_ENGINE_BUILD_FAILED, EXIT_ENGINE_DIED

ROOT = Path(__file__).resolve().parents[2]


def make_client(settings) -> Client:
    return Client(broker_url=settings.broker_url, database_url=settings.database_url, model=settings.model,
                  queue=settings.queue)


def test_engine_that_cannot_be_built_takes_no_message(workers):
    settings = workers.settings
    client = make_client(settings)
    job = client.submit("hello there", params={"max_tokens": 8, "temperature": 0})
    broken = workers.start(settings=dataclasses.replace(settings, device="cuda:0"), wait_ready=False)
    assert broken.proc.wait(timeout=120) == EXIT_ENGINE_BUILD_FAILED
    log = Path(broken.log_path).read_text()
    assert " ready." not in log
    row = client.store.get_job(job)
    assert row.status == QUEUED and row.attempts == 0  # never claimed
    assert redis.Redis.from_url(settings.broker_url).llen(f"{settings.queue}.interactive") == 1  # its message still waits (interactive lane)
    (state,) = [w for w in client.store.workers() if w.name == broken.node]
    assert (state.state, state.exit_code) == ("exited", EXIT_ENGINE_BUILD_FAILED)
    assert "engine could not be built" in state.error and state.failures == 1

    # `specbatch status` shows it (a crash loop is visible to whoever looks).
    env = dict(os.environ, PYTHONPATH=str(ROOT), COLUMNS="250")
    shown = subprocess.run([sys.executable, "-m", "worker.api.cli", "--database-url", settings.database_url, "status"],
                           env=env, capture_output=True, text=True, timeout=120)
    assert f"{broken.node}  exited {EXIT_ENGINE_BUILD_FAILED}" in shown.stdout, shown.stdout + shown.stderr

    workers.start()  # a healthy worker gets the job promptly
    assert client.wait(job, timeout=120) == SUCCEEDED


def test_status_shows_a_killed_worker_lost(workers):
    """SIGKILL records nothing: the worker's last state is ``ready``, its heartbeat stops;
    ``status`` says ``lost`` once the heartbeat is older than a lease (never ``ready``)."""
    worker = workers.start()
    env = dict(os.environ, PYTHONPATH=str(ROOT), SPECBATCH_LEASE_SECONDS=str(LEASE))

    def shown() -> str:
        out = subprocess.run([sys.executable, "-m", "worker.api.cli", "--database-url", workers.settings.database_url,
                              "status"], env=env, capture_output=True, text=True, timeout=120).stdout
        (line,) = [line for line in out.splitlines() if line.startswith(worker.node + " ")]
        return line[len(worker.node):].strip()

    assert shown() == "ready"
    log = Path(worker.log_path).read_text()
    assert "superuser privileges" not in log and "setup plugin" not in log  # noise silenced (issue 33)
    worker.proc.send_signal(signal.SIGKILL)
    worker.proc.wait()
    wait_until(lambda: shown() == "lost", timeout=LEASE + 30, poll=0.5, what="status to show the worker lost")


def test_loop_that_dies_gives_jobs_back_and_exits_non_zero(workers):
    settings = workers.settings
    client = make_client(settings)
    rows = [{"custom_id": f"j{i}", "prompt": f"job {i}", "max_tokens": 60, "ignore_eos": True, "temperature": 0}
            for i in range(12)]
    batch_id = client.submit_batch(rows, name="loop-dies").batch_id
    dying = workers.start(env={"SPECBATCH_FAULTS": json.dumps({"loop_dies_after_steps": 10})}, wait_ready=False)
    assert dying.proc.wait(timeout=120) == EXIT_ENGINE_DIED
    jobs = client.store.jobs(batch_id)
    assert not [j for j in jobs if j.status == FAILED], [(j.custom_id, j.error) for j in jobs if j.status == FAILED]
    given_back = [j for j in jobs if j.attempts >= 1]
    assert given_back and all(j.status == QUEUED for j in given_back)  # back at once, not after a lease
    assert all("engine loop died" in (j.error or "") for j in given_back), [(j.status, j.attempts, j.error) for j in jobs]
    (state,) = [w for w in client.store.workers() if w.name == dying.node]
    assert (state.state, state.exit_code) == ("exited", EXIT_ENGINE_DIED) and "engine loop died" in state.error

    workers.start()  # the restarted (healthy) worker finishes them
    counts = client.wait(batch_id, timeout=180)
    assert counts[SUCCEEDED] == 12, counts
    assert max(stored_results(workers.logs()).values()) == 1


def test_engine_process_killed_mid_batch_gives_jobs_back_and_worker_exits_non_zero(workers):
    """The OOM killer's way: SIGKILL the worker's engine process (not the worker) mid-batch."""
    settings = workers.settings
    client = make_client(settings)
    slow = {"SPECBATCH_FAULTS": json.dumps({"step_sleep_s": 0.02})}
    worker = workers.start(env=slow)
    rows = [{"custom_id": f"j{i}", "prompt": f"job {i}", "max_tokens": 80, "ignore_eos": True, "temperature": 0}
            for i in range(12)]
    batch_id = client.submit_batch(rows, name="engine-killed").batch_id
    wait_until(lambda: any(j.status == "running" for j in client.store.jobs(batch_id)), what="a running job")
    os.kill(engine_pid(worker.proc.pid), signal.SIGKILL)
    assert worker.proc.wait(timeout=60) == EXIT_ENGINE_DIED
    jobs = client.store.jobs(batch_id)
    assert not [j for j in jobs if j.status == FAILED], [(j.custom_id, j.error) for j in jobs if j.status == FAILED]
    given_back = [j for j in jobs if j.attempts >= 1 and j.status != SUCCEEDED]
    assert given_back and all(j.status == QUEUED for j in given_back)  # back at once, not after a lease
    assert all("engine process exited unexpectedly" in (j.error or "") for j in given_back)
    (state,) = [w for w in client.store.workers() if w.name == worker.node]
    assert (state.state, state.exit_code) == ("exited", EXIT_ENGINE_DIED) and "engine" in state.error

    workers.start(env=slow)  # the restarted worker finishes them
    counts = client.wait(batch_id, timeout=180)
    assert counts[SUCCEEDED] == 12, counts
    assert max(stored_results(workers.logs()).values()) == 1


def test_poison_request_fails_alone(workers):
    settings = workers.settings
    client = make_client(settings)
    poisoned = workers.start(env={"SPECBATCH_FAULTS": json.dumps({"poison": "POISON", "step_sleep_s": 0.01})})
    rows = [{"custom_id": f"j{i}", "prompt": f"job {i}", "max_tokens": 30, "ignore_eos": True, "temperature": 0}
            for i in range(7)]
    rows.insert(3, {"custom_id": "bad", "prompt": "this one is POISON", "max_tokens": 30, "temperature": 0})
    batch_id = client.submit_batch(rows, name="poison").batch_id
    counts = client.wait(batch_id, timeout=180)
    assert counts[SUCCEEDED] == 7 and counts[FAILED] == 1, counts
    bad = [j for j in client.store.jobs(batch_id) if j.custom_id == "bad"][0]
    assert bad.attempts == 1 and "InjectedFault" in bad.error and "poisoned" in bad.error
    assert poisoned.alive  # the worker and its loop survived


def test_specbatch_run_restarts_its_local_worker(tiny_model, redis_url, unique_queue, tmp_path):
    """The local worker of ``specbatch run`` dies (its loop, every 30 steps: once for this file's
    ~50 steps) and is restarted with backoff until the file is done; every line gets exactly one
    result, and none waits for the orphan sweep after a restart."""
    lines = [json.dumps({"custom_id": f"c{i}", "prompt": f"line {i}", "max_tokens": 8, "ignore_eos": True,
                         "temperature": 0}) for i in range(24)]
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out.jsonl"
    env = dict(os.environ, PYTHONPATH=str(ROOT), SPECBATCH_QUEUE=unique_queue, SPECBATCH_MAX_ATTEMPTS="20",
               SPECBATCH_WORKER_LOG=str(tmp_path / "worker.log"), SPECBATCH_WORKER_LOGLEVEL="info",
               SPECBATCH_FAULTS=json.dumps({"loop_dies_after_steps": 30}))
    env.pop("DATABASE_URL", None)
    res = subprocess.run(
        [sys.executable, "-m", "worker.api.cli", "--broker-url", redis_url, "--database-url",
         f"sqlite:///{tmp_path / 'sb.db'}", "run", str(src), "-o", str(out), "--model", tiny_model,
         "--max-num-seqs", "4"], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=400)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "restarted (" in res.stderr  # it did die, and came back
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["custom_id"] for r in rows) == sorted(f"c{i}" for i in range(24))
    assert all(r["error"] is None for r in rows)
    log = (tmp_path / "worker.log").read_text()
    assert max(stored_results(log).values()) == 1
    # The dying worker stopped consuming and handed back every message it held before it
    # exited: no job had to wait for the orphan sweep (90 s) to be seen again.
    assert "whose message was lost" not in log
