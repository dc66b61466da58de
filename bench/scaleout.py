"""Scale-out benchmark, one run: more workers on one queue, and where the store or broker limits.

1. Throughput of 1 vs 2 workers on distinct CPU slots (``--device cpu:0``/``cpu:1``, one torch
   thread each) consuming one queue, same jobs (goal: 2 workers >= 1.8x one).
2. A simulated many-host run: N worker processes (tiny model, one thread each, no pinning past
   the host's cores) against one Redis and one PostgreSQL, tiny jobs, N = 1, 2, 4, 8: jobs/s as
   N grows shows where the queue path (claim, result write, message), not the model, is the
   bottleneck; the CPU time Redis and PostgreSQL spend per job (read from /proc) says at what
   rate one core of each would saturate. On a host with fewer cores than N the workers also
   share cores with each other and with the servers: jobs/s then stops growing for that reason.

Throughput counts from the first job enqueued to the last result stored (the store's times).

    python -m bench.scaleout [--model smollm2|tiny|PATH] [--jobs 192] [--max-tokens 64]
                             [--tiny-jobs 2000] [--processes 1,2,4,8] [--database-url URL]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

DEFAULT_PG = "postgresql+psycopg://postgres@127.0.0.1:5432/test"


def resolve(model: str, workdir: Path) -> str:
    if model == "tiny":
        from tests.helpers.tiny_models import make_tiny_model

        return str(make_tiny_model(workdir / "tiny"))
    if model == "smollm2":
        from engine.model_hub import resolve_model

        return resolve_model("SmolLM2-135M-Instruct")
    return model


def service_cpu_seconds() -> dict[str, float]:
    """CPU seconds used so far by this host's Redis and PostgreSQL server processes (from /proc)."""
    tick = os.sysconf("SC_CLK_TCK")
    used = {"redis": 0.0, "postgres": 0.0}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)
            name = fields[0].split("(", 1)[1]
            utime, stime = (int(x) for x in fields[1].split()[11:13])
        except (OSError, IndexError, ValueError):
            continue
        for service in used:
            if name.startswith("redis-server" if service == "redis" else "postgres"):
                used[service] += (utime + stime) / tick
    return used


def run_workers(model: str, devices: list[str], lines: list[dict], broker: str, db_url: str, workdir: Path,
                max_num_seqs: int) -> dict:
    """Start one worker per device on a fresh queue, run ``lines`` through it, stop them."""
    from worker.api.client import Client
    from worker.common.config import Settings
    from worker.run.local import LocalWorker

    queue = f"gen.scale-{uuid.uuid4().hex[:8]}"
    client = Client(broker_url=broker, database_url=db_url, model=model, queue=queue)
    workers = []
    try:
        for i, device in enumerate(devices):
            settings = Settings(broker_url=broker, database_url=db_url, model=model, device=device, queue=queue)
            workers.append(LocalWorker(settings, max_num_seqs=max_num_seqs, concurrency=2 * max_num_seqs,
                                       log_path=str(workdir / f"{queue}-{i}.log"),
                                       extra_env={"SPECBATCH_CPU_THREADS": "1", "OMP_NUM_THREADS": "1"}))
        deadline = time.monotonic() + 300
        while len(client.workers_consuming(queue, timeout=1.0)) < len(devices):
            if not all(w.alive for w in workers) or time.monotonic() > deadline:
                raise SystemExit(f"workers did not come up: see {workdir}")
            time.sleep(0.5)
        warm = [client.submit(f"warm up {i}", params={"max_tokens": 2}) for i in range(4 * len(devices))]
        for job in warm:
            client.wait(job, timeout=300)
        services0 = service_cpu_seconds()
        batch = client.submit_batch(lines, name=queue)
        client.wait(batch.batch_id, timeout=3600)
        services1 = service_cpu_seconds()
        jobs = client.store.jobs(batch.batch_id)
        ok = [j for j in jobs if j.status == "succeeded"]
        window = max(j.finished_at for j in jobs) - min(j.enqueued_at for j in jobs)
        per_worker: dict[str, int] = {}
        for j in ok:
            per_worker[j.worker] = per_worker.get(j.worker, 0) + 1
        return {"jobs": len(ok), "of": len(lines), "tokens": sum(j.num_output_tokens for j in ok), "seconds": window,
                "per_worker": sorted(per_worker.values(), reverse=True),
                "service_cpu_s": {k: services1[k] - services0[k] for k in services0}}
    finally:
        for w in workers:
            w.stop(timeout=30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--jobs", type=int, default=192)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--tiny-jobs", type=int, default=2000)
    ap.add_argument("--processes", default="1,2,4,8")
    ap.add_argument("--broker", default=os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/13"))
    ap.add_argument("--database-url", default=os.environ.get("SPECBATCH_BENCH_PG", DEFAULT_PG))
    ap.add_argument("--skip-slots", action="store_true")
    ap.add_argument("--skip-hosts", action="store_true")
    args = ap.parse_args()
    from worker.store.store import Store

    Store(args.database_url, auto_upgrade=True)
    cores = len(os.sched_getaffinity(0))
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        print(f"host: {cores} cores; broker {args.broker}; store {args.database_url.split('@')[-1]}", flush=True)
        if not args.skip_slots:
            model = resolve(args.model, workdir)
            lines = [{"custom_id": f"s{i}", "prompt": f"Write a short story about the number {i}.",
                      "max_tokens": args.max_tokens, "ignore_eos": True, "temperature": 0} for i in range(args.jobs)]
            one = run_workers(model, ["cpu:0"], lines, args.broker, args.database_url, workdir, args.max_num_seqs)
            two = run_workers(model, ["cpu:0", "cpu:1"], lines, args.broker, args.database_url, workdir,
                              args.max_num_seqs)
            for name, r in (("1 worker (cpu:0)", one), ("2 workers (cpu:0, cpu:1)", two)):
                print(f"{name:26s}: {r['jobs']}/{r['of']} jobs, {r['tokens']} tokens in {r['seconds']:.1f} s = "
                      f"{r['tokens'] / r['seconds']:.1f} tok/s; jobs per worker {r['per_worker']}", flush=True)
            ratio = (two["tokens"] / two["seconds"]) / (one["tokens"] / one["seconds"])
            print(f"2 workers / 1 worker: {ratio:.2f}x (goal >= 1.8x)", flush=True)
        if not args.skip_hosts:
            model = resolve("tiny", workdir)
            lines = [{"custom_id": f"t{i}", "prompt": f"item {i}", "max_tokens": 1} for i in range(args.tiny_jobs)]
            print(f"\nsimulated hosts: tiny model, {args.tiny_jobs} one-token jobs, one Redis, one PostgreSQL", flush=True)
            base = None
            for n in [int(x) for x in args.processes.split(",")]:
                devices = [f"cpu:{i}" if n <= cores else "cpu" for i in range(n)]
                r = run_workers(model, devices, lines, args.broker, args.database_url, workdir, 32)
                rate = r["jobs"] / r["seconds"]
                base = base or rate
                cpu = r["service_cpu_s"]
                per_job = {k: 1000 * v / max(1, r["jobs"]) for k, v in cpu.items()}
                ceiling = 1000 / max(1e-9, max(per_job.values()))
                print(f"  N={n}: {r['jobs']}/{r['of']} jobs in {r['seconds']:.1f} s = {rate:.0f} jobs/s "
                      f"({rate / base:.2f}x N=1); jobs per worker {r['per_worker']}; CPU per job: Redis "
                      f"{per_job['redis']:.2f} ms, PostgreSQL {per_job['postgres']:.2f} ms (one core each caps "
                      f"the queue path near {ceiling:.0f} jobs/s)", flush=True)


if __name__ == "__main__":
    main()
