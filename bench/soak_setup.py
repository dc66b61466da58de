"""What the soak (``bench/soak.py``) and its chaos run (``bench/soak_chaos.py``) share: two
short-lease workers, one batch of tiny jobs, and reading back how it came out."""

from __future__ import annotations

import argparse
import re
import time
import uuid
from pathlib import Path
from typing import Any


def soak_workers(settings: Any, args: argparse.Namespace, tmp: Path, *, max_attempts: int) -> list[Any]:
    """Two local workers with leases short enough that a killed one's jobs come back within seconds."""
    from worker.run.local import LocalWorker

    env = {"SPECBATCH_LEASE_SECONDS": str(args.lease), "SPECBATCH_HEARTBEAT_SECONDS": str(min(1.0, args.lease / 4)),
           "SPECBATCH_SWEEP_SECONDS": str(args.sweep), "SPECBATCH_ORPHAN_GRACE_SECONDS": str(2 * args.lease),
           "SPECBATCH_MAX_ATTEMPTS": str(max_attempts), "OMP_NUM_THREADS": "1"}
    return [LocalWorker(settings, concurrency=2 * args.seqs, max_num_seqs=args.seqs, loglevel="info",
                        log_path=str(tmp / f"worker{i}.log"), extra_env=env) for i in range(2)]


def submit_soak_jobs(client: Any, args: argparse.Namespace, *, name: str, logs: Path) -> str:
    """``args.jobs`` tiny greedy jobs as one batch; returns its id."""
    rows = [{"custom_id": f"s{i}", "prompt": f"tiny job {i}", "max_tokens": args.max_tokens, "ignore_eos": True,
             "temperature": 0} for i in range(args.jobs)]
    t0 = time.time()
    batch_id = client.submit_batch(rows, name=name).batch_id
    print(f"submitted {args.jobs} jobs in {time.time() - t0:.1f} s; queue {client.settings.queue}; logs in {logs}", flush=True)
    return batch_id


def soak_outcome(client: Any, batch_id: str, workers: list[Any]) -> tuple[list[Any], dict[str, int], dict[str, int]]:
    """The batch's jobs, its counts by status, and how many results each job had stored
    (read from the workers' logs: more than one would be a duplicate)."""
    jobs = client.store.jobs(batch_id)
    counts = client.store.batch_counts(batch_id)
    logs = "".join(Path(w.log_path).read_text(errors="replace") for w in workers)
    stored: dict[str, int] = {}
    for job_id in re.findall(r"job (\w+) attempt \d+ stored: succeeded", logs):
        stored[job_id] = stored.get(job_id, 0) + 1
    return jobs, counts, stored


def start_soak(kind: str, args: argparse.Namespace, tmp: Path, *, model: str, broker_url: str, worker_db_url: str,
               client_db_url: str, max_attempts: int) -> tuple[list[Any], Any, str, float]:
    """A queue of its own, the two workers on it, a client, and the batch submitted: returns
    (workers, client, batch id, the time.time() it was submitted at)."""
    from worker.api.client import Client
    from worker.common.config import Settings

    queue = f"gen.{kind}-{uuid.uuid4().hex[:8]}"
    settings = Settings(broker_url=broker_url, database_url=worker_db_url, model=model, device="cpu", queue=queue)
    workers = soak_workers(settings, args, tmp, max_attempts=max_attempts)
    client = Client(broker_url=broker_url, database_url=client_db_url, model=model, queue=queue)
    started = time.time()
    return workers, client, submit_soak_jobs(client, args, name=f"{kind}-{queue}", logs=tmp), started
