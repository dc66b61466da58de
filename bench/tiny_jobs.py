"""Tiny jobs benchmark, one run: one-token jobs through the queue vs the same prompts in process.

A tiny random model makes the engine as fast as a GPU would, so what is measured is the fixed
cost per job around it (message, claim, heartbeat, result write, ack). For each database:
1. ``LLM.chat`` in process on every prompt (``max_tokens=1``): jobs/s;
2. the same prompts as one batch through Redis + a Celery worker + the store (``Client.submit_batch``
   then ``Client.wait``), the worker started and warmed first: jobs/s from the first job enqueued
   to the last result stored.
Rounds alternate the two sides (fresh prompts each round) and the median ratio is printed
(goal >= 0.75x; >= 500 jobs/s with ``--model tiny``), with the CPU time per job of the worker process and of its engine process:
on a small host the two share the cores.

    python -m bench.tiny_jobs [--jobs 5000] [--rounds 3] [--databases sqlite,postgresql] [--model bench|tiny]
                              [--engine-threads N] [--concurrency N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import uuid
from pathlib import Path

PG_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"


def fresh_pg_schema() -> str:
    """A schema of this run's own in the PostgreSQL database, migrated (``specbatch db upgrade``)."""
    import psycopg

    from worker.store.store import Store

    schema = f"bench_tiny_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(PG_URL.replace("+psycopg", ""), autocommit=True) as conn:
        conn.execute(f'CREATE SCHEMA "{schema}"')
    url = f"{PG_URL}?options=-csearch_path%3D{schema}"
    Store(url, auto_upgrade=True).dispose()
    return url


#: ``bench``: 4 layers, hidden 256 (the engine's fixed cost per step shows); ``tiny``: the test
#: suite's 2-layer, hidden-64 model, where what is left is the cost per job around the engine.
MODELS = {
    "bench": {"num_layers": 4, "hidden_size": 256, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 512},
    "tiny": {"num_layers": 2, "hidden_size": 64, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 128},
}
GOAL_RATIO, GOAL_JOBS_S = 0.75, 500.0


def make_model(workdir: Path, size: str) -> str:
    from tests.helpers.tiny_models import make_tiny_model

    return str(make_tiny_model(workdir / f"tiny-{size}", **MODELS[size]))


def conversations(n: int, round_no: int = 0) -> list[list[dict]]:
    return [[{"role": "user", "content": f"Is review {i} positive or negative? 'It was fine, {i}, r{round_no}.'"}]
            for i in range(n)]


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a live process (``/proc/PID/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def child_pids(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


class InProcess:
    """``LLM.chat`` in this process, built and warmed once."""

    def __init__(self, model: str, max_num_seqs: int, threads: int | None) -> None:
        import torch

        from engine import LLM, SamplingParams

        if threads:  # the same thread count as the worker's engine: on a busy host it decides everything
            torch.set_num_threads(threads)
        self.llm = LLM(model, device="cpu", max_num_seqs=max_num_seqs)
        self.llm.chat(conversations(8, -1), SamplingParams(max_tokens=1), use_tqdm=False)  # warm-up

    def run(self, convs) -> float:
        from engine import SamplingParams

        t0 = time.perf_counter()
        outs = self.llm.chat(convs, SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
        dt = time.perf_counter() - t0
        assert len(outs) == len(convs)
        return len(convs) / dt


class QueuePath:
    """A worker started, ready and warmed once; each round submits one batch and waits for it."""

    def __init__(self, model: str, max_num_seqs: int, db_url: str, workdir: Path,
                 engine_threads: int | None, concurrency: int | None = None) -> None:
        from worker.api.client import Client
        from worker.common.config import Settings
        from worker.run.local import LocalWorker

        self.queue = f"gen.tiny-{uuid.uuid4().hex[:8]}"
        self.client = Client(database_url=db_url, model=model, queue=self.queue)
        settings = Settings(broker_url=self.client.settings.broker_url, database_url=db_url, model=model,
                            queue=self.queue)
        extra = {"SPECBATCH_ENGINE_THREADS": str(engine_threads)} if engine_threads else {}
        log = workdir / f"worker-{self.queue}.log"
        self.worker = LocalWorker(settings, max_num_seqs=max_num_seqs, log_path=str(log), extra_env=extra,
                                  concurrency=concurrency)
        try:
            while not self.client.workers_consuming(self.queue, timeout=0.5):
                if not self.worker.alive:
                    raise SystemExit(log.read_text()[-3000:])
                time.sleep(0.3)
            warm = self.client.submit_batch([{"messages": c, "max_tokens": 1} for c in conversations(8, -1)],
                                            name=f"warm-{self.queue}")
            self.client.wait(warm.batch_id, timeout=300)
        except BaseException:
            self.worker.stop()
            raise

    def run(self, convs, round_no: int) -> dict:
        client = self.client
        rows = [{"custom_id": f"t{i}", "messages": c, "max_tokens": 1, "temperature": 0} for i, c in enumerate(convs)]
        worker_pid = self.worker.proc.pid
        engines = child_pids(worker_pid)
        cpu0 = cpu_seconds(worker_pid), sum(cpu_seconds(p) for p in engines)
        t0 = time.perf_counter()
        batch = client.submit_batch(rows, name=f"{self.queue}-r{round_no}")
        counts = client.wait(batch.batch_id, timeout=3600)
        wall = time.perf_counter() - t0
        cpu1 = cpu_seconds(worker_pid), sum(cpu_seconds(p) for p in engines)
        jobs = client.store.jobs(batch.batch_id)
        window = max(j.finished_at for j in jobs) - min(j.enqueued_at for j in jobs)
        done = [j for j in jobs if j.started_at and j.first_scheduled_at and j.finished_at]
        parts = {
            "queued->claimed": sum(j.started_at - j.enqueued_at for j in done) / len(done),
            "claimed->scheduled": sum(j.first_scheduled_at - j.started_at for j in done) / len(done),
            "scheduled->finished": sum(j.finished_at - j.first_scheduled_at for j in done) / len(done),
        }
        batch = sum(j.max_batch_size or 0 for j in done) / len(done)
        return {"jobs_s": len(jobs) / window, "batch": batch, "wall_s": wall, "window_s": window, "counts": counts, "parts": parts,
                "worker_cpu_ms": 1e3 * (cpu1[0] - cpu0[0]) / len(jobs),
                "engine_cpu_ms": 1e3 * (cpu1[1] - cpu0[1]) / len(jobs)}

    def close(self) -> None:
        self.worker.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=5000)
    ap.add_argument("--rounds", type=int, default=3, help="alternating in-process / queue rounds (median ratio)")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--databases", default="sqlite,postgresql")
    ap.add_argument("--model", choices=sorted(MODELS), default="bench",
                    help="bench: 4 layers, hidden 256; tiny: 2 layers, hidden 64 (the 500 jobs/s goal)")
    ap.add_argument("--engine-threads", type=int, default=None,
                    help="torch threads of the worker's engine and of the in-process side alike (default: each "
                         "side's own default, one per core). On a host where other processes use the cores, "
                         "OpenMP's barriers wait on descheduled threads: 1 thread ran a tiny model 24x faster "
                         "in process than 2 on 2 busy cores (930 vs 39 jobs/s)")
    ap.add_argument("--concurrency", type=int, default=None,
                    help="the worker's task threads (default: the worker's own, 2 x max-num-seqs plus the "
                         "interactive reserve): how many jobs it holds at once")
    args = ap.parse_args()
    from bench.openmp import run_with_engine_openmp

    run_with_engine_openmp()  # the in-process side spins as the worker's engine does
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        model = make_model(workdir, args.model)
        shape = MODELS[args.model]
        print(f"{args.jobs} one-token jobs, {args.model} model ({shape['num_layers']} layers, hidden "
              f"{shape['hidden_size']}), max_num_seqs {args.max_num_seqs}, "
              f"engine threads {args.engine_threads or 'default'}, worker concurrency {args.concurrency or 'default'}, "
              f"{os.cpu_count()} CPUs", flush=True)
        in_process = InProcess(model, args.max_num_seqs, args.engine_threads)
        for db in args.databases.split(","):
            url = f"sqlite:///{workdir / 'tiny.db'}" if db == "sqlite" else fresh_pg_schema()
            queue_path = QueuePath(model, args.max_num_seqs, url, workdir, args.engine_threads, args.concurrency)
            ratios, rates = [], []
            try:
                for r in range(args.rounds):
                    convs = conversations(args.jobs, r)
                    order = ("in-process", "queue") if r % 2 == 0 else ("queue", "in-process")
                    got = {side: in_process.run(convs) if side == "in-process" else queue_path.run(convs, r)
                           for side in order}
                    local, q = got["in-process"], got["queue"]
                    ratios.append(q["jobs_s"] / local)
                    rates.append(q["jobs_s"])
                    print(f"[{db}] round {r + 1} ({' then '.join(order)}): in process {local:.1f} jobs/s; queue "
                          f"{q['jobs_s']:.1f} jobs/s ({q['window_s']:.1f} s first enqueue -> last result, "
                          f"{q['counts']}): {ratios[-1]:.2f}x", flush=True)
                    print("    mean s per job: " + ", ".join(f"{k} {v:.3f}" for k, v in q["parts"].items()) +
                          f"; CPU per job: worker process {q['worker_cpu_ms']:.1f} ms, engine process "
                          f"{q['engine_cpu_ms']:.1f} ms; mean engine batch a job ran in {q['batch']:.1f}", flush=True)
            finally:
                queue_path.close()
            print(f"[{db}] ratio queue / in process: median {statistics.median(ratios):.2f}x over {len(ratios)} "
                  f"rounds ({', '.join(f'{x:.2f}' for x in ratios)}) (goal >= {GOAL_RATIO}x); queue median "
                  f"{statistics.median(rates):.0f} jobs/s (goal >= {GOAL_JOBS_S:.0f} on the tiny model)", flush=True)


if __name__ == "__main__":
    main()
