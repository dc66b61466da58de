"""Priority lanes benchmark, one run: interactive jobs while a bulk run saturates one worker.

For each scenario a fresh worker process (Redis + Celery + SQLite store + engine):
1. idle: the interactive jobs alone, one every 1/rate seconds (their end-to-end latency is the
   reference);
2. a bulk run far larger than the run time fills the worker; its output tokens/s over a window
   with nothing else ("bulk alone"), then over a window in which the same interactive jobs
   arrive at the same rate ("bulk + interactive"), with their latencies.
Scenarios: ``lanes`` (interactive lane, priority scheduling, reserves; the default) and
``fifo`` (everything in the bulk queue, first come first served: the baseline before lanes).
Latency is the store's finished_at - enqueued_at. Prints p50/p99 and ratios to idle, and bulk
throughput with interactive / alone.

    python -m bench.priority [--model tiny|smollm2|PATH] [--interactive 20] [--rate 1]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def resolve(model: str, workdir: Path) -> str:
    if model == "tiny":
        from tests.helpers.tiny_models import make_tiny_model

        return str(make_tiny_model(workdir / "tiny", num_layers=4, hidden_size=256, num_heads=4, num_kv_heads=2,
                                   intermediate_size=512))
    if model == "smollm2":
        from engine.model_hub import resolve_model

        return resolve_model("SmolLM2-135M-Instruct")
    return model


def bulk_tokens(store, batch_id: str, start: float, end: float) -> int:
    from sqlalchemy import func, select

    from worker.store.models import SUCCEEDED, Job

    with store.reader.connect() as conn:
        return conn.execute(
            select(func.coalesce(func.sum(Job.num_output_tokens), 0)).where(
                Job.batch_id == batch_id, Job.status == SUCCEEDED, Job.finished_at >= start, Job.finished_at < end)
        ).scalar_one()


def interactive_wave(client, n: int, rate: float, params: dict, priority: str, timeout: float) -> list[float | None]:
    """Submit ``n`` jobs one every 1/rate s; return each one's end-to-end latency (None: timed out)."""
    ids = []
    t0 = time.monotonic()
    for i in range(n):
        time.sleep(max(0.0, t0 + i / rate - time.monotonic()))
        ids.append(client.submit(f"Question {i}: what is {i} plus {i}?", params=params, priority=priority))
    deadline = time.monotonic() + timeout
    latencies: list[float | None] = []
    parts = []
    for job_id in ids:
        try:
            client.wait(job_id, timeout=max(0.1, deadline - time.monotonic()))
        except TimeoutError:
            pass
        job = client.store.get_job(job_id)
        ok = job.status == "succeeded"
        latencies.append(job.finished_at - job.enqueued_at if ok else None)
        if ok:
            parts.append((job.started_at - job.enqueued_at, job.first_scheduled_at - job.started_at,
                          job.first_token_at - job.first_scheduled_at, job.finished_at - job.first_token_at))
    slowest = sorted((lat, job_id) for job_id, lat in zip(ids, latencies) if lat is not None)[-3:]
    for lat, job_id in reversed(slowest):
        job = client.store.get_job(job_id)
        print(f"    ({priority}) slow: {lat:.2f} s, steps {job.num_steps}, max batch {job.max_batch_size}, "
              f"waiting steps {job.num_waiting_steps}, preemptions {job.num_preemptions}, "
              f"claimed->scheduled {job.first_scheduled_at - job.started_at:.3f}", flush=True)
    if parts:
        means = [statistics.mean(p[i] for p in parts) for i in range(4)]
        print(f"    ({priority}) mean s: queue->claimed {means[0]:.3f}, claimed->scheduled {means[1]:.3f}, "
              f"scheduled->first token {means[2]:.3f}, first token->done {means[3]:.3f}", flush=True)
    for job_id, lat in zip(ids, latencies):
        if lat is None:
            client.cancel(job_id)
    return latencies


def scenario(name: str, model: str, args, workdir: Path) -> dict:
    from worker.api.client import Client
    from worker.common.config import Settings
    from worker.run.local import LocalWorker

    queue = f"gen.prio-{name}-{uuid.uuid4().hex[:6]}"
    db_url = f"sqlite:///{workdir / (name + '.db')}"
    client = Client(broker_url=args.broker, database_url=db_url, model=model, queue=queue)
    settings = Settings(broker_url=client.settings.broker_url, database_url=db_url, model=model, queue=queue)
    extra = {} if args.urgent_only_steps is None else {"SPECBATCH_URGENT_ONLY_STEPS": str(args.urgent_only_steps)}
    if name == "fifo":  # the system before lanes: one FIFO queue, FIFO engine, no reserves
        extra = {"SPECBATCH_ENGINE_KWARGS": json.dumps({"scheduling_policy": "fcfs", "reserved_seqs": 0}),
                 "SPECBATCH_INTERACTIVE_RESERVE": "0", "SPECBATCH_URGENT_ONLY_STEPS": "0"}
    worker = LocalWorker(settings, max_num_seqs=args.max_num_seqs, log_path=str(workdir / f"{name}.log"),
                         extra_env=extra)
    priority = "interactive" if name == "lanes" else "bulk"
    iparams = {"max_tokens": args.interactive_tokens, "temperature": 0, "ignore_eos": True}
    try:
        while not client.workers_consuming(queue, timeout=0.5):
            if not worker.alive:
                raise SystemExit((workdir / f"{name}.log").read_text()[-3000:])
            time.sleep(0.3)
        client.wait(client.submit("warm up", params={"max_tokens": 4}), timeout=300)
        idle = interactive_wave(client, args.interactive, args.rate, iparams, priority, args.timeout)
        lines = [{"custom_id": f"b{i}", "prompt": f"Write a long story about topic number {i}.",
                  "max_tokens": args.bulk_tokens, "ignore_eos": True} for i in range(args.bulk_jobs)]
        bulk = client.submit_batch(lines, name=queue)
        time.sleep(args.warmup)  # the engine fills up
        t_alone = time.time()
        time.sleep(args.interactive / args.rate)
        t_mixed = time.time()
        loaded = interactive_wave(client, args.interactive, args.rate, iparams, priority, args.timeout)
        t_end = time.time()
        time.sleep(args.interactive / args.rate)  # bulk alone again: before and after bracket the mix
        t_after = time.time()
        before = bulk_tokens(client.store, bulk.batch_id, t_alone, t_mixed) / (t_mixed - t_alone)
        after = bulk_tokens(client.store, bulk.batch_id, t_end, t_after) / (t_after - t_end)
        mixed = bulk_tokens(client.store, bulk.batch_id, t_mixed, t_end) / (t_end - t_mixed)
        client.cancel(bulk.batch_id)
        return {"idle": idle, "loaded": loaded, "bulk_alone_tok_s": (before + after) / 2,
                "bulk_before_tok_s": before, "bulk_after_tok_s": after, "bulk_mixed_tok_s": mixed}
    finally:
        worker.stop(timeout=30)


def describe(lat: list[float | None]) -> str:
    done = [x for x in lat if x is not None]
    if not done:
        return f"0/{len(lat)} finished"
    extra = f" ({len(lat) - len(done)} timed out)" if len(done) < len(lat) else ""
    return f"p50 {percentile(done, 0.5):6.2f} s  p99 {percentile(done, 0.99):6.2f} s  mean {statistics.mean(done):6.2f} s{extra}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--scenarios", default="lanes,fifo")
    ap.add_argument("--interactive", type=int, default=20, help="interactive jobs per wave")
    ap.add_argument("--rate", type=float, default=1.0, help="interactive jobs per second")
    ap.add_argument("--interactive-tokens", type=int, default=16)
    ap.add_argument("--bulk-jobs", type=int, default=20000)
    ap.add_argument("--bulk-tokens", type=int, default=64)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--warmup", type=float, default=10.0, help="seconds for the bulk run to fill the engine")
    ap.add_argument("--timeout", type=float, default=120.0, help="give up on an interactive job after this")
    ap.add_argument("--urgent-only-steps", type=int, default=None,
                    help="lanes: k urgent-only steps of every k+1 while urgent and bulk both run "
                         "(default: the worker's own default)")
    ap.add_argument("--broker", default=os.environ.get("REDIS_URL"))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        model = resolve(args.model, workdir)
        print(f"model {args.model}; {args.interactive} interactive jobs at {args.rate}/s, {args.interactive_tokens} "
              f"tokens each; bulk jobs of {args.bulk_tokens} tokens; max_num_seqs {args.max_num_seqs}; "
              f"urgent_only_steps {'worker default' if args.urgent_only_steps is None else args.urgent_only_steps}; "
              f"cpus {os.cpu_count()}", flush=True)
        results = {}
        for name in args.scenarios.split(","):
            results[name] = r = scenario(name, model, args, workdir)
            idle = [x for x in r["idle"] if x is not None]
            loaded = [x for x in r["loaded"] if x is not None]
            print(f"\n[{name}]")
            print(f"  interactive, idle worker:   {describe(r['idle'])}")
            print(f"  interactive, under bulk:    {describe(r['loaded'])}")
            if idle and loaded and len(loaded) == len(r["loaded"]):
                print(f"  latency under bulk / idle:  p50 {percentile(loaded, .5) / percentile(idle, .5):.2f}x  "
                      f"p99 {percentile(loaded, .99) / percentile(idle, .99):.2f}x  (goal <= 1.5x)")
            else:
                print("  latency under bulk / idle:  not all interactive jobs finished within the timeout")
            print(f"  bulk tok/s alone {r['bulk_alone_tok_s']:.1f} (before {r['bulk_before_tok_s']:.1f}, "
                  f"after {r['bulk_after_tok_s']:.1f}), with interactive {r['bulk_mixed_tok_s']:.1f}: "
                  f"{r['bulk_mixed_tok_s'] / max(r['bulk_alone_tok_s'], 1e-9):.2f}x  (goal >= 0.9x)", flush=True)


if __name__ == "__main__":
    main()
