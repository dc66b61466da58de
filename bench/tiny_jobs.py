"""Tiny jobs benchmark, one run: one-token jobs through the queue vs the same prompts in process.

A tiny random model makes the engine as fast as a GPU would, so what is measured is the fixed
cost per job around it (message, claim, heartbeat, result write, ack). For each database:
1. ``LLM.chat`` in process on every prompt (``max_tokens=1``): jobs/s;
2. the same prompts as one batch through Redis + a Celery worker + the store (``Client.submit_batch``
   then ``Client.wait``), the worker started and warmed first: jobs/s from the first job enqueued
   to the last result stored.
Prints both and the ratio (goal >= 0.7x).

    python -m bench.tiny_jobs [--jobs 5000] [--databases sqlite,postgresql]
"""

from __future__ import annotations

import argparse
import tempfile
import time
import uuid
from pathlib import Path

PG_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"


def fresh_pg_schema() -> str:
    """A schema of this run's own in the PostgreSQL database, migrated (``specbatch db upgrade``)."""
    import psycopg

    from worker.store import Store

    schema = f"bench_tiny_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(PG_URL.replace("+psycopg", ""), autocommit=True) as conn:
        conn.execute(f'CREATE SCHEMA "{schema}"')
    url = f"{PG_URL}?options=-csearch_path%3D{schema}"
    Store(url, auto_upgrade=True).dispose()
    return url


def make_model(workdir: Path) -> str:
    from engine.testing import make_tiny_model

    return str(make_tiny_model(workdir / "tiny", num_layers=4, hidden_size=256, num_heads=4, num_kv_heads=2,
                               intermediate_size=512))


def conversations(n: int) -> list[list[dict]]:
    return [[{"role": "user", "content": f"Is review {i} positive or negative? 'It was fine, {i}.'"}]
            for i in range(n)]


def in_process(model: str, convs, max_num_seqs: int) -> float:
    from engine import LLM, SamplingParams

    llm = LLM(model, device="cpu", max_num_seqs=max_num_seqs)
    llm.chat(convs[:8], SamplingParams(max_tokens=1), use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    outs = llm.chat(convs, SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
    dt = time.perf_counter() - t0
    assert len(outs) == len(convs)
    return len(convs) / dt


def through_queue(model: str, convs, max_num_seqs: int, db_url: str, workdir: Path) -> dict:
    from worker.client import Client
    from worker.config import Settings
    from worker.local import LocalWorker

    queue = f"gen.tiny-{uuid.uuid4().hex[:8]}"
    client = Client(database_url=db_url, model=model, queue=queue)
    settings = Settings(broker_url=client.settings.broker_url, database_url=db_url, model=model, queue=queue)
    worker = LocalWorker(settings, max_num_seqs=max_num_seqs, log_path=str(workdir / f"worker-{queue}.log"))
    try:
        while not client.workers_consuming(queue, timeout=0.5):
            if not worker.alive:
                raise SystemExit((workdir / f"worker-{queue}.log").read_text()[-3000:])
            time.sleep(0.3)
        warm = client.submit_batch([{"messages": c, "max_tokens": 1} for c in convs[:8]], name=f"warm-{queue}")
        client.wait(warm.batch_id, timeout=300)
        rows = [{"custom_id": f"t{i}", "messages": c, "max_tokens": 1, "temperature": 0} for i, c in enumerate(convs)]
        t0 = time.perf_counter()
        batch = client.submit_batch(rows, name=queue)
        counts = client.wait(batch.batch_id, timeout=3600)
        wall = time.perf_counter() - t0
        jobs = client.store.jobs(batch.batch_id)
        window = max(j.finished_at for j in jobs) - min(j.enqueued_at for j in jobs)
        done = [j for j in jobs if j.started_at and j.first_scheduled_at and j.finished_at]
        parts = {
            "queued->claimed": sum(j.started_at - j.enqueued_at for j in done) / len(done),
            "claimed->scheduled": sum(j.first_scheduled_at - j.started_at for j in done) / len(done),
            "scheduled->finished": sum(j.finished_at - j.first_scheduled_at for j in done) / len(done),
        }
        return {"jobs_s": len(jobs) / window, "wall_s": wall, "window_s": window, "counts": counts, "parts": parts}
    finally:
        worker.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=5000)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--databases", default="sqlite,postgresql")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        model = make_model(workdir)
        convs = conversations(args.jobs)
        print(f"{args.jobs} one-token jobs, tiny model (4 layers, hidden 256), max_num_seqs {args.max_num_seqs}",
              flush=True)
        for db in args.databases.split(","):
            local = in_process(model, convs, args.max_num_seqs)
            url = f"sqlite:///{workdir / 'tiny.db'}" if db == "sqlite" else fresh_pg_schema()
            q = through_queue(model, convs, args.max_num_seqs, url, workdir)
            print(f"[{db}] in process {local:.1f} jobs/s; queue {q['jobs_s']:.1f} jobs/s "
                  f"({q['window_s']:.1f} s first enqueue -> last result, {q['counts']}): "
                  f"{q['jobs_s'] / local:.2f}x (goal >= 0.7x)", flush=True)
            print("    mean s per job: " + ", ".join(f"{k} {v:.3f}" for k, v in q["parts"].items()), flush=True)


if __name__ == "__main__":
    main()
