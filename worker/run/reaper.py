"""The lease reaper and orphan sweep: the store heals the queue, whoever is watching.

Every worker process runs one (beside its heartbeat, and once as it starts). Each sweep:
- a ``running`` job whose lease expired (its worker stopped heartbeating: SIGKILL, OOM, a lost
  host) goes back to ``queued`` and is published again; a compare-and-swap on status, attempt
  and heartbeat lets exactly one reaper win each job;
- a ``queued`` job whose message is no longer waiting in Redis (a broker restarted without
  persistence, a publish that never happened, a message reserved by a worker that died) is
  published again once it has waited ``grace`` seconds since its last publish and was missing
  at two scans in a row (half a grace apart), so a message a live worker has just popped is
  not copied.
A dead worker's jobs are therefore back in the queue within lease + sweep interval. Duplicate
messages are harmless: the claim lets one attempt run and drops the other copies.

After this reaper could not reach the database, it reaps nothing until the database has been
reachable for a whole lease: while it was away no worker could heartbeat, so every running
lease looks expired though their workers are alive. Reaping them at once re-ran every job in
flight and spent one of each job's attempts per outage (three outages longer than a lease
failed every long job, "attempts exhausted", with no worker ever dead). A worker cut off from
a database the reapers still reach keeps no such grace: its jobs are reaped after a lease.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from sqlalchemy.exc import InterfaceError, OperationalError

from worker.common.config import settings
from worker.dispatch.publish import publish_jobs, queued_job_ids
from worker.common.periodic import PeriodicThread

log = logging.getLogger(__name__)


def sweep_seconds() -> float:
    return settings().sweep_seconds


def orphan_grace_seconds() -> float:
    return settings().orphan_grace_seconds


class Reaper(PeriodicThread):
    """Sweep every ``interval`` seconds for the queues this worker consumes."""

    def __init__(self, store: Any, app: Any, queues: list[str], *, worker: str, lease_s: float,
                 max_attempts: int, interval: float | None = None, grace_s: float | None = None) -> None:
        self.store = store
        self.app = app
        self.queues = queues
        self.worker = worker
        self.lease_s = lease_s
        self.max_attempts = max_attempts
        self.interval = sweep_seconds() if interval is None else interval
        self.grace_s = orphan_grace_seconds() if grace_s is None else grace_s
        # Scanning Redis for lost messages costs more than reaping: do it every half grace.
        self.orphan_interval = max(self.interval, self.grace_s / 2)
        self._last_orphan_sweep = float("-inf")
        # Ids missing at the previous scan: only a job missing at two scans in a row is an
        # orphan (a message a live worker just popped is claimed long before the next scan).
        self._missing_before: set[str] = set()
        # Since when (monotonic) this reaper has reached the database without a break; -inf
        # until an outage is seen (a worker starting is not a database coming back).
        self._reachable_since = float("-inf")
        self._unreachable = False
        super().__init__("specbatch-reaper", self.interval, self.sweep_or_log)

    def sweep_or_log(self) -> dict[str, int] | None:
        """``sweep``, or None when the database or the broker is away (tried again next interval)."""
        try:
            return self.sweep()
        except (OperationalError, InterfaceError):
            self._unreachable = True
            log.warning("reaper sweep failed: database unreachable", exc_info=True)
        except Exception:
            log.warning("reaper sweep failed", exc_info=True)
        return None

    def sweep(self) -> dict[str, int]:
        """One pass: reap expired leases, re-publish lost messages; returns the counts."""
        self.store.worker_beat(self.worker)
        if self._unreachable:  # the database is back: give the live workers a lease to heartbeat
            self._unreachable = False
            self._reachable_since = time.monotonic()
            log.warning("database reachable again: reaping resumes in %.0f s", self.lease_s)
        reaped: list[dict[str, Any]] = []
        if time.monotonic() - self._reachable_since >= self.lease_s:
            reaped = self.store.reap_expired(self.lease_s, self.queues, self.max_attempts)
        if reaped:
            publish_jobs(self.app, reaped, self._queue_of)
            log.warning("reaped %d job(s) whose worker stopped heartbeating", len(reaped))
        orphans: list[dict[str, Any]] = []
        if time.monotonic() - self._last_orphan_sweep >= self.orphan_interval:
            self._last_orphan_sweep = time.monotonic()
            orphans = self._orphans()
            self._settle_cache()
        if orphans:
            publish_jobs(self.app, orphans, self._queue_of)
            self.store.mark_published([r["id"] for r in orphans], recovered=True)
            log.warning("re-published %d queued job(s) whose message was lost", len(orphans))
        return {"reaped": len(reaped), "orphans": len(orphans)}

    def _settle_cache(self) -> None:
        """Bulk once's upkeep, at the orphans' pace: duplicates whose row ended without
        settling them are settled, and the result cache is held to its bound."""
        settled = self.store.settle_stray_duplicates()
        if settled:
            log.warning("settled %d duplicate job(s) whose first row had ended without them", settled)
        evicted = self.store.evict_cache(settings().cache_max_bytes)
        if evicted:
            log.info("evicted %d result cache entries (least recently used) to stay under %d bytes",
                     evicted, settings().cache_max_bytes)

    def _queue_of(self, row: dict[str, Any]) -> str:
        return row.get("queue") or self.queues[0]

    def _orphans(self) -> list[dict[str, Any]]:
        stale = self.store.stale_queued(self.grace_s, self.queues)
        if not stale:
            return []
        missing: list[str] = []
        with self.app.connection_for_write() as conn:
            client = conn.default_channel.client
            for queue in self.queues:
                mine = [job_id for job_id, q in stale if (q or self.queues[0]) == queue]
                if not mine:
                    continue
                # One sweeper per queue per interval: the others skip the scan.
                if not client.set(f"specbatch:sweep:{queue}", self.worker, nx=True,
                                  px=int(self.orphan_interval * 900)):
                    continue
                if len(mine) > 10_000 and client.llen(queue) >= len(mine):
                    continue  # a long healthy backlog: scanned once it has drained below the stale count
                present = queued_job_ids(client, queue)
                missing += [job_id for job_id in mine if job_id not in present]
        orphans = [job_id for job_id in missing if job_id in self._missing_before]
        self._missing_before = set(missing) - set(orphans)
        return self.store.message_rows(orphans) if orphans else []
