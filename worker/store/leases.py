"""Attempts and their leases: a claim is a compare-and-swap that returns the request, every
later write (heartbeat, result, give back) names its attempt, so a stale copy never wins."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Mapping, Sequence

from sqlalchemy import Boolean, Connection, Integer, String, Text, bindparam, func, insert, literal, select, update
from sqlalchemy.exc import InterfaceError, OperationalError

from worker.store.connection import StoreBase
from worker.store.models import FAILED, GIVEN_BACK, LOST, QUEUED, RUNNING, TERMINAL, Epoch, Job, JobAttempt
from worker.store.rows import CLAIM_FIELDS

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Claim:
    """What ``Store.claim`` decided: run it as ``attempt`` (``job``: the request columns the
    claim's write returned, ``CLAIM_FIELDS``), or skip it and why."""

    attempt: int | None
    reason: str = ""
    enqueued_at: float | None = None  # of a won claim: its queue wait ends now
    started_at: float | None = None
    job: dict[str, Any] | None = None

    @property
    def ok(self) -> bool:
        return self.attempt is not None


# A worker's per-job statements, built once: building a Core statement and its cache key cost
# more of a one-token job's worker CPU than executing it (py-spy: about half of the group
# commit's time went to ``update(...).values(...)`` and ``_generate_cache_key``).
_CLAIM_READ = (select(Job.status, Job.attempts, Job.heartbeat_at, Job.attempts_forgiven, Job.enqueued_at,
                      Job.worker, Job.device, Job.started_at)
               .where(Job.id == bindparam("p_job_id")))


_CLAIM_FIELDS_READ = select(*[getattr(Job, f) for f in CLAIM_FIELDS]).where(Job.id == bindparam("p_job_id"))


def attempt_ended(job_id: str, attempt: int, outcome: str, cause: str | None, *, charged: bool, now: float):
    """Insert the ``JobAttempt`` of an attempt that ends without ending its job, its worker,
    device and start read from the job row (run it in the transaction that moves the job on,
    before a new claim overwrites them)."""
    return insert(JobAttempt).from_select(
        ["job_id", "attempt", "worker", "device", "started_at", "ended_at", "outcome", "cause", "charged"],
        select(Job.id, literal(attempt, Integer), Job.worker, Job.device, Job.started_at, literal(now, Epoch),
               literal(outcome, String), literal((cause or "")[:2000] or None, Text),
               literal(charged, Boolean)).where(Job.id == job_id))


_NOW = bindparam("p_now", type_=Job.__table__.c.started_at.type)  # the claim's time (``at``: one per delivery)
_BEAT = bindparam("p_beat", type_=Job.__table__.c.heartbeat_at.type)  # the lease's start: now, even on a retry


_CLAIM_WRITE = (  # bound names are not column names: SET's own parameters take those
    update(Job)
    .where(Job.id == bindparam("p_job_id"), Job.attempts == bindparam("p_attempts"),
           Job.status == bindparam("p_status"))
    .values(status=RUNNING, attempts=bindparam("p_next_attempt"), worker=bindparam("p_worker"),
            device=bindparam("p_device"), started_at=_NOW, heartbeat_at=_BEAT, error=None, error_type=None,
            queue_wait_s=_NOW - Job.enqueued_at,
            queue=func.coalesce(bindparam("p_queue", type_=Job.__table__.c.queue.type), Job.queue))
    .returning(*[getattr(Job, f) for f in CLAIM_FIELDS])  # the request rides the claim: no second read
)


#: The usual claim, of many queued jobs in one statement: a group message's jobs took two
#: round trips each (read, then compare-and-swap), most of a one-token job's worker CPU on
#: PostgreSQL. Jobs it does not take (running elsewhere, done, out of attempts, unknown) go
#: through the one-job claim, which says why.
_CLAIM_QUEUED = (
    update(Job)
    .where(Job.id.in_(bindparam("p_job_ids", expanding=True)), Job.status == QUEUED,
           Job.attempts - func.coalesce(Job.attempts_forgiven, 0) < bindparam("p_max_attempts"))
    .values(status=RUNNING, attempts=Job.attempts + 1, worker=bindparam("p_worker"),
            device=bindparam("p_device"), started_at=_NOW, heartbeat_at=_BEAT, error=None, error_type=None,
            queue_wait_s=_NOW - Job.enqueued_at,
            queue=func.coalesce(bindparam("p_queue", type_=Job.__table__.c.queue.type), Job.queue))
    .returning(Job.id, Job.attempts, Job.enqueued_at, *[getattr(Job, f) for f in CLAIM_FIELDS])
)


#: The attempts of jobs about to get their results, their rows locked until the write.
_FINISH_OWNERS = (select(Job.id, Job.attempts, Job.status, Job.finished_at, Job.has_duplicates, Job.worker, Job.device,
                         Job.started_at, Job.queue_wait_s)
                  .where(Job.id.in_(bindparam("p_job_ids", expanding=True)))
                  .with_for_update())


def _finish_params(job_id: str, attempt: int, values: dict[str, Any]) -> dict[str, Any]:
    return dict({f"v_{k}": v for k, v in values.items()}, p_job_id=job_id, p_attempt=attempt)


@lru_cache(maxsize=64)
def _finish_statement(columns: tuple[str, ...]):
    """The fenced result UPDATE for one set of result columns (bound as ``v_<column>``)."""
    table = Job.__table__
    return (update(Job)
            .where(Job.id == bindparam("p_job_id"), Job.attempts == bindparam("p_attempt"), Job.status == RUNNING)
            .values({c: bindparam(f"v_{c}", type_=table.c[c].type) for c in columns}))



class Leases(StoreBase):
    """A worker's writes of its attempts: claim, heartbeat, result, give back."""

    def claim(self, job_id: str, *, worker: str, device: str, lease_s: float, max_attempts: int,
              queue: str | None = None, at: float | None = None) -> Claim:
        """Start a new attempt of ``job_id`` and return its request with it, or say why not
        (done, live elsewhere, no such job, …).

        Compare-and-swap on (status, attempts): of two copies racing, exactly one wins.
        ``queue``: the queue the job's message came from, recorded for its next message.
        ``at``: the claim's time, the same on every retry of one delivery: a claim whose commit
        reached the database though its answer was lost (a connection cut mid-commit) is
        recognised on the retry as this worker's own (its worker and start time) and returned,
        instead of being taken for another live attempt, left to run nowhere until its lease
        expired, and re-run as a second attempt.
        """
        return self._write_op(lambda conn: self._claim(conn, job_id, worker=worker, device=device, lease_s=lease_s,
                                                       max_attempts=max_attempts, queue=queue, at=at))

    def claim_many(self, job_ids: Sequence[str], *, worker: str, device: str, lease_s: float, max_attempts: int,
                   queue: str | None = None, at: float | None = None) -> list[Claim | Exception]:
        """``claim`` of each job id in one write (a group message's jobs). A claim that raises
        is retried alone and its error returned in its place, so it fails only its own job; an
        unreachable database raises, as ``claim``. ``at``: as ``claim``'s."""
        def claim_all(conn: Connection) -> list[Claim]:
            now = time.time() if at is None else at
            taken = {row["id"]: row for row in conn.execute(_CLAIM_QUEUED, {
                "p_job_ids": list(dict.fromkeys(job_ids)), "p_max_attempts": max_attempts, "p_worker": worker,
                "p_device": device, "p_now": now, "p_beat": time.time(), "p_queue": queue}).mappings()}
            claims: list[Claim] = []
            seen: set[str] = set()
            for job_id in job_ids:
                row = taken.pop(job_id, None)  # a duplicate id in one message: its second copy is refused
                if row is not None:
                    claims.append(Claim(row["attempts"], enqueued_at=row["enqueued_at"], started_at=now,
                                        job={f: row[f] for f in CLAIM_FIELDS}))
                else:  # a second copy is not this claim's own, whatever its time
                    claims.append(self._claim(conn, job_id, worker=worker, device=device, lease_s=lease_s,
                                              max_attempts=max_attempts, queue=queue,
                                              at=None if job_id in seen else now))
                seen.add(job_id)
            return claims

        try:
            return list(self._write_op(claim_all))
        except (OperationalError, InterfaceError):
            raise
        except Exception:
            if len(job_ids) == 1:
                raise
        out: list[Claim | Exception] = []
        for n, job_id in enumerate(job_ids):
            try:
                out.append(self.claim(job_id, worker=worker, device=device, lease_s=lease_s,
                                      max_attempts=max_attempts, queue=queue,
                                      at=None if job_id in job_ids[:n] else at))
            except (OperationalError, InterfaceError):
                raise
            except Exception as exc:
                out.append(exc)
        return out

    def _claim(self, conn: Connection, job_id: str, *, worker: str, device: str, lease_s: float, max_attempts: int,
               queue: str | None, at: float | None = None) -> Claim:
        for _ in range(5):
            now = time.time()
            start = now if at is None else at
            row = conn.execute(_CLAIM_READ, {"p_job_id": job_id}).first()
            if row is None:
                # The store is the only truth: a message never makes a job (its row may be gone
                # with a database restored from an older backup; nothing says it should run).
                log.warning("job %s: no such job in the store; its message is dropped", job_id)
                return Claim(None, "unknown job")
            status, attempts, heartbeat, forgiven, enqueued_at, last_worker, last_device, last_started = row
            if status in TERMINAL:
                return Claim(None, f"already {status}")
            if at is not None and status == RUNNING and last_worker == worker and last_started == at:
                # This very claim, committed before its answer was lost: it is ours.
                job = conn.execute(_CLAIM_FIELDS_READ, {"p_job_id": job_id}).mappings().first()
                return Claim(attempts, enqueued_at=enqueued_at, started_at=at, job=dict(job))
            if status == RUNNING and heartbeat is not None and now - heartbeat < lease_s:
                # Safe to drop this copy: if that attempt dies, the lease reaper re-publishes.
                return Claim(None, "running in another live attempt")
            if attempts - (forgiven or 0) >= max_attempts:
                conn.execute(
                    update(Job)
                    .where(Job.id == job_id, Job.attempts == attempts, Job.status == status)
                    .values(status=FAILED, finished_at=now, error_type="attempts_exhausted",
                            error=f"gave up after {attempts - (forgiven or 0)} attempts: each one's worker "
                                  "died or lost its lease mid-job")
                )
                return Claim(None, "attempts exhausted")
            job = conn.execute(_CLAIM_WRITE, {
                "p_job_id": job_id, "p_attempts": attempts, "p_status": status, "p_next_attempt": attempts + 1,
                "p_worker": worker, "p_device": device, "p_now": start, "p_beat": now, "p_queue": queue,
            }).mappings().first()
            if job is not None:
                if status == RUNNING:  # taken over from an attempt whose lease expired: it was lost
                    conn.execute(insert(JobAttempt).values(
                        job_id=job_id, attempt=attempts, worker=last_worker, device=last_device,
                        started_at=last_started, ended_at=now, outcome=LOST, charged=True,
                        cause=f"lease expired: taken over by {worker}"))
                return Claim(attempts + 1, enqueued_at=enqueued_at, started_at=start, job=dict(job))
        return Claim(None, "lost the race to another attempt")

    def heartbeat(self, job_id: str, attempt: int) -> bool:
        """Refresh the lease; False when this attempt no longer owns the job (cancelled, or a
        newer attempt took over), which tells the caller to abort its generation."""
        return job_id not in self.heartbeat_many({job_id: attempt})

    def heartbeat_many(self, attempts: dict[str, int]) -> set[str]:
        """Refresh the leases of many attempts ``{job id: attempt}`` in one transaction; return
        the job ids those attempts no longer own (cancelled, finished elsewhere, superseded)."""
        if not attempts:
            return set()
        now = time.time()
        with self._write() as conn:
            conn.execute(
                update(Job)
                .where(Job.id == bindparam("job_id"), Job.attempts == bindparam("attempt"), Job.status == RUNNING)
                .values(heartbeat_at=now),
                [{"job_id": job_id, "attempt": attempt} for job_id, attempt in attempts.items()],
            )
            rows = conn.execute(
                select(Job.id, Job.attempts, Job.status).where(Job.id.in_(list(attempts)))
            ).all()
        owned = {job_id for job_id, attempt, status in rows if status == RUNNING and attempt == attempts[job_id]}
        return set(attempts) - owned

    def finish(self, job_id: str, attempt: int, values: dict[str, Any]) -> bool:
        """Write a final result (status in ``values``) if ``attempt`` still owns the job."""
        return self.finish_many([(job_id, attempt, values)])[0]

    def finish_many(self, results: Sequence[tuple[str, int, dict[str, Any]]],
                    cache: Mapping[str, tuple[str, str]] | None = None) -> list[bool]:
        """``finish`` of each (job id, attempt, values) in one write; True where it was stored.

        Retried with the same values after a commit whose answer was lost (a connection cut
        mid-commit), a result already stored by that commit (the same attempt, status and
        ``finished_at``) is True, not refused as if another attempt owned the job.
        ``cache``: job id -> (result cache key, model key) of jobs whose success is cached in the
        same transaction (``worker.store.results_cache``); a job's duplicates in its batch are
        settled in it too."""
        def write(conn: Connection) -> list[bool]:
            ids = [job_id for job_id, _, _ in results]
            if len(set(ids)) < len(ids):  # a job twice: each write fenced by the one before it
                stored = [conn.execute(_finish_statement(tuple(values)), _finish_params(job_id, attempt, values)).rowcount == 1
                          for job_id, attempt, values in results]
                self._after_results(conn, [r for r, ok in zip(results, stored) if ok], cache, ids, {})
                return stored
            # Which attempts still own their jobs, read with the rows locked (SQLite's write
            # transactions are exclusive already), then one statement for all of them: a
            # statement a result cost a round trip each on PostgreSQL.
            current = {row.id: row for row in conn.execute(_FINISH_OWNERS, {"p_job_ids": ids})}
            owned, stored_before = [], set()
            copied = [row.id for row in current.values() if row.has_duplicates]
            for job_id, attempt, values in results:
                row = current.get(job_id)
                if row is None or row.attempts != attempt:
                    continue
                if row.status == RUNNING:
                    owned.append((job_id, attempt, values))
                elif row.status == values.get("status") and row.finished_at is not None \
                        and row.finished_at == values.get("finished_at"):
                    stored_before.add(job_id)
            by_columns: dict[tuple[str, ...], list[dict[str, Any]]] = {}
            for job_id, attempt, values in owned:
                by_columns.setdefault(tuple(values), []).append(_finish_params(job_id, attempt, values))
            for columns, params in by_columns.items():
                conn.execute(_finish_statement(columns), params)
            self._after_results(conn, owned, cache, copied, current)
            owners = {job_id for job_id, _, _ in owned} | stored_before
            return [job_id in owners for job_id in ids]

        return self._write_op(write) if results else []

    def _after_results(self, conn: Connection, written: Sequence[tuple[str, int, dict[str, Any]]],
                       cache: Mapping[str, tuple[str, str]] | None, copied: Sequence[str],
                       rows: Mapping[str, Any]) -> None:
        """In a result's transaction: cache what may be cached (with the attempt's own timings,
        read with the rows: worker, device, start), settle the rows duplicating it."""
        if cache and written:
            now = time.time()
            entries = []
            for job_id, _, values in written:
                if job_id in cache:
                    row = rows.get(job_id)
                    attempt = {"id": job_id} if row is None else {
                        "id": job_id, "worker": row.worker, "device": row.device, "started_at": row.started_at,
                        "queue_wait_s": row.queue_wait_s}
                    entries.append((*cache[job_id], dict(values, **attempt)))
            self.keep_results(conn, entries, now)  # type: ignore[attr-defined]  # ResultCache, a sibling part of Store
        if copied:
            self.settle_duplicates(conn, copied)  # type: ignore[attr-defined]

    def fail(self, job_id: str, attempt: int, error: str, error_type: str = "generation_error",
             finished_at: float | None = None) -> bool:
        """``finish`` as failed; give ``finished_at`` the same on every retry of one failure (see
        ``finish_many``: a retried write that went through is known by it)."""
        return self.finish(job_id, attempt, {"status": FAILED, "error": error, "error_type": error_type,
                                             "finished_at": time.time() if finished_at is None else finished_at})

    def give_back(self, job_id: str, attempt: int, reason: str, *, forgive: bool = True,
                  at: float | None = None) -> bool:
        """Put a running attempt's job back in the queue at once (drain, a dying engine).

        ``forgive`` keeps the attempt from counting against ``max_attempts``. The caller has
        stopped generating it and publishes a new message right after; False means this
        attempt no longer owns the job (cancelled, reaped, superseded): publish nothing.
        ``at``: the give-back's time, the same on every retry: one whose commit went through
        though its answer was lost is known by it (True), and its message is published.
        """
        now = time.time() if at is None else at
        values: dict[str, Any] = dict(status=QUEUED, heartbeat_at=None, recovered_at=now, published_at=now,
                                      error=f"given back: {reason}", error_type=None)
        if forgive:
            values["attempts_forgiven"] = Job.attempts_forgiven + 1
        with self._write() as conn:
            res = conn.execute(
                update(Job).where(Job.id == job_id, Job.attempts == attempt, Job.status == RUNNING).values(**values)
            )
            if res.rowcount == 1:
                conn.execute(attempt_ended(job_id, attempt, GIVEN_BACK, reason, charged=not forgive, now=now))
                return True
            if at is None:
                return False
            row = conn.execute(select(Job.status, Job.attempts, Job.recovered_at).where(Job.id == job_id)).first()
            return row is not None and tuple(row) == (QUEUED, attempt, at)

