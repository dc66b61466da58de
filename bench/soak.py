"""Soak under kills: many tiny jobs through two workers, one SIGKILLed and restarted every
~20 s, nobody watching but the workers themselves. Prints jobs lost (must be 0), duplicate
results (0), stuck jobs (0) and the recovery time of every job a kill orphaned (p50/p99/max:
from the kill until the job is back in the queue or claimed again).

    python bench/soak.py [--jobs 10000] [--kill-every 20] [--lease 5] [--sweep 1]

``--chaos`` (issue 33): 20,000 jobs through 2 workers on a private Redis and a PostgreSQL
schema behind a TCP proxy, with one fault each at 10-80 % of the run: a worker SIGKILL, an
engine-process SIGKILL, a Redis restart after 10 s (append-only file kept), a 15-s database
cut, and a Redis restart after 10 s that lost everything. Prints lost, duplicated, stuck and
failed jobs (all must be 0), the restarts of each worker (only the two kills may cause one),
and the attempts each fault spent (charged and forgiven, from the attempt history).

    python bench/soak.py --chaos [--jobs 20000]
"""

from __future__ import annotations

import argparse
import random
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

# bench/queue.py is named like the stdlib's ``queue``; keep this folder off the import path.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
ROOT = _HERE.parent
sys.path.insert(0, str(ROOT))

from bench.soak_setup import soak_outcome, start_soak


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=None, help="default 10,000 (20,000 with --chaos)")
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--kill-every", type=float, default=20.0)
    ap.add_argument("--lease", type=float, default=5.0)
    ap.add_argument("--sweep", type=float, default=1.0)
    ap.add_argument("--seqs", type=int, default=32)
    ap.add_argument("--broker-url", default="redis://127.0.0.1:6379/13")
    ap.add_argument("--database-url", default=None, help="default: a fresh SQLite file")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--chaos", action="store_true", help="one fault of each kind instead of periodic kills")
    args = ap.parse_args()
    from worker.common.quiet import quiet_finalization

    quiet_finalization()  # triton's nanobind leak report at exit says nothing about the run
    if args.chaos:
        from bench.soak_chaos import run_chaos

        args.jobs = args.jobs or 20_000
        sys.exit(run_chaos(args))
    args.jobs = args.jobs or 10_000

    from tests.helpers.tiny_models import make_tiny_model
    from worker.store.models import QUEUED, RUNNING, SUCCEEDED

    tmp = Path(tempfile.mkdtemp(prefix="specbatch-soak-"))
    model = str(make_tiny_model(tmp / "model"))
    db = args.database_url or f"sqlite:///{tmp / 'soak.db'}"
    workers, client, batch_id, t0 = start_soak("soak", args, tmp, model=model, broker_url=args.broker_url,
                                               worker_db_url=db, client_db_url=db, max_attempts=20)

    recoveries: list[float] = []
    watchers: list[threading.Thread] = []

    def watch(orphans: dict[str, int], killed_at: float) -> None:
        """Record, per orphaned job, when it left its dead attempt (requeued or re-claimed)."""
        from sqlalchemy import select

        from worker.store.models import Job

        pending = dict(orphans)
        while pending and time.time() - killed_at < 300:
            with client.store.reader.connect() as conn:
                rows = conn.execute(select(Job.id, Job.status, Job.attempts).where(Job.id.in_(list(pending)))).all()
            for job_id, status, attempts in rows:
                if status != RUNNING or attempts != pending[job_id]:
                    recoveries.append(time.time() - killed_at)
                    del pending[job_id]
            time.sleep(0.05)

    rng = random.Random(1)
    kills = 0
    next_kill = time.time() + args.kill_every
    deadline = time.time() + args.timeout
    while time.time() < deadline:
        for w in workers:
            w.keep_alive(max_restarts=1000)
        counts = client.store.batch_counts(batch_id)
        done = counts[SUCCEEDED] + counts["failed"] + counts["cancelled"]
        if counts[QUEUED] == 0 and counts[RUNNING] == 0:
            break
        ready = [w.alive and Path(w.log_path).read_text(errors="replace").count(" ready.") >= 1 + w.restarts
                 for w in workers]
        # Kill only while both are serving: with the other one still starting, nobody is there
        # to reap (recovery then waits for a worker to come up, which this machine takes 5-40 s).
        if time.time() >= next_kill and all(ready):
            victim = rng.choice(workers)
            killed_at = time.time()
            victim.proc.send_signal(signal.SIGKILL)
            victim.proc.wait()
            kills += 1
            orphans = {j.id: j.attempts for j in client.store.jobs(batch_id, statuses=[RUNNING])
                       if j.worker == victim.node}
            print(f"  t={killed_at - t0:6.1f} s kill #{kills} of {victim.node}: {len(orphans)} running jobs orphaned; "
                  f"{done}/{args.jobs} done", flush=True)
            thread = threading.Thread(target=watch, args=(orphans, killed_at), daemon=True)
            thread.start()
            watchers.append(thread)
            next_kill = time.time() + args.kill_every * rng.uniform(0.75, 1.25)
        time.sleep(0.2)
    elapsed = time.time() - t0
    for thread in watchers:
        thread.join(60)
    for w in workers:
        w.stop(timeout=30)

    jobs, counts, stored = soak_outcome(client, batch_id, workers)
    lost = sum(1 for j in jobs if j.status != SUCCEEDED and j.status not in (QUEUED, RUNNING))
    stuck = counts[QUEUED] + counts[RUNNING]
    duplicates = sum(n - 1 for n in stored.values() if n > 1)
    print(f"\n{args.jobs} jobs x {args.max_tokens} tokens, 2 workers (tiny model, {args.seqs} seqs), "
          f"lease {args.lease} s, sweep {args.sweep} s, a SIGKILL every ~{args.kill_every} s")
    print(f"elapsed {elapsed:.1f} s ({counts[SUCCEEDED] / elapsed:.1f} jobs/s), kills {kills}, "
          f"jobs retried {sum(j.attempts > 1 for j in jobs)}")
    print(f"jobs lost (failed):   {lost}")
    print(f"duplicate results:    {duplicates}")
    print(f"stuck (not finished): {stuck}")
    print(f"succeeded:            {counts[SUCCEEDED]} / {args.jobs}  (results logged as stored: {len(stored)})")
    if recoveries:
        print(f"recovery of {len(recoveries)} orphaned jobs: p50 {percentile(recoveries, 0.5):.2f} s, "
              f"p99 {percentile(recoveries, 0.99):.2f} s, max {max(recoveries):.2f} s "
              f"(bound: lease + sweep = {args.lease + args.sweep:.1f} s)")
    sys.exit(0 if lost == 0 and duplicates == 0 and stuck == 0 else 1)


if __name__ == "__main__":
    main()
