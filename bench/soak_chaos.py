"""``bench/soak.py --chaos``: one fault of each kind during one run (issue 33).

Faults strike at fixed fractions of the jobs done, each once both workers serve: a worker
SIGKILL (10 %), an engine-process SIGKILL (25 %), a Redis restart after 10 s with its
append-only file (40 %), a 15-s PostgreSQL cut through a TCP proxy (55 %), and a Redis restart
after 10 s that lost everything (70 %). A supervisor loop restarts a worker that exits, as
systemd would; only the two kills may need it. The attempt history (``job_attempts``) tells
which attempts each fault spent: every attempt that ended in a fault's window, until the next.
"""

from __future__ import annotations

import re
import shutil
import signal
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

FRACTIONS = (0.10, 0.25, 0.40, 0.55, 0.70)
OUTAGE_S = {"redis": 10.0, "database": 15.0}


@dataclass
class Fault:
    name: str
    at_fraction: float
    strike: Callable[[], None]
    started_at: float | None = None
    done_at: float | None = None
    done_jobs: int = 0  # jobs done when it struck
    note: str = ""


@dataclass
class Tally:
    charged: int = 0
    forgiven: int = 0
    causes: dict[str, int] = field(default_factory=dict)


def _pg_schema_url(base: str) -> tuple[str, Callable[[], None]]:
    """A fresh schema on the PostgreSQL at ``base`` and a callable that drops it."""
    import psycopg

    schema = f"soak_{uuid.uuid4().hex[:10]}"
    plain = base.replace("+psycopg", "")
    with psycopg.connect(plain, autocommit=True) as conn:
        conn.execute(f'CREATE SCHEMA "{schema}"')

    def drop() -> None:
        with psycopg.connect(plain, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA "{schema}" CASCADE')

    return f"{base}?options=-csearch_path%3D{schema}", drop


def run_chaos(args: Any) -> int:
    import tempfile

    from sqlalchemy.engine import make_url

    from bench.soak_setup import soak_outcome, start_soak
    from tests.faults.conftest import RedisServer, TcpProxy, engine_pid
    from tests.helpers.tiny_models import make_tiny_model
    from worker.run.local import LocalWorker
    from worker.store.models import FAILED, QUEUED, RUNNING, SUCCEEDED
    from worker.store.store import Store

    tmp = Path(tempfile.mkdtemp(prefix="specbatch-chaos-"))
    model = str(make_tiny_model(tmp / "model"))
    redis_server = RedisServer(tmp, persistent=True)
    pg_direct, drop_schema = _pg_schema_url(args.database_url or "postgresql+psycopg://postgres@127.0.0.1:5432/test")
    url = make_url(pg_direct)
    proxy = TcpProxy(url.port or 5432)
    pg_proxied = url.set(port=proxy.port).render_as_string(hide_password=False)
    Store(pg_direct, auto_upgrade=True)
    workers, client, batch_id, t0 = start_soak("chaos", args, tmp, model=model, broker_url=redis_server.url,
                                               worker_db_url=pg_proxied, client_db_url=pg_direct, max_attempts=3)

    def ready(w: LocalWorker) -> bool:
        return w.alive and Path(w.log_path).read_text(errors="replace").count(" ready.") >= 1 + w.restarts

    def supervise() -> None:
        for w in workers:
            w.keep_alive(max_restarts=1000)

    def wait_out(seconds: float) -> None:
        end = time.time() + seconds
        while time.time() < end:
            supervise()
            time.sleep(0.2)

    def kill_worker() -> None:
        victim = workers[0]
        victim.proc.send_signal(signal.SIGKILL)
        victim.proc.wait()

    def kill_engine() -> None:
        import os

        victim = workers[1]
        os.kill(engine_pid(victim.proc.pid), signal.SIGKILL)
        victim.proc.wait(timeout=120)  # it gives its jobs back and exits 4; the supervisor restarts it

    def restart_redis(keep: bool) -> Callable[[], None]:
        def strike() -> None:
            redis_server.kill()
            if not keep:  # a Redis that lost everything: its append-only file is gone
                shutil.rmtree(redis_server.dir)
                redis_server.dir.mkdir()
            wait_out(OUTAGE_S["redis"])
            redis_server.start()
        return strike

    def cut_database() -> None:
        proxy.cut()
        wait_out(OUTAGE_S["database"])
        proxy.restore()

    faults = [Fault("worker SIGKILL", FRACTIONS[0], kill_worker),
              Fault("engine SIGKILL", FRACTIONS[1], kill_engine),
              Fault("Redis restart (AOF kept)", FRACTIONS[2], restart_redis(True)),
              Fault("database cut 15 s", FRACTIONS[3], cut_database),
              Fault("Redis restart (all lost)", FRACTIONS[4], restart_redis(False))]
    pending = list(faults)
    deadline = time.time() + args.timeout
    counts = client.store.batch_counts(batch_id)
    while time.time() < deadline:
        supervise()
        counts = client.store.batch_counts(batch_id)
        done = counts[SUCCEEDED] + counts[FAILED] + counts["cancelled"]
        if counts[QUEUED] == 0 and counts[RUNNING] == 0:
            break
        # Each fault strikes with jobs running, both workers serving, and the run moving again
        # since the last fault (5 % more jobs done), so no fault lands inside another's recovery.
        last = max((f.done_jobs for f in faults if f.started_at is not None), default=0)
        if (pending and done >= max(pending[0].at_fraction * args.jobs, last + 0.05 * args.jobs)
                and counts[RUNNING] >= 4 and all(ready(w) for w in workers)):
            fault = pending.pop(0)
            fault.started_at = time.time()
            fault.note = f"{done}/{args.jobs} done, {counts[RUNNING]} running"
            fault.done_jobs = done
            print(f"  t={fault.started_at - t0:6.1f} s {fault.name}: {fault.note}", flush=True)
            fault.strike()
            fault.done_at = time.time()
        time.sleep(0.2)
    elapsed = time.time() - t0
    for w in workers:
        w.stop(timeout=30)

    jobs, counts, stored = soak_outcome(client, batch_id, workers)
    failed = counts[FAILED] + counts["cancelled"]
    stuck = counts[QUEUED] + counts[RUNNING]
    duplicates = sum(n - 1 for n in stored.values() if n > 1)
    lost = args.jobs - len(jobs)  # rows that vanished (never: the store keeps every line)
    tallies = {f.name: Tally() for f in faults}
    history = _histories(client.store, [j.id for j in jobs if j.attempts > 1])
    struck = [f for f in faults if f.started_at is not None]
    for a in history:
        owner = None
        for f in struck:
            if a.ended_at >= f.started_at:
                owner = f
        tally = tallies[owner.name] if owner else tallies.setdefault("before any fault", Tally())
        if a.charged:
            tally.charged += 1
        else:
            tally.forgiven += 1
        cause = re.sub(r"\d+(\.\d+)?", "N", (a.cause or a.outcome))[:70]
        tally.causes[cause] = tally.causes.get(cause, 0) + 1

    print(f"\n{args.jobs} jobs x {args.max_tokens} tokens, 2 workers (tiny model, {args.seqs} seqs), "
          f"PostgreSQL via a proxy, private Redis; lease {args.lease} s, sweep {args.sweep} s")
    print(f"elapsed {elapsed:.1f} s ({counts[SUCCEEDED] / elapsed:.1f} jobs/s); faults struck {len(struck)}/5")
    print(f"lost:       {lost}")
    print(f"duplicated: {duplicates}")
    print(f"stuck:      {stuck}")
    print(f"failed:     {failed}")
    print(f"succeeded:  {counts[SUCCEEDED]} / {args.jobs}  (results logged as stored: {len(stored)})")
    print("worker restarts: " + ", ".join(f"{w.node} {w.restarts} (last exit {w.last_exit})" for w in workers))
    print(f"jobs with more than one attempt: {sum(j.attempts > 1 for j in jobs)}; attempts charged beyond the "
          f"first: {sum(j.attempts - (j.attempts_forgiven or 0) - 1 for j in jobs if j.attempts)}")
    print("attempts spent per fault (ended attempts in the fault's window, until the next fault):")
    for name, tally in tallies.items():
        causes = "; ".join(f"{n} x {c}" for c, n in sorted(tally.causes.items(), key=lambda kv: -kv[1])[:3])
        print(f"  {name:<26} charged {tally.charged:4d}  forgiven {tally.forgiven:4d}  {causes}")
    proxy.close()
    redis_server.kill()
    drop_schema()
    return 0 if lost == 0 and duplicates == 0 and stuck == 0 and failed == 0 and len(struck) == 5 else 1


def _histories(store: Any, job_ids: list[str]) -> list[Any]:
    from sqlalchemy import select

    from worker.store.models import JobAttempt

    out = []
    with store.Session() as s:
        for i in range(0, len(job_ids), 500):
            out += list(s.scalars(select(JobAttempt).where(JobAttempt.job_id.in_(job_ids[i:i + 500]))))
    return out
