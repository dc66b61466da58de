"""The exact result cache and duplicates computed once: the store's side (issue "bulk once").

A greedy or seeded request's result is a pure function of the model and the request
(``worker.request.cache_key``), so it is kept by that key when a worker stores it and answered
from here at ingest the next time anyone asks: the job is written as succeeded, marked
``cached``, with the computing run's timings kept apart, and never reaches Redis or an engine.
Rows of one batch that ask the same thing are computed once: the first is the one that runs;
the others (``duplicate_of``) are never published and are settled in the same transaction as
the row they copy, whatever way it ends (a result, a failure, a cancel). A sweep settles any
copy whose row ended without settling it (``settle_stray_duplicates``), so none waits forever.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Iterable, Mapping, Sequence

from sqlalchemy import Connection, and_, delete, exists, func, select, update
from sqlalchemy.orm import aliased

from worker.store.connection import StoreBase
from worker.store.models import QUEUED, SUCCEEDED, TERMINAL, CacheCounter, CachedResult, Job, ModelDigest
from worker.store.rows import chunks
from worker.store import json_text

#: A job's result columns, as a cache entry keeps them and a hit writes them back.
RESULT_COLUMNS = ("output_text", "output_token_ids", "outputs", "finish_reason", "num_prompt_tokens",
                  "num_cached_tokens", "num_output_tokens")
#: The computing run's timings and figures, kept apart on a hit (``jobs.cached_timings``).
TIMING_COLUMNS = ("id", "worker", "device", "started_at", "first_scheduled_at", "first_token_at", "finished_at",
                  "queue_wait_s", "ttft_s", "tpot_s", "tokens_per_s", "num_draft_tokens", "num_accepted_tokens",
                  "num_preemptions", "num_steps", "max_batch_size", "num_waiting_steps")
#: What a duplicate copies of the row that ran: its outcome and everything it measured.
SETTLED_COLUMNS = ("status", "error", "error_type", *RESULT_COLUMNS, *TIMING_COLUMNS[3:])
#: Only these endings are worth keeping: an aborted or failed run says nothing of the request.
CACHEABLE_ENDINGS = ("stop", "length")
HITS, MISSES, DUPLICATES = "hits", "misses", "duplicates"

log = logging.getLogger(__name__)


class ResultCache(StoreBase):
    """The result cache, model digests and duplicate settling."""

    # -- model identity ------------------------------------------------------------------
    def model_digest(self, path: str) -> str:
        """The digest of the model at ``path`` (``engine.model_digest``), computed once per
        version of its files and remembered here, so neither a producer nor a worker start
        hashes a model it has seen before."""
        from engine.model_digest import files_signature, weights_digest

        signature = files_signature(path)
        with self.reader.connect() as conn:
            row = conn.execute(select(ModelDigest.signature, ModelDigest.digest).where(ModelDigest.path == path)).first()
        if row is not None and row.signature == signature:
            return row.digest
        t0 = time.perf_counter()
        digest = weights_digest(path, signature)
        seconds = time.perf_counter() - t0
        values = dict(signature=signature, digest=digest, computed_at=time.time(), seconds=seconds)
        with self._write() as conn:
            stmt = self._insert(ModelDigest).values(path=path, **values)
            conn.execute(stmt.on_conflict_do_update(index_elements=["path"], set_=values))
        return digest

    # -- the producer's side -------------------------------------------------------------
    def cached_results(self, keys: Sequence[str]) -> dict[str, CachedResult]:
        """The entries of ``keys`` that are cached (read without the write lock)."""
        found: dict[str, Any] = {}
        with self.reader.connect() as conn:
            for part in chunks(list(dict.fromkeys(keys)), 500):
                for row in conn.execute(select(CachedResult.key, CachedResult.result, CachedResult.timings)
                                        .where(CachedResult.key.in_(part))):
                    found[row.key] = row
        return found

    def hit_values(self, entry: Any, now: float) -> dict[str, Any]:
        """The columns of a job answered by ``entry`` at ``now``: its result, marked cached, the
        computing run's timings kept apart; its own timings say it was answered at once."""
        return dict(entry.result, status=SUCCEEDED, cached=True, cached_timings=entry.timings, started_at=now,
                    finished_at=now, queue_wait_s=0.0, published_at=now)

    def note_cache_use(self, conn: Connection, hit_keys: Iterable[str], *, misses: int, duplicates: int,
                       now: float) -> None:
        """Count a chunk's hits, misses and duplicates, and mark the entries it used as recent
        (eviction goes by age of last use); in the chunk's own transaction."""
        hit_keys = list(hit_keys)
        for part in chunks(sorted(set(hit_keys)), 500):
            conn.execute(update(CachedResult).where(CachedResult.key.in_(part))
                         .values(used_at=now, hits=CachedResult.hits + 1))
        self._count(conn, {HITS: len(hit_keys), MISSES: misses, DUPLICATES: duplicates})

    def _count(self, conn: Connection, deltas: Mapping[str, int]) -> None:
        for name, delta in deltas.items():
            if not delta:
                continue
            stmt = self._insert(CacheCounter).values(name=name, value=delta)
            conn.execute(stmt.on_conflict_do_update(index_elements=["name"],
                                                    set_={"value": CacheCounter.value + delta}))

    def write_single(self, row: dict[str, Any], *, hit_key: str | None) -> None:
        """Write one keyed job (``Client.submit``): answered from the entry ``hit_key``, or
        to run (a miss); counted either way, in its own transaction."""
        now = time.time()
        with self._write() as conn:
            conn.execute(self._insert(Job).on_conflict_do_nothing(), [row])
            self.note_cache_use(conn, [hit_key] if hit_key else [], misses=0 if hit_key else 1, duplicates=0, now=now)

    def first_of_digest(self, batch_id: str, digests: Sequence[str]) -> dict[str, str]:
        """For each digest, the id of the batch's row that runs it (not itself a duplicate)."""
        out: dict[str, str] = {}
        with self.reader.connect() as conn:
            for part in chunks(list(dict.fromkeys(digests)), 500):
                rows = conn.execute(select(Job.request_digest, Job.id).where(
                    Job.batch_id == batch_id, Job.request_digest.in_(part), Job.duplicate_of.is_(None))
                    .order_by(Job.line_no))
                for digest, job_id in rows:
                    out.setdefault(digest, job_id)
        return out

    def mark_has_duplicates(self, conn: Connection, job_ids: Sequence[str]) -> None:
        for part in chunks(list(job_ids), 500):
            conn.execute(update(Job).where(Job.id.in_(part)).values(has_duplicates=True))
        # A row that already ended (an earlier chunk's, done before its copy was read) settles
        # its new copies now.
        self.settle_duplicates(conn, job_ids)

    # -- the worker's side ---------------------------------------------------------------
    def keep_results(self, conn: Connection, entries: Sequence[tuple[str, str, dict[str, Any]]], now: float) -> None:
        """Cache (key, model key, the job's result columns as written) of jobs that succeeded;
        an entry already there stays (the same request gives the same result)."""
        rows = []
        for key, model_key, values in entries:
            if values.get("status") != SUCCEEDED or values.get("finish_reason") not in CACHEABLE_ENDINGS:
                continue
            result = {c: values.get(c) for c in RESULT_COLUMNS}
            timings = {c: values.get(c) for c in TIMING_COLUMNS}
            size = len(json_text.dumps(result)) + len(json_text.dumps(timings))
            rows.append(dict(key=key, model_key=model_key, result=result, timings=timings, size_bytes=size,
                             hits=0, created_at=now, used_at=now))
        if rows:
            conn.execute(self._insert(CachedResult).on_conflict_do_nothing(), rows)

    def settle_duplicates(self, conn: Connection, job_ids: Sequence[str]) -> int:
        """Copy the outcome of each of ``job_ids`` that has ended onto the queued rows that
        duplicate it; in the transaction that ended it. Returns the rows settled."""
        if not job_ids:
            return 0
        first = aliased(Job)
        settled = 0
        for part in chunks(list(job_ids), 500):
            values = {c: select(getattr(first, c)).where(first.id == Job.duplicate_of).scalar_subquery()
                      for c in SETTLED_COLUMNS}
            ended = exists().where(first.id == Job.duplicate_of, first.status.in_(TERMINAL))
            settled += conn.execute(update(Job).where(Job.duplicate_of.in_(part), Job.status == QUEUED, ended)
                                    .values(values).execution_options(synchronize_session=False)).rowcount
        return settled

    def settle_stray_duplicates(self, limit: int = 1000) -> int:
        """Settle queued duplicates whose row has ended without settling them (a row ended by a
        path that does not know of copies: a cancel by job id, a hand edit), and let a duplicate
        whose row is not in the store at all run on its own (published by the pacer); the
        reaper's sweep. Returns the rows settled or let go."""
        first = aliased(Job)
        with self._write() as conn:
            orphaned = conn.execute(
                update(Job).where(Job.duplicate_of.is_not(None), Job.status == QUEUED,
                                  ~exists().where(first.id == Job.duplicate_of))
                .values(duplicate_of=None, published_at=None).execution_options(synchronize_session=False)).rowcount
        if orphaned:
            log.warning("%d duplicate job(s) named a first row the store does not hold: they run on their own",
                        orphaned)
        with self.reader.connect() as conn:
            ids = conn.execute(select(Job.duplicate_of).join(first, first.id == Job.duplicate_of)
                               .where(Job.duplicate_of.is_not(None), Job.status == QUEUED,
                                      first.status.in_(TERMINAL)).distinct().limit(limit)).scalars().all()
        if not ids:
            return orphaned
        with self._write() as conn:
            return orphaned + self.settle_duplicates(conn, ids)

    # -- operators -----------------------------------------------------------------------
    def cache_stats(self) -> dict[str, Any]:
        """Entries, bytes, oldest use, and the hits, misses and duplicates counted so far."""
        with self.reader.connect() as conn:
            entries, size, oldest = conn.execute(
                select(func.count(), func.coalesce(func.sum(CachedResult.size_bytes), 0),
                       func.min(CachedResult.used_at))).one()
            counters = dict(conn.execute(select(CacheCounter.name, CacheCounter.value)).all())
        hits, misses = int(counters.get(HITS, 0)), int(counters.get(MISSES, 0))
        return {"entries": int(entries), "bytes": int(size), "oldest_used_at": oldest, "hits": hits,
                "misses": misses, "duplicates": int(counters.get(DUPLICATES, 0)),
                "hit_rate": hits / (hits + misses) if hits + misses else None}

    def clear_cache(self, model_key: str | None = None) -> int:
        """Drop every entry (or one model's); returns how many."""
        with self._write() as conn:
            stmt = delete(CachedResult)
            if model_key is not None:
                stmt = stmt.where(CachedResult.model_key == model_key)
            return conn.execute(stmt).rowcount

    def evict_cache(self, max_bytes: int) -> int:
        """Drop the least recently used entries until the cache holds at most ``max_bytes``;
        returns how many went. Run by every worker's sweep, so the bound holds within one."""
        with self.reader.connect() as conn:
            total = conn.execute(select(func.coalesce(func.sum(CachedResult.size_bytes), 0))).scalar_one()
        evicted = 0
        while total > max_bytes:
            with self.reader.connect() as conn:
                rows = conn.execute(select(CachedResult.key, CachedResult.size_bytes)
                                    .order_by(CachedResult.used_at).limit(500)).all()
            if not rows:
                break
            take, freed = [], 0
            for key, size in rows:
                if total - freed <= max_bytes:
                    break
                take.append(key)
                freed += size
            with self._write() as conn:
                evicted += conn.execute(delete(CachedResult).where(CachedResult.key.in_(take))).rowcount
            total -= freed
        return evicted
