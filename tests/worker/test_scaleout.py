"""Scale-out on one host: two workers on distinct CPU slots (``--device cpu:0`` and ``cpu:1``,
one thread each) consume one queue; jobs spread over both; stopping one mid-run (SIGTERM, as
an orchestrator scaling down does) leaves the other to finish every job. Each worker's ready
file (the Kubernetes readiness probe) exists exactly while it takes jobs."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.worker.test_integration import wait_until
from worker.common.config import Settings
from worker.run.local import LocalWorker
from worker.store.models import SUCCEEDED

pytestmark = pytest.mark.integration

N_JOBS = 60


def cpus_allowed(pid: int) -> str:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Cpus_allowed_list:"):
            return line.split(":", 1)[1].strip()
    raise AssertionError("no Cpus_allowed_list")


def test_two_cpu_slot_workers_share_a_queue_and_one_finishes_when_the_other_stops(
        sqlite_url, redis_url, unique_queue, tiny_model_dir, tmp_path):
    import os

    from worker.api.client import Client

    if len(os.sched_getaffinity(0)) < 2:
        pytest.fail("this test needs two CPU slots (the CI machine has 2 cores)")
    client = Client(broker_url=redis_url, database_url=sqlite_url, model=tiny_model_dir, queue=unique_queue)
    workers = {}
    for slot in (0, 1):
        settings = Settings(broker_url=redis_url, database_url=sqlite_url, model=tiny_model_dir,
                            device=f"cpu:{slot}", queue=unique_queue)
        workers[slot] = LocalWorker(settings, max_num_seqs=8, concurrency=8, loglevel="info",
                                    log_path=str(tmp_path / f"w{slot}.log"),
                                    extra_env={"SPECBATCH_READY_FILE": str(tmp_path / f"ready{slot}")})
    try:
        def both_up() -> bool:
            for slot, w in workers.items():
                assert w.alive, (tmp_path / f"w{slot}.log").read_text()[-3000:]
            return all((tmp_path / f"ready{slot}").exists() for slot in workers)

        wait_until(both_up, timeout=120, poll=0.2)
        wait_until(lambda: len(client.workers_consuming(unique_queue, timeout=0.5)) == 2, timeout=60)
        # Pinned: each process on its own core, one torch thread.
        assert {cpus_allowed(w.proc.pid) for w in workers.values()} == {"0", "1"}
        assert all(str(w.proc.pid) in (tmp_path / f"ready{s}").read_text() for s, w in workers.items())

        lines = [{"custom_id": f"s{i}", "prompt": f"story {i}", "max_tokens": 96, "ignore_eos": True}
                 for i in range(N_JOBS)]
        batch = client.submit_batch(lines, name=unique_queue)
        names = {s: w.node for s, w in workers.items()}

        def finished_by_worker() -> dict[str, int]:
            """Jobs each worker has finished: a job it holds when it stops goes back to the queue
            and ends with the other, so only a finished one shows the work was spread."""
            counts: dict[str, int] = {}
            for job in client.store.jobs(batch.batch_id):
                if job.worker and job.status == SUCCEEDED:
                    counts[job.worker] = counts.get(job.worker, 0) + 1
            return counts

        wait_until(lambda: all(finished_by_worker().get(n, 0) >= 2 for n in names.values()), timeout=120)
        counts = client.store.batch_counts(batch.batch_id)
        assert counts.get(SUCCEEDED, 0) < N_JOBS, "the run ended before one worker could be stopped"

        stopped_at = time.time()
        assert workers[0].stop(timeout=60) == 0  # warm shutdown: drains, gives back what it cannot finish
        assert not (tmp_path / "ready0").exists()
        wait_until(lambda: client.store.batch_counts(batch.batch_id).get(SUCCEEDED, 0) == N_JOBS, timeout=300)
        jobs = client.store.jobs(batch.batch_id)
        assert {j.worker for j in jobs} == set(names.values())  # spread over both
        assert any(j.worker == names[1] and j.finished_at > stopped_at for j in jobs)  # the survivor finished
        assert all(j.status == SUCCEEDED and j.num_output_tokens == 96 for j in jobs)
    finally:
        for w in workers.values():
            w.stop(timeout=30)
