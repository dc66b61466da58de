"""Reads for users and reports: jobs, batches, their counts, progress and timings, and a
batch's state (counts refreshed, done, cancelled)."""

from __future__ import annotations

import time
from typing import Any, Iterable, Iterator, Sequence

from sqlalchemy import case, func, select, tuple_, update

from worker.store.connection import StoreBase
from worker.store.models import (CANCELLED, FAILED, QUEUED, RUNNING, STATUSES, SUCCEEDED, TERMINAL, Batch, Job,
                                 JobAttempt)
from worker.store.rows import chunks


class Reads(StoreBase):
    """What users, reports and polls read; batch counts kept current."""

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
            for chunk in chunks(ids, 500):
                conn.execute(
                    update(Job).where(Job.id.in_(chunk), Job.status.in_((QUEUED, RUNNING)))
                    .values(status=CANCELLED, finished_at=now, finish_reason="abort",
                            error="cancelled", error_type="cancelled")
                )
        if batch_id is not None:
            self.refresh_batch(batch_id)
        return ids, [r.id for r in rows if r.status == RUNNING]

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

