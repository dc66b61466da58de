"""Writing a batch: jobs inserted idempotently by id and custom_id, chunk by chunk (COPY on
PostgreSQL), bad lines kept as failed rows, a batch reopened and resumed."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Sequence

from sqlalchemy import JSON, Connection, delete, select, update

from worker.store import json_text
from worker.store.connection import StoreBase
from worker.store.models import CANCELLED, FAILED, QUEUED, SUCCEEDED, Batch, Job
from worker.store.rows import INSERT_CHUNK, INVALID_INPUT, new_id


@dataclass(slots=True)
class PreparedBatch:
    """What writing (part of) a batch did; ``to_enqueue`` holds the rows to run that it wrote."""

    batch_id: str
    to_enqueue: list[dict[str, Any]] = field(default_factory=list)
    skipped_succeeded: int = 0
    skipped_failed: int = 0
    invalid: int = 0
    cached: int = 0  # answered from the result cache: written succeeded
    duplicates: int = 0  # held for an earlier row of the batch that asks the same


@dataclass(slots=True)
class Once:
    """What bulk once decided of a chunk's new rows (``worker.ingest.stream``): by job id, the
    cache entry that answers it, or the earlier row of the batch it duplicates; ``misses``:
    keyed rows that will run."""

    hits: dict[str, Any] = field(default_factory=dict)
    duplicate_of: dict[str, str] = field(default_factory=dict)
    misses: int = 0


def _same_keys(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows of one bulk insert need the same columns: a cache hit's or a duplicate's extra
    ones are given (as NULL) to the rest."""
    keys: dict[str, None] = {}
    for r in rows:
        keys.update(dict.fromkeys(r))
    if all(len(r) == len(keys) for r in rows):
        return rows
    return [r if len(r) == len(keys) else {k: r.get(k) for k in keys} for r in rows]


class IngestWrites(StoreBase):
    """Writing batches of jobs (the producer's side)."""

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
        once: Once | None = None,
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
        ``once``: new rows answered from the result cache are written succeeded, and new
        duplicates of an earlier row are written queued but never published (that row's end
        settles them: ``worker.store.results_cache``); both are counted in the same transaction.
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
            # A reopened batch's row that exists keeps its stored id: a duplicate of it names that.
            stored_as = {row["id"]: existing[row["custom_id"]].id for row in rows if row["custom_id"] in existing}
            used: list[str] = []  # the cache entries that answered rows written now
            for row in rows:
                old = existing.get(row["custom_id"])
                if old is None:
                    r = dict(row, batch_id=batch_id, enqueued_at=now, published_at=None, status=QUEUED)
                    hit = once.hits.get(r["id"]) if once is not None else None
                    first = once.duplicate_of.get(r["id"]) if once is not None else None
                    first = stored_as.get(first, first)
                    if hit is not None:
                        r.update(self.hit_values(hit, now))  # type: ignore[attr-defined]  # ResultCache
                        used.append(hit.key)
                        prepared.cached += 1
                    elif first is not None:
                        r.update(duplicate_of=first, published_at=now)  # held: never the pacer's
                        prepared.duplicates += 1
                    else:
                        prepared.to_enqueue.append(r)
                    new_rows.append(r)
                elif old.status == SUCCEEDED:
                    prepared.skipped_succeeded += 1
                elif old.status in (FAILED, CANCELLED) and not retry_failed:
                    prepared.skipped_failed += 1
                else:
                    requeue_ids.append(old.id)
                    prepared.to_enqueue.append(dict(row, id=old.id, batch_id=batch_id, enqueued_at=now))
            if new_rows:
                new_rows = _same_keys(new_rows)
                if reopened or not self._copy_jobs(conn, new_rows):
                    self.upsert_jobs(new_rows, conn=conn)
            if once is not None:
                firsts = sorted({f for r in new_rows if (f := r.get("duplicate_of")) is not None})
                if firsts:
                    self.mark_has_duplicates(conn, firsts)  # type: ignore[attr-defined]
                self.note_cache_use(conn, used, misses=once.misses,  # type: ignore[attr-defined]
                                    duplicates=prepared.duplicates, now=now)
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
                conn.execute(update(Job).where(Job.id.in_(requeue_ids), Job.status == QUEUED,
                                               Job.duplicate_of.is_(None))  # a duplicate waits for its row
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

