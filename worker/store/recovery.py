"""Recovery: jobs whose worker died (lease expired) or whose message may be lost go back to
the queue; what publishing them again needs."""

from __future__ import annotations

import time
from typing import Any, Sequence

from sqlalchemy import select, update

from worker.store.connection import StoreBase
from worker.store.leases import attempt_ended
from worker.store.models import FAILED, LOST, QUEUED, RUNNING, Job
from worker.store.rows import MESSAGE_FIELDS, chunks


class Recovery(StoreBase):
    """Lost leases and lost messages: the reaper's side."""

    def reap_expired(self, lease_s: float, queues: Sequence[str], max_attempts: int,
                     limit: int = 1000) -> list[dict[str, Any]]:
        """Running jobs in ``queues`` whose lease expired go back to queued (or fail, attempts
        used up); returns the rows to publish again.

        Every reaper in every worker runs this; a compare-and-swap on (status, attempts,
        heartbeat) lets exactly one of them win each job.
        """
        now = time.time()
        cutoff = now - lease_s
        cols = [getattr(Job, f) for f in MESSAGE_FIELDS] + [Job.attempts, Job.attempts_forgiven]
        with self.reader.connect() as conn:
            rows = conn.execute(
                select(*cols).where(Job.status == RUNNING, Job.heartbeat_at < cutoff, Job.queue.in_(list(queues)))
                .limit(limit)
            ).mappings().all()
        requeued: list[dict[str, Any]] = []
        for row in rows:
            lost = f"lease expired: the worker stopped heartbeating for {lease_s:.0f} s (crashed or killed?)"
            exhausted = row["attempts"] - (row["attempts_forgiven"] or 0) >= max_attempts
            values: dict[str, Any] = (
                dict(status=FAILED, finished_at=now, error_type="attempts_exhausted",
                     error=f"gave up after {row['attempts']} attempts; last: {lost}")
                if exhausted else
                dict(status=QUEUED, heartbeat_at=None, recovered_at=now, published_at=now, error=lost)
            )
            with self._write() as conn:
                res = conn.execute(
                    update(Job)
                    .where(Job.id == row["id"], Job.status == RUNNING, Job.attempts == row["attempts"],
                           Job.heartbeat_at < cutoff)
                    .values(**values)
                )
                if res.rowcount == 1:
                    conn.execute(attempt_ended(row["id"], row["attempts"], LOST, lost, charged=True, now=now))
                    if exhausted:
                        self.settle_duplicates(conn, [row["id"]])  # type: ignore[attr-defined]  # ResultCache
            if res.rowcount == 1 and not exhausted:
                requeued.append(dict(row))
        return requeued

    def stale_queued(self, grace_s: float, queues: Sequence[str], limit: int = 100_000) -> list[tuple[str, str | None]]:
        """(id, queue) of queued jobs in ``queues`` last published more than ``grace_s`` ago (their
        message may be lost: a Redis restarted without persistence, a publish that never happened)."""
        cutoff = time.time() - grace_s
        with self.reader.connect() as conn:
            rows = conn.execute(
                select(Job.id, Job.queue).where(
                    Job.status == QUEUED, Job.queue.in_(list(queues)),
                    Job.published_at < cutoff,  # NULL: not published yet, the pacer's to send
                    Job.duplicate_of.is_(None),  # a duplicate is never published: its first row answers it
                ).limit(limit)
            ).all()
        return [(r.id, r.queue) for r in rows]

    def message_rows(self, job_ids: Sequence[str]) -> list[dict[str, Any]]:
        """What publishing these jobs again needs of them (``MESSAGE_FIELDS``)."""
        cols = [getattr(Job, f) for f in MESSAGE_FIELDS]
        out: list[dict[str, Any]] = []
        with self.reader.connect() as conn:
            for chunk in chunks(list(job_ids), 500):
                out += [dict(r) for r in conn.execute(select(*cols).where(Job.id.in_(chunk))).mappings()]
        return out

    def mark_published(self, job_ids: Sequence[str], *, recovered: bool = False) -> None:
        now = time.time()
        values: dict[str, Any] = {"published_at": now}
        if recovered:
            values["recovered_at"] = now
        for chunk in chunks(list(job_ids), 500):
            with self._write() as conn:
                conn.execute(update(Job).where(Job.id.in_(chunk), Job.status == QUEUED).values(**values))

