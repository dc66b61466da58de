"""Queue overhead benchmark, one run:

1. The same workload (default 128 chat jobs, greedy, fixed output length) through
   ``specbatch run`` (Redis + Celery + SQL store + a worker process) and through
   ``LLM.chat`` in process; prints both throughputs and the ratio (target >= 0.9x).
   The worker is started first and waited for, as a long-running worker would be, and the
   queue figure counts from the first job enqueued to the last result stored.
2. ``Client.submit_batch`` of 10,000 small jobs: jobs/s (target >= 2,000), rows written and
   messages published.

    python -m bench.queue [--jobs 128] [--max-tokens 64] [--submit-jobs 10000] [--no-metrics]

The worker runs with its Prometheus metrics on (``--metrics-port``), scraped every second.
"""

from __future__ import annotations

import sys
from pathlib import Path

# This file is named like the stdlib's ``queue``; keep its folder off the import path.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

import argparse
import json
import os
import resource
import socket
import subprocess
import tempfile
import threading
import time
import uuid

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TOPICS = ["the sea", "a lighthouse", "mountains", "a city at night", "autumn", "a robot", "coffee", "rain",
          "a library", "trains", "the moon", "a garden", "winter", "a market", "bridges", "the desert"]


def workload(n: int) -> list[list[dict]]:
    return [[{"role": "user", "content": f"Write a few sentences about {TOPICS[i % len(TOPICS)]} (#{i})."}]
            for i in range(n)]


def bench_in_process(model: str, convs, params: dict, max_num_seqs: int) -> tuple[float, int, int]:
    from engine import LLM, SamplingParams

    llm = LLM(model, device="cpu", max_num_seqs=max_num_seqs)
    llm.chat(convs[:2], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    outs = llm.chat(convs, SamplingParams(**params), use_tqdm=False)
    dt = time.perf_counter() - t0
    return dt, sum(len(c.token_ids) for o in outs for c in o.outputs), sum(o.metrics.num_cached_tokens for o in outs)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape_every(port: int, seconds: float, stop) -> list[int]:
    """Scrape the worker's /metrics like a (very eager) Prometheus; returns page sizes."""
    import urllib.request

    sizes = []
    while not stop.wait(seconds):
        try:
            sizes.append(len(urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()))
        except OSError:
            sizes.append(0)
    return sizes


def bench_queue(model: str, convs, params: dict, max_num_seqs: int, broker: str | None, db_url: str,
                workdir: Path, metrics: bool = True) -> dict:
    from worker.client import Client
    from worker.config import Settings
    from worker.local import LocalWorker
    from worker.summary import summarize

    queue = f"gen.bench-{uuid.uuid4().hex[:8]}"
    client = Client(broker_url=broker, database_url=db_url, model=model, queue=queue)
    settings = Settings(broker_url=client.settings.broker_url, database_url=db_url, model=model, queue=queue)
    port = free_port()
    extra = {"SPECBATCH_METRICS_PORT": str(port)} if metrics else {}
    worker = LocalWorker(settings, max_num_seqs=max_num_seqs, log_path=str(workdir / "worker.log"), extra_env=extra)
    stop_scraping, scrapes = threading.Event(), []
    scraper = threading.Thread(target=lambda: scrapes.extend(scrape_every(port, 1.0, stop_scraping)), daemon=True)
    try:
        while not client.workers_consuming(queue, timeout=0.5):
            if not worker.alive:
                raise SystemExit((workdir / "worker.log").read_text()[-3000:])
            time.sleep(0.3)
        # warm the worker's engine like the in-process run was warmed
        # A bulk job: an interactive one would hold the engine's slot reserve for the run.
        warm = client.submit(messages=convs[0], params={"max_tokens": 4}, model=model, priority="bulk")
        client.wait(warm, timeout=120)
        src = workdir / "bench.jsonl"
        with open(src, "w") as fh:
            for i, conv in enumerate(convs):
                fh.write(json.dumps({"custom_id": f"b{i}", "method": "POST", "url": "/v1/chat/completions",
                                     "body": {"messages": conv, **params}}) + "\n")
        env = dict(os.environ, PYTHONPATH=str(ROOT), SPECBATCH_QUEUE=queue, REDIS_URL=settings.broker_url)
        if metrics:
            scraper.start()
        t0 = time.perf_counter()
        cpu0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        res = subprocess.run([sys.executable, "-m", "worker.cli", "--database-url", db_url, "run", str(src),
                              "-o", str(workdir / "bench.out.jsonl"), "--model", model, "--no-local-worker",
                              "--batch-name", queue], env=env, capture_output=True, text=True)
        cli_wall = time.perf_counter() - t0
        stop_scraping.set()
        cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        cli_cpu = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
        if res.returncode != 0:
            raise SystemExit(res.stderr[-3000:])
        batch = client.store.get_batch(queue)
        jobs = client.store.jobs(batch.id)
        window = max(j.finished_at for j in jobs) - min(j.enqueued_at for j in jobs)
        s = summarize(jobs)
        if metrics:
            scraper.join(timeout=10)
        return {"window_s": window, "tokens": s["output_tokens"], "cli_wall_s": cli_wall, "cli_cpu_s": cli_cpu,
                "summary": s, "scrapes": [n for n in scrapes if n]}
    finally:
        stop_scraping.set()
        worker.stop()


def bench_submit(n: int, broker: str | None, db_url: str) -> dict:
    import redis

    from worker.client import Client

    queue = f"gen.submitbench-{uuid.uuid4().hex[:8]}"
    client = Client(broker_url=broker, database_url=db_url, model="bench-model", queue=queue)
    rows = [{"custom_id": f"s{i}", "prompt": f"hello number {i}", "max_tokens": 8} for i in range(n)]
    client.submit_batch(rows[:10], name=f"warm-{queue}")  # connections, schema, imports
    t0 = time.perf_counter()
    sub = client.submit_batch(rows, name=queue)
    dt = time.perf_counter() - t0
    r = redis.Redis.from_url(client.settings.broker_url.replace("redis+socket://", "unix://"))
    depth = r.llen(queue)
    r.delete(queue)
    return {"jobs": n, "seconds": dt, "jobs_per_s": n / dt, "published": sub.published, "queue_depth": depth}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--jobs", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--submit-jobs", type=int, default=10_000)
    ap.add_argument("--broker-url", default=os.environ.get("REDIS_URL"), help="default: REDIS_URL, else embedded")
    ap.add_argument("--database-url", default=None, help="default: a fresh SQLite file")
    ap.add_argument("--skip-generate", action="store_true")
    ap.add_argument("--skip-submit", action="store_true")
    ap.add_argument("--no-metrics", action="store_true", help="run the worker without --metrics-port")
    args = ap.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="specbatch-bench-"))
    db_url = args.database_url or f"sqlite:///{workdir / 'bench.db'}"

    if not args.skip_generate:
        from engine.model_hub import resolve_model

        model = resolve_model(args.model)
        convs = workload(args.jobs)
        params = {"max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True}
        dt, tokens, cached = bench_in_process(model, convs, params, args.max_num_seqs)
        inproc = tokens / dt
        print(f"in-process LLM.chat : {args.jobs} jobs, {tokens} tokens in {dt:.2f} s = {inproc:.1f} tok/s "
              f"(prefix-cached prompt tokens {cached})")
        q = bench_queue(model, convs, params, args.max_num_seqs, args.broker_url, db_url, workdir,
                        metrics=not args.no_metrics)
        queued = q["tokens"] / q["window_s"]
        s = q["summary"]
        print(f"specbatch run       : {args.jobs} jobs, {q['tokens']} tokens in {q['window_s']:.2f} s "
              f"(first enqueue -> last result) = {queued:.1f} tok/s; CLI wall {q['cli_wall_s']:.1f} s incl. start-up, "
              f"CLI CPU {q['cli_cpu_s']:.1f} s")
        print(f"  queue wait p50 {s['queue_wait_p50'] * 1e3:.0f} ms, TTFT p50 {s['ttft_p50'] * 1e3:.0f} ms "
              f"p95 {s['ttft_p95'] * 1e3:.0f} ms, TPOT p50 {s['tpot_p50'] * 1e3:.1f} ms, max batch {s['max_batch_size']}, "
              f"prefix-cached prompt tokens {s['cached_tokens']}")
        if not args.no_metrics:
            print(f"  worker metrics on (--metrics-port), /metrics scraped every 1 s: {len(q['scrapes'])} scrapes "
                  f"of ~{sum(q['scrapes']) // max(1, len(q['scrapes']))} bytes")
        print(f"ratio queue / in-process: {queued / inproc:.3f}x (target >= 0.9x)")
    if not args.skip_submit:
        r = bench_submit(args.submit_jobs, args.broker_url, db_url)
        print(f"submit_batch        : {r['jobs']} jobs in {r['seconds']:.2f} s = {r['jobs_per_s']:.0f} jobs/s "
              f"(target >= 2000); published {r['published']}, queue depth {r['queue_depth']}")


if __name__ == "__main__":
    main()
