"""The store: jobs and batches in SQL, written idempotently.

Delivery is at least once (``acks_late`` + Redis redelivery), so every write here is safe to
repeat: unique job ids and ``(batch_id, custom_id)``, dialect upserts, and *attempt fencing*:
a worker claims a job by bumping ``attempts`` with a compare-and-swap and every later write
names that attempt, so a stale or duplicate copy can never overwrite a newer result.
Every public method opens its own short transaction, so one ``Store`` is safe to share
across threads (Sessions never are).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Callable, Iterable, Iterator, Sequence, TypeVar

from sqlalchemy import (JSON, Boolean, Connection, Engine, Integer, Select, String, Text, and_, bindparam, case,
                        create_engine, delete, event, func, insert, literal, or_, select, tuple_, update)
from sqlalchemy.engine import make_url
from sqlalchemy.exc import InterfaceError, OperationalError
from sqlalchemy.orm import sessionmaker

from . import json_text, migrate
from worker.common.config import settings
from worker.store.group_commit import GroupCommit
from worker.store.models import (CANCELLED, FAILED, QUEUED, RUNNING, STATUSES, SUCCEEDED, TERMINAL, W_FAILED, W_STARTING,
                     W_STOPPED, Batch, Epoch, Job, JobAttempt, Worker)
from worker.store.models import GIVEN_BACK, LOST, W_EXITED

T = TypeVar("T")
log = logging.getLogger(__name__)

INVALID_INPUT = "invalid_input"  # error_type of a bad input line (never enqueued)


def new_id() -> str:
    """32 hex digits laid out as a UUIDv7: milliseconds since the epoch, then 74 random bits.

    Time-ordered, so a million new jobs are appended at the end of the primary-key index
    instead of landing on random pages (with uuid4 every chunk of rows dirtied about as many
    index pages as it had rows, and ingest slowed as the table grew); still unique and opaque.
    """
    return new_ids(1)[0]


def new_ids(n: int) -> list[str]:
    """``n`` ids as ``new_id`` makes them, from one read of the OS's randomness (a read per id
    was a fifth of building a bulk line's row)."""
    ms = (time.time_ns() // 1_000_000) & (2**48 - 1)
    entropy = os.urandom(10 * n)
    ids = []
    for i in range(0, 10 * n, 10):
        rand = int.from_bytes(entropy[i:i + 10], "big")
        value = ms << 80 | 0x7 << 76 | (rand >> 68 & 0xFFF) << 64 | 0b10 << 62 | (rand & (2**62 - 1))
        ids.append(f"{value:032x}")
    return ids


def normalize_url(url: str) -> str:
    """Use psycopg 3 for plain ``postgresql://`` / ``postgres://`` URLs."""
    if url.startswith("postgres://"):
        url = "postgresql://" + url[len("postgres://") :]
    if url.startswith("postgresql://"):
        url = "postgresql+psycopg://" + url[len("postgresql://") :]
    return url


#: Execution option of the read-only engine view: on SQLite its transactions begin DEFERRED.
READ_ONLY = "specbatch_read_only"
#: Rows per transaction when a batch is written: a large submit never holds SQLite's one write
#: lock for long, so heartbeats and claims interleave with it.
INSERT_CHUNK = 1000


def make_engine(url: str) -> Engine:
    """An engine with SQLite made fit for many writer threads (WAL, busy timeout, and
    ``BEGIN IMMEDIATE`` for writes so a read-then-write never dies on a lock upgrade; reads,
    through the ``READ_ONLY`` view, begin DEFERRED and never wait for the write lock)."""
    url = normalize_url(url)
    if make_url(url).get_backend_name() != "sqlite":
        return create_engine(url, pool_size=4, max_overflow=16, pool_timeout=120, pool_pre_ping=True,
                             json_serializer=json_text.dumps)
    engine = create_engine(url, pool_size=4, max_overflow=16, pool_timeout=120, json_serializer=json_text.dumps)

    @event.listens_for(engine, "connect")
    def _sqlite_pragmas(dbapi_conn, _record) -> None:  # pragma: no cover - trivial
        dbapi_conn.isolation_level = None  # we emit BEGIN ourselves below
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA busy_timeout = 30000")
        cur.execute("PRAGMA foreign_keys = ON")
        if make_url(url).database not in (None, "", ":memory:"):
            cur.execute("PRAGMA journal_mode = WAL")
            cur.execute("PRAGMA synchronous = NORMAL")
        cur.close()

    @event.listens_for(engine, "begin")
    def _sqlite_begin(conn) -> None:  # pragma: no cover - trivial
        read_only = conn.get_execution_options().get(READ_ONLY, False)
        conn.exec_driver_sql("BEGIN DEFERRED" if read_only else "BEGIN IMMEDIATE")

    return engine


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


@dataclass(slots=True)
class PreparedBatch:
    """What writing (part of) a batch did; ``to_enqueue`` holds the rows to run that it wrote."""

    batch_id: str
    to_enqueue: list[dict[str, Any]] = field(default_factory=list)
    skipped_succeeded: int = 0
    skipped_failed: int = 0
    invalid: int = 0


#: What a publisher reads of a job to send its message: the id the message carries, and what
#: routes it (queue, or model and priority), groups it (params: its tokens to generate) and
#: labels it for Flower (batch, custom_id, line). Never the prompt: the claim returns that.
MESSAGE_FIELDS = ("id", "queue", "model", "priority", "params", "batch_id", "custom_id", "line_no")

#: What a won claim returns of its job (``UPDATE … RETURNING``): the worker's request, from
#: the store, never from a message.
CLAIM_FIELDS = ("model", "prompt", "prompt_token_ids_in", "prompt_tokens", "messages", "params", "priority", "custom_id", "queue")


class Store:
    def __init__(self, url: str, *, auto_upgrade: bool | None = None, group_commit: bool = False) -> None:
        """``group_commit``: claims and results of many threads share transactions (a worker)."""
        self.url = normalize_url(url)
        self.engine = make_engine(self.url)
        # SQLite: this process's writers queue on a lock before BEGIN IMMEDIATE (see _write).
        self._write_lock = threading.RLock() if make_url(self.url).get_backend_name() == "sqlite" else None
        self.reader = self.engine.execution_options(**{READ_ONLY: True})  # same pool, no write lock
        self.Session = sessionmaker(self.reader, expire_on_commit=False)
        self.dialect = self.engine.dialect.name
        if auto_upgrade is None:
            auto_upgrade = self.dialect == "sqlite" or settings().auto_migrate
        if auto_upgrade and not migrate.is_current(self.engine):
            self.upgrade()
        self._group = GroupCommit(self._write) if group_commit else None

    # ---- schema ------------------------------------------------------------------------
    @contextmanager
    def _write(self) -> Iterator[Connection]:
        """A write transaction. On SQLite the threads of this process take turns on a lock
        first: SQLite's busy handler sleeps in growing steps (1, 2, 5, 10 … ms) and so wakes late,
        and with dozens of task threads writing results a job's claim waited behind them; a
        lock hands over at once. Other processes (a producer) still meet the busy handler."""
        if self._write_lock is None:
            with self.engine.begin() as conn:
                yield conn
            return
        with self._write_lock, self.engine.begin() as conn:
            yield conn

    def upgrade(self) -> None:
        migrate.upgrade(self.engine)

    def dispose(self) -> None:
        self.engine.dispose()

    def _insert(self, table):
        """The dialect's INSERT, which has ``on_conflict_do_update/nothing``."""
        if self.dialect == "postgresql":
            from sqlalchemy.dialects.postgresql import insert
        elif self.dialect == "sqlite":
            from sqlalchemy.dialects.sqlite import insert
        else:  # pragma: no cover
            raise NotImplementedError(f"upserts are implemented for sqlite and postgresql, not {self.dialect}")
        return insert(table)

    # ---- producer side -----------------------------------------------------------------
    def upsert_jobs(self, rows: Sequence[dict[str, Any]], *, conn=None) -> int:
        """Insert jobs; a row whose id or (batch_id, custom_id) exists is left alone."""
        if not rows:
            return 0
        stmt = self._insert(Job).on_conflict_do_nothing()
        if conn is not None:
            return conn.execute(stmt, list(rows)).rowcount
        with self._write() as c:
            return c.execute(stmt, list(rows)).rowcount

    def open_batch(self, *, name: str | None, input_file: str | None, model: str,
                   params: dict[str, Any] | None = None, priority: int | None = None,
                   max_in_flight: int | None = None) -> tuple[str, bool]:
        """Create (or reopen, by ``name``) a batch, marked as being ingested; returns (id, reopened).

        Reopening drops the batch's stored bad lines (the file is read again, so they come
        back, possibly fixed); its other jobs stay and are matched by custom_id as chunks land.
        """
        now = time.time()
        with self._write() as conn:
            batch_id = None
            if name is not None:
                batch_id = conn.execute(select(Batch.id).where(Batch.name == name)).scalar()
            reopened = batch_id is not None
            if batch_id is None:
                batch_id = new_id()
                conn.execute(
                    self._insert(Batch).values(
                        id=batch_id, name=name, input_file=input_file, model=model, params=params or {},
                        num_total=0, num_queued=0, num_running=0, num_succeeded=0, num_failed=0,
                        num_cancelled=0, created_at=now, priority=priority, max_in_flight=max_in_flight,
                        ingested_at=None,
                    )
                )
            else:
                conn.execute(update(Batch).where(Batch.id == batch_id).values(
                    finished_at=None, ingested_at=None, input_file=input_file, priority=priority,
                    max_in_flight=max_in_flight))
        if reopened:
            while True:  # in chunks: one huge delete would hold SQLite's write lock for long
                with self._write() as conn:
                    ids = conn.execute(select(Job.id).where(Job.batch_id == batch_id, Job.error_type == INVALID_INPUT)
                                       .limit(INSERT_CHUNK)).scalars().all()
                    if not ids:
                        break
                    conn.execute(delete(Job).where(Job.id.in_(ids)))
        return batch_id, reopened

    def write_chunk(
        self,
        batch_id: str,
        rows: Sequence[dict[str, Any]],
        invalid_rows: Sequence[dict[str, Any]] = (),
        *,
        reopened: bool,
        retry_failed: bool = False,
    ) -> PreparedBatch:
        """Write one chunk of a batch's rows in one transaction (so a large file never holds
        SQLite's write lock for long and heartbeats interleave), idempotently by custom_id.

        In a reopened batch a row whose custom_id exists is not written again: what succeeded is
        skipped, failures are kept unless ``retry_failed`` (which gives them fresh attempts),
        and what is still queued goes back to the pacer (a duplicate message is harmless). A
        crash half-way leaves a prefix of the chunks: reopening the batch writes the rest.
        Rows to run are written unpublished (``published_at`` NULL): the pacer (``worker.dispatch.pacer``)
        publishes them a window at a time, round-robin between batches, under ``max_in_flight``.
        Bad input lines are stored as failed jobs so exports have every line.
        """
        now = time.time()
        prepared = PreparedBatch(batch_id=batch_id)
        with self._write() as conn:
            existing: dict[str, Any] = {}
            if reopened and rows:
                cids = [r["custom_id"] for r in rows]
                existing = {r.custom_id: r for r in conn.execute(
                    select(Job.id, Job.custom_id, Job.status).where(Job.batch_id == batch_id, Job.custom_id.in_(cids)))}
            new_rows: list[dict[str, Any]] = []
            requeue_ids: list[str] = []
            for row in rows:
                old = existing.get(row["custom_id"])
                if old is None:
                    r = dict(row, batch_id=batch_id, enqueued_at=now, published_at=None, status=QUEUED)
                    new_rows.append(r)
                    prepared.to_enqueue.append(r)
                elif old.status == SUCCEEDED:
                    prepared.skipped_succeeded += 1
                elif old.status in (FAILED, CANCELLED) and not retry_failed:
                    prepared.skipped_failed += 1
                else:
                    requeue_ids.append(old.id)
                    prepared.to_enqueue.append(dict(row, id=old.id, batch_id=batch_id, enqueued_at=now))
            if new_rows:
                if reopened or not self._copy_jobs(conn, new_rows):
                    self.upsert_jobs(new_rows, conn=conn)
            if requeue_ids:
                # Retried failures go back to queued with fresh attempts (the fence still only
                # grows); queued/running rows keep their status (a running attempt stays fenced).
                conn.execute(
                    update(Job)
                    .where(Job.id.in_(requeue_ids), Job.status.in_((FAILED, CANCELLED)))
                    .values(status=QUEUED, error=None, error_type=None, finish_reason=None, finished_at=None,
                            enqueued_at=now, attempts_forgiven=Job.attempts)
                )
                # Queued ones go back to the pacer (a lost message is re-published that way too);
                # running ones keep their attempt and lease (the reaper has them if they die).
                conn.execute(update(Job).where(Job.id.in_(requeue_ids), Job.status == QUEUED)
                             .values(published_at=None))
            bad = [dict(r, batch_id=batch_id, status=FAILED, error_type=INVALID_INPUT, enqueued_at=now,
                        finished_at=now) for r in invalid_rows]
            if bad:
                if reopened or not self._copy_jobs(conn, bad):
                    self.upsert_jobs(bad, conn=conn)
            prepared.invalid = len(bad)
        return prepared

    def _copy_jobs(self, conn: Connection, rows: Sequence[dict[str, Any]]) -> bool:
        """Write rows of a batch just created (their ids and custom_ids are new) the fast way:
        PostgreSQL's ``COPY``, SQLite's ``executemany`` of one plain INSERT on the driver's own
        connection (SQLAlchemy's per-row parameter processing was half the writer thread's
        time in a million-line ingest). Values go through each column's own bind processor, as
        SQLAlchemy would send them; JSON ``None`` is SQL NULL, as with ``COPY``. Both run in a
        savepoint of the chunk's transaction; False when a row already exists (then the caller
        upserts, which skips it) or on another dialect."""
        if self.dialect not in ("postgresql", "sqlite"):
            return False
        cols = list(rows[0])
        table = Job.__table__
        procs = [json_text.dumps if isinstance(table.c[c].type, JSON) else table.c[c].type.bind_processor(conn.dialect)
                 for c in cols]  # JSON as its text, as SQLAlchemy would send it
        quote = conn.dialect.identifier_preparer.quote
        raw = conn.connection.driver_connection
        names = ", ".join(quote(c) for c in cols)

        def values(row: dict[str, Any]) -> list[Any]:
            return [v if p is None or v is None else p(v) for p, v in zip(procs, map(row.get, cols))]

        if self.dialect == "sqlite":
            import sqlite3

            sql = f"INSERT INTO {quote(table.name)} ({names}) VALUES ({', '.join('?' * len(cols))})"
            try:
                with conn.begin_nested():
                    raw.executemany(sql, map(values, rows))
            except sqlite3.IntegrityError:
                return False
            return True
        from psycopg import errors

        sql = f"COPY {quote(table.name)} ({names}) FROM STDIN"
        try:
            with conn.begin_nested(), raw.cursor() as cur, cur.copy(sql) as copy:  # a savepoint in the chunk's transaction
                for row in rows:
                    copy.write_row(values(row))
        except errors.UniqueViolation:
            return False
        return True

    def finish_ingest(self, batch_id: str) -> dict[str, int]:
        """Mark the batch's input as fully written (it may finish now) and store its counts."""
        with self._write() as conn:
            conn.execute(update(Batch).where(Batch.id == batch_id).values(ingested_at=time.time()))
        return self.refresh_batch(batch_id)

    def custom_id_line(self, batch_id: str, custom_id: str) -> int | None:
        """The line of the batch's job with this custom_id (None: no such job)."""
        with self.reader.connect() as conn:
            return conn.execute(select(Job.line_no).where(Job.batch_id == batch_id, Job.custom_id == custom_id)
                                ).scalar()

    # ---- worker side -------------------------------------------------------------------
    def claim(self, job_id: str, *, worker: str, device: str, lease_s: float, max_attempts: int,
              queue: str | None = None) -> Claim:
        """Start a new attempt of ``job_id`` and return its request with it, or say why not
        (done, live elsewhere, no such job, …).

        Compare-and-swap on (status, attempts): of two copies racing, exactly one wins.
        ``queue``: the queue the job's message came from, recorded for its next message.
        """
        return self._write_op(lambda conn: self._claim(conn, job_id, worker=worker, device=device, lease_s=lease_s,
                                                       max_attempts=max_attempts, queue=queue))

    def claim_many(self, job_ids: Sequence[str], *, worker: str, device: str, lease_s: float, max_attempts: int,
                   queue: str | None = None) -> list[Claim | Exception]:
        """``claim`` of each job id in one write (a group message's jobs). A claim that raises
        is retried alone and its error returned in its place, so it fails only its own job; an
        unreachable database raises, as ``claim``."""
        def claim_all(conn: Connection) -> list[Claim]:
            return [self._claim(conn, job_id, worker=worker, device=device, lease_s=lease_s,
                                max_attempts=max_attempts, queue=queue)
                    for job_id in job_ids]

        try:
            return list(self._write_op(claim_all))
        except (OperationalError, InterfaceError):
            raise
        except Exception:
            if len(job_ids) == 1:
                raise
        out: list[Claim | Exception] = []
        for job_id in job_ids:
            try:
                out.append(self.claim(job_id, worker=worker, device=device, lease_s=lease_s,
                                      max_attempts=max_attempts, queue=queue))
            except (OperationalError, InterfaceError):
                raise
            except Exception as exc:
                out.append(exc)
        return out

    def _claim(self, conn: Connection, job_id: str, *, worker: str, device: str, lease_s: float, max_attempts: int,
               queue: str | None) -> Claim:
        for _ in range(5):
            now = time.time()
            row = conn.execute(_CLAIM_READ, {"p_job_id": job_id}).first()
            if row is None:
                # The store is the only truth: a message never makes a job (its row may be gone
                # with a database restored from an older backup; nothing says it should run).
                log.warning("job %s: no such job in the store; its message is dropped", job_id)
                return Claim(None, "unknown job")
            status, attempts, heartbeat, forgiven, enqueued_at, last_worker, last_device, last_started = row
            if status in TERMINAL:
                return Claim(None, f"already {status}")
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
                "p_worker": worker, "p_device": device, "p_now": now, "p_queue": queue,
            }).mappings().first()
            if job is not None:
                if status == RUNNING:  # taken over from an attempt whose lease expired: it was lost
                    conn.execute(insert(JobAttempt).values(
                        job_id=job_id, attempt=attempts, worker=last_worker, device=last_device,
                        started_at=last_started, ended_at=now, outcome=LOST, charged=True,
                        cause=f"lease expired: taken over by {worker}"))
                return Claim(attempts + 1, enqueued_at=enqueued_at, started_at=now, job=dict(job))
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

    def finish_many(self, results: Sequence[tuple[str, int, dict[str, Any]]]) -> list[bool]:
        """``finish`` of each (job id, attempt, values) in one write; True where it was stored."""
        def write(conn: Connection) -> list[bool]:
            stored = []
            for job_id, attempt, values in results:
                params = {f"v_{k}": v for k, v in values.items()}
                res = conn.execute(_finish_statement(tuple(values)), dict(params, p_job_id=job_id, p_attempt=attempt))
                stored.append(res.rowcount == 1)
            return stored

        return self._write_op(write) if results else []

    def _write_op(self, write: Callable[[Connection], T]) -> T:
        """``write(conn)`` in a write transaction: shared with other threads' writes when this
        store group-commits (a worker's claims and results: ``worker.store.group_commit``)."""
        if self._group is not None:
            return self._group.run(write)
        with self._write() as conn:
            return write(conn)

    def fail(self, job_id: str, attempt: int, error: str, error_type: str = "generation_error") -> bool:
        return self.finish(
            job_id, attempt, {"status": FAILED, "error": error, "error_type": error_type, "finished_at": time.time()}
        )

    def give_back(self, job_id: str, attempt: int, reason: str, *, forgive: bool = True) -> bool:
        """Put a running attempt's job back in the queue at once (drain, a dying engine).

        ``forgive`` keeps the attempt from counting against ``max_attempts``. The caller has
        stopped generating it and publishes a new message right after; False means this
        attempt no longer owns the job (cancelled, reaped, superseded): publish nothing.
        """
        now = time.time()
        values: dict[str, Any] = dict(status=QUEUED, heartbeat_at=None, recovered_at=now, published_at=now,
                                      error=f"given back: {reason}", error_type=None)
        if forgive:
            values["attempts_forgiven"] = Job.attempts_forgiven + 1
        with self._write() as conn:
            res = conn.execute(
                update(Job).where(Job.id == job_id, Job.attempts == attempt, Job.status == RUNNING).values(**values)
            )
            if res.rowcount == 1:
                conn.execute(_attempt_ended(job_id, attempt, GIVEN_BACK, reason, charged=not forgive, now=now))
            return res.rowcount == 1

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
                    conn.execute(_attempt_ended(row["id"], row["attempts"], LOST, lost, charged=True, now=now))
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
                ).limit(limit)
            ).all()
        return [(r.id, r.queue) for r in rows]

    def message_rows(self, job_ids: Sequence[str]) -> list[dict[str, Any]]:
        """What publishing these jobs again needs of them (``MESSAGE_FIELDS``)."""
        cols = [getattr(Job, f) for f in MESSAGE_FIELDS]
        out: list[dict[str, Any]] = []
        with self.reader.connect() as conn:
            for chunk in _chunks(list(job_ids), 500):
                out += [dict(r) for r in conn.execute(select(*cols).where(Job.id.in_(chunk))).mappings()]
        return out

    def mark_published(self, job_ids: Sequence[str], *, recovered: bool = False) -> None:
        now = time.time()
        values: dict[str, Any] = {"published_at": now}
        if recovered:
            values["recovered_at"] = now
        for chunk in _chunks(list(job_ids), 500):
            with self._write() as conn:
                conn.execute(update(Job).where(Job.id.in_(chunk), Job.status == QUEUED).values(**values))

    # ---- pacing (worker.dispatch.pacer) -----------------------------------------------------------
    def open_batches(self) -> list[tuple[str, int | None]]:
        """(id, max_in_flight) of batches not finished, oldest first: the pacer's round-robin."""
        with self.reader.connect() as conn:
            rows = conn.execute(
                select(Batch.id, Batch.max_in_flight).where(Batch.finished_at.is_(None)).order_by(Batch.created_at)
            ).all()
        return [(r.id, r.max_in_flight) for r in rows]

    def in_flight(self, batch_id: str) -> int:
        """Jobs of the batch published and not yet final (waiting in Redis, reserved or running)."""
        with self.reader.connect() as conn:
            return conn.execute(
                select(func.count()).select_from(Job).where(
                    Job.batch_id == batch_id,
                    or_(Job.status == RUNNING, and_(Job.status == QUEUED, Job.published_at.is_not(None))),
                )
            ).scalar_one()

    def take_unpublished(self, batch_id: str, queue: str, limit: int) -> list[dict[str, Any]]:
        """Mark the batch's next ``limit`` unpublished queued jobs of ``queue`` (in line order)
        published, and return them as their messages need them (``MESSAGE_FIELDS``). Empty when none are left."""
        with self.reader.connect() as conn:
            rows = conn.execute(unpublished_select(batch_id, queue, limit)).mappings().all()
        if rows:
            with self._write() as conn:
                conn.execute(update(Job).where(Job.id.in_([r["id"] for r in rows]), Job.published_at.is_(None))
                             .values(published_at=time.time()))
        return [dict(r) for r in rows]

    def has_unpublished(self, batch_id: str) -> bool:
        with self.reader.connect() as conn:
            return conn.execute(
                select(Job.id).where(Job.batch_id == batch_id, UNPUBLISHED).limit(1)
            ).first() is not None

    # ---- workers -----------------------------------------------------------------------
    def worker_starting(self, name: str, **info: Any) -> None:
        """Record a worker process starting (a restart of the same name counts up ``starts``)."""
        now = time.time()
        with self._write() as conn:
            found = conn.execute(select(Worker.name).where(Worker.name == name)).first()
            values = dict(info, state=W_STARTING, error=None, started_at=now, heartbeat_at=now, stopped_at=None,
                          exit_code=None)
            if found is None:
                conn.execute(self._insert(Worker).values(name=name, starts=1, failures=0, **values))
            else:
                conn.execute(update(Worker).where(Worker.name == name).values(starts=Worker.starts + 1, **values))

    def worker_state(self, name: str, state: str, error: str | None = None) -> None:
        now = time.time()
        values: dict[str, Any] = dict(state=state, heartbeat_at=now)
        if error is not None:
            values["error"] = error
        if state in (W_STOPPED, W_FAILED):
            values["stopped_at"] = now
        if state == W_FAILED:
            values["failures"] = Worker.failures + 1
        with self._write() as conn:
            conn.execute(update(Worker).where(Worker.name == name).values(**values))

    def worker_exited(self, name: str, code: int, error: str | None = None) -> None:
        """The process is leaving with ``code``: ``status`` shows ``exited N`` from now on. A
        non-zero exit counts as a failure unless the state already said ``failed``."""
        now = time.time()
        values: dict[str, Any] = dict(state=W_EXITED, exit_code=code, heartbeat_at=now, stopped_at=now)
        if error is not None:
            values["error"] = error
        if code != 0:
            values["failures"] = Worker.failures + case((Worker.state == W_FAILED, 0), else_=1)
        with self._write() as conn:
            conn.execute(update(Worker).where(Worker.name == name).values(**values))

    def worker_beat(self, name: str) -> None:
        with self._write() as conn:
            conn.execute(update(Worker).where(Worker.name == name).values(heartbeat_at=time.time()))

    def workers(self) -> list[Worker]:
        with self.Session() as s:
            return list(s.scalars(select(Worker).order_by(Worker.name)))

    def running_counts_by_worker(self) -> dict[str, int]:
        with self.reader.connect() as conn:
            rows = conn.execute(select(Job.worker, func.count()).where(Job.status == RUNNING).group_by(Job.worker))
            return {w: n for w, n in rows if w}

    # ---- control -----------------------------------------------------------------------
    def cancel(self, *, job_ids: Iterable[str] = (), batch_id: str | None = None) -> tuple[list[str], list[str]]:
        """Mark unfinished jobs cancelled; returns (cancelled ids, ids that were running)."""
        now = time.time()
        cond = [Job.status.in_((QUEUED, RUNNING))]
        job_ids = list(job_ids)
        if batch_id is not None:
            cond.append(Job.batch_id == batch_id)
        else:
            cond.append(Job.id.in_(job_ids))
        with self._write() as conn:
            rows = conn.execute(select(Job.id, Job.status).where(*cond)).all()
            ids = [r.id for r in rows]
            for chunk in _chunks(ids, 500):
                conn.execute(
                    update(Job).where(Job.id.in_(chunk), Job.status.in_((QUEUED, RUNNING)))
                    .values(status=CANCELLED, finished_at=now, finish_reason="abort",
                            error="cancelled", error_type="cancelled")
                )
        if batch_id is not None:
            self.refresh_batch(batch_id)
        return ids, [r.id for r in rows if r.status == RUNNING]

    # ---- reads -------------------------------------------------------------------------
    def attempt_history(self, job_id: str) -> list[JobAttempt]:
        """The job's attempts that ended without ending it, oldest first (see ``JobAttempt``)."""
        with self.Session() as s:
            return list(s.scalars(select(JobAttempt).where(JobAttempt.job_id == job_id)
                                  .order_by(JobAttempt.attempt)))

    def get_job(self, job_id: str) -> Job | None:
        with self.Session() as s:
            return s.get(Job, job_id)

    def jobs(self, batch_id: str, *, statuses: Sequence[str] | None = None,
             finished_after: float | None = None) -> list[Job]:
        """A batch's jobs in input-line order."""
        q = select(Job).where(Job.batch_id == batch_id)
        if statuses:
            q = q.where(Job.status.in_(statuses))
        if finished_after is not None:
            q = q.where(Job.finished_at > finished_after)
        with self.Session() as s:
            return list(s.scalars(q.order_by(Job.line_no, Job.custom_id)))

    def iter_jobs(self, batch_id: str, *, statuses: Sequence[str] | None = None,
                  page: int = 1000) -> Iterator[Job]:
        """A batch's jobs in input-line order, ``page`` rows per query (keyset on (line, id)),
        so a million-line export holds one page, not the batch."""
        after: tuple[int, str] | None = None
        while True:
            q = select(Job).where(Job.batch_id == batch_id)
            if statuses:
                q = q.where(Job.status.in_(statuses))
            if after is not None:
                q = q.where(tuple_(Job.line_no, Job.id) > tuple_(*after))
            with self.Session() as s:
                rows = list(s.scalars(q.order_by(Job.line_no, Job.id).limit(page)))
            yield from rows
            if len(rows) < page:
                return
            after = (rows[-1].line_no, rows[-1].id)

    def finished_prefix(self, batch_id: str, after: tuple[int, str] | None, limit: int = 1000) -> list[Job]:
        """The batch's jobs after ``after`` = (line, id) in input order, up to (not including)
        the first one not finished: what an ordered output file can take next. Reads keys
        first and whole rows only for that run, so a poll that finds nothing new is cheap."""
        cond = [Job.batch_id == batch_id]
        if after is not None:
            cond.append(tuple_(Job.line_no, Job.id) > tuple_(*after))
        with self.reader.connect() as conn:
            keys = conn.execute(select(Job.line_no, Job.id, Job.status).where(*cond)
                                .order_by(Job.line_no, Job.id).limit(limit)).all()
        run = []
        for line_no, job_id, status in keys:
            if status not in TERMINAL:
                break
            run.append(job_id)
        if not run:
            return []
        last = keys[len(run) - 1]
        with self.Session() as s:
            rows = list(s.scalars(select(Job).where(*cond, tuple_(Job.line_no, Job.id) <= tuple_(last[0], last[1]))
                                  .order_by(Job.line_no, Job.id)))
        out = []
        for job_id, row in zip(run, rows):  # a row retried in between ends the run there
            if row.id != job_id or row.status not in TERMINAL:
                break
            out.append(row)
        return out

    def get_batch(self, name_or_id: str) -> Batch | None:
        with self.Session() as s:
            b = s.get(Batch, name_or_id)
            return b or s.scalars(select(Batch).where(Batch.name == name_or_id)).first()

    def batches(self, limit: int = 20) -> list[Batch]:
        with self.Session() as s:
            return list(s.scalars(select(Batch).order_by(Batch.created_at.desc()).limit(limit)))

    def single_jobs(self, limit: int = 10) -> list[dict[str, Any]]:
        """The newest jobs submitted alone (no batch): id, status, model, custom_id, enqueued_at."""
        with self.reader.connect() as conn:
            return [dict(r) for r in conn.execute(
                select(Job.id, Job.status, Job.model, Job.custom_id, Job.enqueued_at, Job.finished_at)
                .where(Job.batch_id.is_(None)).order_by(Job.enqueued_at.desc()).limit(limit)).mappings()]

    def batch_counts(self, batch_id: str) -> dict[str, int]:
        with self.reader.connect() as conn:
            rows = conn.execute(
                select(Job.status, func.count()).where(Job.batch_id == batch_id).group_by(Job.status)
            ).all()
        counts = dict.fromkeys(STATUSES, 0)
        counts.update({s: n for s, n in rows})
        return counts

    def batch_progress(self, batch_id: str) -> dict[str, float]:
        """Counts plus output tokens and the generation window, for a live progress bar."""
        counts = self.batch_counts(batch_id)
        with self.reader.connect() as conn:
            tokens, first, last = conn.execute(
                select(func.coalesce(func.sum(Job.num_output_tokens), 0), func.min(Job.started_at),
                       func.max(Job.finished_at))
                .where(Job.batch_id == batch_id, Job.status == SUCCEEDED)
            ).one()
        return {**counts, "output_tokens": tokens or 0, "first_started": first, "last_finished": last}

    # ---- monitoring (worker.api.status_view, worker.api.report): aggregates, never whole rows ------
    def counts_by_batch(self, batch_ids: Sequence[str]) -> dict[str, dict[str, int]]:
        """``{batch id: {status: n}}`` for many batches in one grouped query."""
        out = {b: dict.fromkeys(STATUSES, 0) for b in batch_ids}
        if not out:
            return out
        with self.reader.connect() as conn:
            rows = conn.execute(select(Job.batch_id, Job.status, func.count()).where(Job.batch_id.in_(list(out)))
                                .group_by(Job.batch_id, Job.status))
            for batch_id, status, n in rows:
                out[batch_id][status] = n
        return out

    def failures_by_cause(self, batch_ids: Sequence[str]) -> dict[str, dict[str, int]]:
        """``{batch id: {error_type: n}}`` of failed jobs (``unknown`` where no type was recorded)."""
        out: dict[str, dict[str, int]] = {b: {} for b in batch_ids}
        if not out:
            return out
        with self.reader.connect() as conn:
            rows = conn.execute(
                select(Job.batch_id, Job.error_type, func.count())
                .where(Job.batch_id.in_(list(out)), Job.status == FAILED)
                .group_by(Job.batch_id, Job.error_type)
            )
            for batch_id, cause, n in rows:
                key = cause or "unknown"
                out[batch_id][key] = out[batch_id].get(key, 0) + n
        return out

    def finished_stats(self, batch_ids: Sequence[str], since: float) -> dict[str, dict[str, float | None]]:
        """Per batch, over jobs that ran (were claimed) and ended: how many and their output
        tokens in all and since ``since``, and the first start and last finish.

        Throughput over a recent window comes from here without reading rows: one grouped
        aggregate over the batch's index.
        """
        out: dict[str, dict[str, float | None]] = {}
        if not batch_ids:
            return out
        recent = Job.finished_at >= since
        tokens = func.coalesce(Job.num_output_tokens, 0)
        with self.reader.connect() as conn:
            rows = conn.execute(
                select(
                    Job.batch_id, func.count(), func.coalesce(func.sum(tokens), 0),
                    func.coalesce(func.sum(case((recent, 1), else_=0)), 0),
                    func.coalesce(func.sum(case((recent, tokens), else_=0)), 0),
                    func.min(Job.started_at), func.max(Job.finished_at),
                )
                .where(Job.batch_id.in_(list(batch_ids)), Job.status.in_(TERMINAL), Job.started_at.is_not(None))
                .group_by(Job.batch_id)
            )
            for batch_id, jobs, toks, recent_jobs, recent_toks, first, last in rows:
                out[batch_id] = {"jobs": jobs, "output_tokens": toks, "recent_jobs": recent_jobs,
                                 "recent_output_tokens": recent_toks, "first_started": first, "last_finished": last}
        return out

    def recent_latencies(self, batch_id: str, since: float, limit: int = 10_000) -> list[tuple[float | None, float | None]]:
        """(TTFT, TPOT) of the batch's jobs that succeeded since ``since`` (at most ``limit``)."""
        with self.reader.connect() as conn:
            return [tuple(r) for r in conn.execute(
                select(Job.ttft_s, Job.tpot_s)
                .where(Job.batch_id == batch_id, Job.status == SUCCEEDED, Job.finished_at >= since).limit(limit)
            )]

    def iter_job_columns(self, batch_id: str, columns: Sequence[str], chunk: int = 50_000) -> Iterator[list[tuple]]:
        """The batch's jobs as tuples of only ``columns``, ``chunk`` rows at a time (server-side
        cursor where the driver has one): a report on a million jobs never reads a prompt."""
        cols = [getattr(Job, c) for c in columns]
        with self.reader.connect() as conn:
            result = conn.execution_options(stream_results=True, yield_per=chunk).execute(
                select(*cols).where(Job.batch_id == batch_id))
            for part in result.partitions(chunk):
                yield [tuple(r) for r in part]

    def slowest_jobs(self, batch_id: str, limit: int = 20) -> list[dict[str, Any]]:
        """The batch's succeeded jobs with the longest run (claim to result), longest first."""
        latency = (Job.finished_at - Job.started_at).label("latency_s")
        q = (select(Job.id, Job.custom_id, Job.line_no, Job.status, latency, Job.queue_wait_s, Job.ttft_s, Job.tpot_s,
                    Job.num_prompt_tokens, Job.num_output_tokens, Job.worker)
             .where(Job.batch_id == batch_id, Job.status == SUCCEEDED, Job.started_at.is_not(None),
                    Job.finished_at.is_not(None))
             .order_by(latency.desc(), Job.id).limit(limit))
        with self.reader.connect() as conn:
            return [dict(r) for r in conn.execute(q).mappings()]

    def failed_jobs(self, batch_id: str, limit: int = 100) -> list[dict[str, Any]]:
        """The batch's failed jobs in input order (at most ``limit``): what the failure said."""
        latency = (Job.finished_at - Job.started_at).label("latency_s")
        q = (select(Job.id, Job.custom_id, Job.line_no, Job.status, Job.error_type, Job.error, latency,
                    Job.num_output_tokens, Job.worker)
             .where(Job.batch_id == batch_id, Job.status == FAILED)
             .order_by(Job.line_no, Job.id).limit(limit))
        with self.reader.connect() as conn:
            return [dict(r) for r in conn.execute(q).mappings()]

    def refresh_batch(self, batch_id: str) -> dict[str, int]:
        """Store the batch's counts by status (and finished_at once nothing is left)."""
        counts = self.batch_counts(batch_id)
        values: dict[str, Any] = {f"num_{s}": n for s, n in counts.items()}
        values["num_total"] = sum(counts.values())
        with self._write() as conn:
            if counts[QUEUED] == 0 and counts[RUNNING] == 0:
                # Not while its input is still being written: more jobs are on their way.
                values["finished_at"] = case((Batch.ingested_at.is_(None), None),
                                             else_=func.coalesce(Batch.finished_at, time.time()))
            conn.execute(update(Batch).where(Batch.id == batch_id).values(**values))
        return counts

    def batch_done(self, batch_id: str) -> tuple[dict[str, int], bool]:
        """(counts by status, done): done once its input is all written and nothing is left
        queued or running. A poll reads counts, never rows."""
        with self.reader.connect() as conn:
            ingested = conn.execute(select(Batch.ingested_at).where(Batch.id == batch_id)).scalar()
        counts = self.batch_counts(batch_id)
        return counts, ingested is not None and counts[QUEUED] == 0 and counts[RUNNING] == 0


# A worker's per-job statements, built once: building a Core statement and its cache key cost
# more of a one-token job's worker CPU than executing it (py-spy: about half of the group
# commit's time went to ``update(...).values(...)`` and ``_generate_cache_key``).
_CLAIM_READ = (select(Job.status, Job.attempts, Job.heartbeat_at, Job.attempts_forgiven, Job.enqueued_at,
                      Job.worker, Job.device, Job.started_at)
               .where(Job.id == bindparam("p_job_id")))


def _attempt_ended(job_id: str, attempt: int, outcome: str, cause: str | None, *, charged: bool, now: float):
    """Insert the ``JobAttempt`` of an attempt that ends without ending its job, its worker,
    device and start read from the job row (run it in the transaction that moves the job on,
    before a new claim overwrites them)."""
    return insert(JobAttempt).from_select(
        ["job_id", "attempt", "worker", "device", "started_at", "ended_at", "outcome", "cause", "charged"],
        select(Job.id, literal(attempt, Integer), Job.worker, Job.device, Job.started_at, literal(now, Epoch),
               literal(outcome, String), literal((cause or "")[:2000] or None, Text),
               literal(charged, Boolean)).where(Job.id == job_id))
_NOW = bindparam("p_now", type_=Job.__table__.c.started_at.type)
_CLAIM_WRITE = (  # bound names are not column names: SET's own parameters take those
    update(Job)
    .where(Job.id == bindparam("p_job_id"), Job.attempts == bindparam("p_attempts"),
           Job.status == bindparam("p_status"))
    .values(status=RUNNING, attempts=bindparam("p_next_attempt"), worker=bindparam("p_worker"),
            device=bindparam("p_device"), started_at=_NOW, heartbeat_at=_NOW, error=None, error_type=None,
            queue_wait_s=_NOW - Job.enqueued_at,
            queue=func.coalesce(bindparam("p_queue", type_=Job.__table__.c.queue.type), Job.queue))
    .returning(*[getattr(Job, f) for f in CLAIM_FIELDS])  # the request rides the claim: no second read
)


@lru_cache(maxsize=64)
def _finish_statement(columns: tuple[str, ...]):
    """The fenced result UPDATE for one set of result columns (bound as ``v_<column>``)."""
    table = Job.__table__
    return (update(Job)
            .where(Job.id == bindparam("p_job_id"), Job.attempts == bindparam("p_attempt"), Job.status == RUNNING)
            .values({c: bindparam(f"v_{c}", type_=table.c[c].type) for c in columns}))


#: A queued job not yet published, with 'queued' written into the SQL, not bound: PostgreSQL
#: matches its partial index's predicate only to constants, and a statement psycopg has
#: prepared (its fifth run on) gets a generic plan that knows no parameter's value (with a
#: bound one, the pacer's queries fell back to scanning the batch: tiny jobs 0.87x -> 0.64x).
UNPUBLISHED = and_(Job.status == literal(QUEUED, literal_execute=True), Job.published_at.is_(None))


def unpublished_select(batch_id: str, queue: str, limit: int) -> Select:
    """The batch's next ``limit`` unpublished queued jobs of ``queue``, in line order, as their
    messages need them (``MESSAGE_FIELDS``): an ordered index range on either database (migration 0005)."""
    cols = [getattr(Job, f) for f in MESSAGE_FIELDS]
    return select(*cols).where(Job.batch_id == batch_id, UNPUBLISHED, Job.queue == queue).order_by(Job.line_no).limit(limit)


def job_row(
    *,
    model: str,
    id: str | None = None,
    prompt: str | None = None,
    prompt_token_ids_in: list[int] | None = None,
    prompt_tokens: list[int] | None = None,
    messages: list[dict[str, Any]] | None = None,
    params: dict[str, Any] | None = None,
    endpoint: str | None = None,
    batch_id: str | None = None,
    custom_id: str | None = None,
    line_no: int | None = None,
    status: str = QUEUED,
    enqueued_at: float | None = None,
    error: str | None = None,
    error_type: str | None = None,
    finished_at: float | None = None,
    queue: str | None = None,
    priority: int | None = None,
    user: str | None = None,
) -> dict[str, Any]:
    """A complete ``jobs`` row as a dict (every row of a bulk insert has the same keys)."""
    return {
        "id": id or new_id(),
        "batch_id": batch_id,
        "custom_id": custom_id,
        "line_no": line_no,
        "model": model,
        "endpoint": endpoint or ("chat" if messages is not None else "completions"),
        "prompt": prompt,
        "prompt_token_ids_in": prompt_token_ids_in,
        "prompt_tokens": prompt_tokens,
        "messages": messages,
        "params": params or {},
        "status": status,
        "attempts": 0,
        "attempts_forgiven": 0,
        "queue": queue,
        "priority": priority,
        "user": user,
        "enqueued_at": enqueued_at if enqueued_at is not None else time.time(),
        "published_at": enqueued_at if enqueued_at is not None else time.time(),
        "error": error,
        "error_type": error_type,
        "finished_at": finished_at,
    }


def _chunks(items: Sequence[Any], n: int) -> Iterable[Sequence[Any]]:
    for i in range(0, len(items), n):
        yield items[i : i + n]
