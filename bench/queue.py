"""Queue overhead benchmark, one run:

1. The same workload (default 128 chat jobs, greedy, fixed output length) through
   ``specbatch run`` (Redis + Celery + SQL store + a worker process) and through
   ``LLM.chat`` in process; prints both throughputs and the ratio (target >= 0.9x).
   The worker is started first and waited for, as a long-running worker would be, and the
   queue figure counts from the first job enqueued to the last result stored. Rounds
   alternate the two sides (in-process first, then queue first, ...) with fresh prompts each
   round; every round's ratio is printed, and their median: on a shared machine one round's
   speed drifts by 10-20% between two runs of the same side.
2. ``Client.submit_batch`` of 10,000 small jobs: jobs/s (target >= 2,000), rows written and
   messages published.

    python -m bench.queue [--rounds 5] [--jobs 128] [--max-tokens 64] [--submit-jobs 10000] [--no-metrics]

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
import statistics
import subprocess
import tempfile
import threading
import time
import uuid

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TOPICS = ["the sea", "a lighthouse", "mountains", "a city at night", "autumn", "a robot", "coffee", "rain",
          "a library", "trains", "the moon", "a garden", "winter", "a market", "bridges", "the desert"]


def workload(n: int, round_no: int = 0) -> list[list[dict]]:
    """``n`` chat prompts; each round's differ (the round is in the text), so neither side reuses
    the previous round's prompts from its prefix cache."""
    return [[{"role": "user", "content": f"Write a few sentences about {TOPICS[i % len(TOPICS)]} (#{i}, r{round_no})."}]
            for i in range(n)]


class InProcess:
    """``LLM.chat`` in this process: built and warmed once, run once per round."""

    def __init__(self, model: str, max_num_seqs: int) -> None:
        from engine import LLM, SamplingParams

        self.llm = LLM(model, device="cpu", max_num_seqs=max_num_seqs)
        self.llm.chat(workload(2, -1), SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up

    def run(self, convs, params: dict) -> dict:
        from engine import SamplingParams

        engine = self.llm.engine
        engine_step = engine.step
        step_time = [0.0]

        def timed_step():
            start = time.perf_counter()
            try:
                return engine_step()
            finally:
                step_time[0] += time.perf_counter() - start

        steps0 = engine.stats["steps"]
        engine.step = timed_step  # the same figure the worker's step histogram records
        try:
            t0 = time.perf_counter()
            outs = self.llm.chat(convs, SamplingParams(**params), use_tqdm=False)
            dt = time.perf_counter() - t0
        finally:
            del engine.step
        return {"seconds": dt, "tokens": sum(len(c.token_ids) for o in outs for c in o.outputs),
                "cached": sum(o.metrics.num_cached_tokens for o in outs),
                "steps": engine.stats["steps"] - steps0, "step_seconds": step_time[0]}


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


class QueuePath:
    """One long-running worker (started, ready and warmed once, as in production); each round is
    a ``specbatch run`` of its own batch, timed from the first job enqueued to the last result
    stored, with the worker's ``/metrics`` scraped every second throughout."""

    def __init__(self, model: str, max_num_seqs: int, broker: str | None, db_url: str, workdir: Path,
                 metrics: bool = True) -> None:
        from worker.api.client import Client
        from worker.common.config import Settings
        from worker.run.local import LocalWorker

        self.model, self.db_url, self.workdir, self.metrics = model, db_url, workdir, metrics
        self.queue = f"gen.bench-{uuid.uuid4().hex[:8]}"
        self.client = Client(broker_url=broker, database_url=db_url, model=model, queue=self.queue)
        self.settings = Settings(broker_url=self.client.settings.broker_url, database_url=db_url, model=model,
                                 queue=self.queue)
        self.port = free_port()
        extra = {"SPECBATCH_METRICS_PORT": str(self.port)} if metrics else {}
        self.worker = LocalWorker(self.settings, max_num_seqs=max_num_seqs, log_path=str(workdir / "worker.log"),
                                  extra_env=extra)
        self.scrapes: list[int] = []
        self._stop_scraping = threading.Event()
        self._scraper = threading.Thread(
            target=lambda: self.scrapes.extend(scrape_every(self.port, 1.0, self._stop_scraping)), daemon=True)
        try:
            while not self.client.workers_consuming(self.queue, timeout=0.5):
                if not self.worker.alive:
                    raise SystemExit((workdir / "worker.log").read_text()[-3000:])
                time.sleep(0.3)
            # Warm the worker's engine like the in-process side was warmed. A bulk job: an
            # interactive one would hold the engine's slot reserve for the run.
            warm = self.client.submit(messages=workload(1, -1)[0], params={"max_tokens": 4}, model=model,
                                      priority="bulk")
            self.client.wait(warm, timeout=120)
        except BaseException:
            self.worker.stop()
            raise
        if metrics:
            self._scraper.start()

    def step_figures(self) -> tuple[float, float]:
        """(steps, seconds stepping) so far, from the worker's own ``/metrics``."""
        import urllib.request

        page = urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=5).read().decode()
        got = {}
        for line in page.splitlines():
            for key in ("specbatch:step_duration_seconds_count", "specbatch:step_duration_seconds_sum"):
                if line.startswith(key + " ") or line.startswith(key + "{"):
                    got[key] = got.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
        return got.get("specbatch:step_duration_seconds_count", 0.0), got.get("specbatch:step_duration_seconds_sum", 0.0)

    def run(self, convs, params: dict, round_no: int) -> dict:
        from worker.api.summary import summarize

        name = f"{self.queue}-r{round_no}"
        src = self.workdir / f"bench-r{round_no}.jsonl"
        with open(src, "w") as fh:
            for i, conv in enumerate(convs):
                fh.write(json.dumps({"custom_id": f"b{i}", "method": "POST", "url": "/v1/chat/completions",
                                     "body": {"messages": conv, **params}}) + "\n")
        env = dict(os.environ, PYTHONPATH=str(ROOT), SPECBATCH_QUEUE=self.queue, REDIS_URL=self.settings.broker_url)
        steps0 = self.step_figures() if self.metrics else (0.0, 0.0)
        t0 = time.perf_counter()
        cpu0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        res = subprocess.run([sys.executable, "-m", "worker.api.cli", "--database-url", self.db_url, "run", str(src),
                              "-o", str(self.workdir / f"bench-r{round_no}.out.jsonl"), "--model", self.model,
                              "--no-local-worker", "--batch-name", name], env=env, capture_output=True, text=True)
        cli_wall = time.perf_counter() - t0
        cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        if res.returncode != 0:
            raise SystemExit(res.stderr[-3000:])
        batch = self.client.store.get_batch(name)
        jobs = self.client.store.jobs(batch.id)
        window = max(j.finished_at for j in jobs) - min(j.enqueued_at for j in jobs)
        s = summarize(jobs)
        time.sleep(0.6)  # the engine process reports its steps every 0.25 s
        steps1 = self.step_figures() if self.metrics else (0.0, 0.0)
        return {"seconds": window, "tokens": s["output_tokens"], "cli_wall_s": cli_wall,
                "steps": steps1[0] - steps0[0], "step_seconds": steps1[1] - steps0[1],
                "cli_cpu_s": (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime), "summary": s}

    def close(self) -> list[int]:
        self._stop_scraping.set()
        if self._scraper.is_alive():
            self._scraper.join(timeout=10)
        self.worker.stop()
        return [n for n in self.scrapes if n]


def bench_submit(n: int, broker: str | None, db_url: str) -> dict:
    import redis

    from worker.api.client import Client

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
    ap.add_argument("--rounds", type=int, default=5, help="alternating in-process / queue rounds (median ratio)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--submit-jobs", type=int, default=10_000)
    ap.add_argument("--broker-url", default=os.environ.get("REDIS_URL"), help="default: REDIS_URL, else embedded")
    ap.add_argument("--database-url", default=None, help="default: a fresh SQLite file")
    ap.add_argument("--skip-generate", action="store_true")
    ap.add_argument("--skip-submit", action="store_true")
    ap.add_argument("--no-metrics", action="store_true", help="run the worker without --metrics-port")
    args = ap.parse_args()
    from bench.openmp import run_with_engine_openmp

    run_with_engine_openmp()  # the in-process side spins as the worker's engine does
    workdir = Path(tempfile.mkdtemp(prefix="specbatch-bench-"))
    db_url = args.database_url or f"sqlite:///{workdir / 'bench.db'}"

    if not args.skip_generate:
        from engine.model_hub import resolve_model

        model = resolve_model(args.model)
        params = {"max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True}
        in_process = InProcess(model, args.max_num_seqs)
        queue_path = QueuePath(model, args.max_num_seqs, args.broker_url, db_url, workdir, metrics=not args.no_metrics)
        ratios, busy = [], []
        try:
            for r in range(args.rounds):
                convs = workload(args.jobs, r)
                # Alternate which side goes first, so a machine that slows down (or speeds up)
                # during the run does not favour one side.
                order = ("in-process", "queue") if r % 2 == 0 else ("queue", "in-process")
                got = {side: (in_process.run(convs, params) if side == "in-process" else
                              queue_path.run(convs, params, r)) for side in order}
                ip, q = got["in-process"], got["queue"]
                inproc, queued = ip["tokens"] / ip["seconds"], q["tokens"] / q["seconds"]
                ratios.append(queued / inproc)
                busy.append((ip["step_seconds"] / ip["seconds"], q["step_seconds"] / q["seconds"] if q["steps"] else None,
                             ip["steps"], q["steps"]))
                s = q["summary"]
                print(f"round {r + 1} ({' then '.join(order)}):")
                print(f"  in-process LLM.chat : {args.jobs} jobs, {ip['tokens']} tokens in {ip['seconds']:.2f} s = "
                      f"{inproc:.1f} tok/s (prefix-cached prompt tokens {ip['cached']}); {ip['steps']} steps, "
                      f"{ip['step_seconds']:.2f} s stepping, {1e3 * ip['step_seconds'] / max(1, ip['steps']):.1f} ms/step")
                print(f"  specbatch run       : {args.jobs} jobs, {q['tokens']} tokens in {q['seconds']:.2f} s "
                      f"(first enqueue -> last result) = {queued:.1f} tok/s; CLI wall {q['cli_wall_s']:.1f} s incl. "
                      f"start-up, CLI CPU {q['cli_cpu_s']:.1f} s")
                if q["steps"]:
                    print(f"    engine: {q['steps']:.0f} steps, {q['step_seconds']:.2f} s stepping, "
                          f"{1e3 * q['step_seconds'] / q['steps']:.1f} ms/step (the worker's step histogram)")
                print(f"    queue wait p50 {s['queue_wait_p50'] * 1e3:.0f} ms, TTFT p50 {s['ttft_p50'] * 1e3:.0f} ms "
                      f"p95 {s['ttft_p95'] * 1e3:.0f} ms, TPOT p50 {s['tpot_p50'] * 1e3:.1f} ms, max batch "
                      f"{s['max_batch_size']}, prefix-cached prompt tokens {s['cached_tokens']}")
                print(f"  ratio queue / in-process: {ratios[-1]:.3f}x", flush=True)
        finally:
            scrapes = queue_path.close()
        if not args.no_metrics:
            print(f"worker metrics on (--metrics-port), /metrics scraped every 1 s throughout: {len(scrapes)} scrapes "
                  f"of ~{sum(scrapes) // max(1, len(scrapes))} bytes")
        if all(b[1] is not None for b in busy):
            # Independent of the machine's speed, which drifts between two phases: the share of
            # each side's window spent in engine steps, and how many steps each took.
            print("share of the window spent stepping, in-process vs queue: " +
                  ", ".join(f"{a:.3f}/{b:.3f}" for a, b, _, _ in busy) +
                  "; steps: " + ", ".join(f"{c}/{d:.0f}" for _, _, c, d in busy))
        print(f"ratio queue / in-process: median {statistics.median(ratios):.3f}x over {len(ratios)} rounds "
              f"({', '.join(f'{x:.3f}' for x in ratios)}; min {min(ratios):.3f}x) (target >= 0.9x)")
    if not args.skip_submit:
        r = bench_submit(args.submit_jobs, args.broker_url, db_url)
        print(f"submit_batch        : {r['jobs']} jobs in {r['seconds']:.2f} s = {r['jobs_per_s']:.0f} jobs/s "
              f"(target >= 2000); published {r['published']}, queue depth {r['queue_depth']}")


if __name__ == "__main__":
    main()
