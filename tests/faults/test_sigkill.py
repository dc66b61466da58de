"""SIGKILL a worker mid-batch, five times at random moments, with nobody watching: two
workers, jobs submitted with the client only (no ``specbatch run``). Every job succeeds exactly
once, none is stuck, and each killed worker's jobs are back in the queue within lease + sweep."""

from __future__ import annotations

import random
import signal
import time

import pytest

from tests.faults.conftest import LEASE, SWEEP, engine_pid, process_gone, stored_results, wait_until
from worker.api.client import Client
from worker.store.models import RUNNING, SUCCEEDED

N_JOBS = 160
SLOW = {"SPECBATCH_FAULTS": '{"step_sleep_s": 0.02}'}  # a slower model, so a batch lasts long enough to kill
# The test polls the store every 0.1 s and a reaped job must be published and re-read: allow 2 s.
RECOVERY_BOUND = LEASE + SWEEP + 2.0


@pytest.mark.waits(110)
def test_sigkill_five_times_every_job_once(workers):
    client = Client(broker_url=workers.settings.broker_url, database_url=workers.settings.database_url,
                    model=workers.settings.model, queue=workers.settings.queue)
    pool = [workers.start(env=SLOW), workers.start(env=SLOW)]
    rows = [{"custom_id": f"j{i}", "prompt": f"job number {i}", "max_tokens": 40, "ignore_eos": True,
             "temperature": 0} for i in range(N_JOBS)]
    batch_id = client.submit_batch(rows, name="sigkill").batch_id
    rng = random.Random(7)
    recoveries: list[float] = []
    kills: list[tuple[str, float]] = []
    for _ in range(5):
        time.sleep(rng.uniform(1.0, 3.0))
        victim = rng.choice(pool)
        engine = engine_pid(victim.proc.pid)
        killed_at = time.time()
        victim.proc.send_signal(signal.SIGKILL)
        victim.proc.wait()
        kills.append((victim.node, killed_at))
        # Its engine process goes with it (it exits when its pipe to the worker closes).
        wait_until(lambda: process_gone(engine), timeout=15, what="the killed worker's engine process to exit")
        orphaned = {j.id: j.attempts for j in client.store.jobs(batch_id, statuses=[RUNNING])
                    if j.worker == victim.node}
        victim.keep_alive()  # the supervisor restarts it (after its backoff)
        # Each orphan leaves its dead attempt (reaped and re-queued, or re-claimed) in time.
        def recovered() -> bool:
            jobs = {j.id: j for j in client.store.jobs(batch_id) if j.id in orphaned}
            return all(j.status != RUNNING or j.attempts != orphaned[j.id] for j in jobs.values())

        wait_until(recovered, timeout=60, poll=0.1, what="orphans recovered")
        if orphaned:
            recoveries.append(time.time() - killed_at)
        wait_until(lambda: victim.keep_alive() and victim.alive, timeout=60, what="victim restarted")
        workers.wait_ready(victim)
    counts = client.wait(batch_id, timeout=300)
    assert counts[SUCCEEDED] == N_JOBS, counts

    jobs = client.store.jobs(batch_id)
    assert all(j.status == SUCCEEDED and j.output_token_ids and len(j.output_token_ids) == 40 for j in jobs)
    assert sum(j.attempts > 1 for j in jobs) > 0, "no kill hit a running job: the test proved nothing"
    written = stored_results(workers.logs())
    # Every stored result is logged by the worker that wrote it, unless that worker was killed
    # between its commit and its log lines (a group commit answers many task threads at once).
    unlogged = [j for j in jobs if j.id not in written]
    assert all(any(node == j.worker and 0.0 <= at - j.finished_at < 5.0 for node, at in kills) for j in unlogged), \
        [(j.id, j.worker, j.finished_at) for j in unlogged]
    assert max(written.values()) == 1, {k: v for k, v in written.items() if v > 1}
    assert recoveries and max(recoveries) <= RECOVERY_BOUND, recoveries
    assert len(client.results(batch_id)) == N_JOBS
