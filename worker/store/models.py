"""The store's tables as SQLAlchemy 2 typed models. Timestamps are ``time.time()`` epoch
seconds (double precision), the same clock the engine's ``RequestMetrics`` use, so the
worker copies them one to one and derived latencies keep sub-millisecond precision."""

from __future__ import annotations

from typing import Any

from sqlalchemy import JSON, BigInteger, Boolean, Float, ForeignKey, Index, Integer, LargeBinary, String, UniqueConstraint, text
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from worker.store.sqltypes import (  # user text may hold NUL (see sqltypes)
    NulSafeString,
    NulSafeText,
    TokenIds,
)

# Job statuses. Terminal ones are never left again except by an explicit retry.
QUEUED, RUNNING, SUCCEEDED, FAILED, CANCELLED = "queued", "running", "succeeded", "failed", "cancelled"
STATUSES = (QUEUED, RUNNING, SUCCEEDED, FAILED, CANCELLED)
TERMINAL = (SUCCEEDED, FAILED, CANCELLED)

Epoch = Float(precision=53)


class Base(DeclarativeBase):
    type_annotation_map = {dict[str, Any]: JSON, list[Any]: JSON, float: Epoch}


class Batch(Base):
    """One bulk run: an input file's worth of jobs."""

    __tablename__ = "batches"

    id: Mapped[str] = mapped_column(NulSafeString(64), primary_key=True)  # looked up by user-given strings
    name: Mapped[str | None] = mapped_column(NulSafeString(255), unique=True)
    input_file: Mapped[str | None] = mapped_column(NulSafeText)
    model: Mapped[str] = mapped_column(String(255))
    params: Mapped[dict[str, Any] | None]
    num_total: Mapped[int] = mapped_column(Integer, default=0)
    num_queued: Mapped[int] = mapped_column(Integer, default=0)
    num_running: Mapped[int] = mapped_column(Integer, default=0)
    num_succeeded: Mapped[int] = mapped_column(Integer, default=0)
    num_failed: Mapped[int] = mapped_column(Integer, default=0)
    num_cancelled: Mapped[int] = mapped_column(Integer, default=0)
    # Priority lanes: the batch's priority (its jobs' unless a line names one) and the most of
    # its jobs published or running at once (None: no cap beyond the pacing window).
    priority: Mapped[int | None]
    max_in_flight: Mapped[int | None]
    created_at: Mapped[float]
    # When the whole input was written (streaming ingest writes it in chunks); NULL while it is
    # being read: the batch is not finished then even if every job written so far is.
    ingested_at: Mapped[float | None]
    finished_at: Mapped[float | None]


class Job(Base):
    """One generation request and everything learnt while running it."""

    __tablename__ = "jobs"
    __table_args__ = (
        UniqueConstraint("batch_id", "custom_id", name="uq_jobs_batch_custom_id"),
        Index("ix_jobs_batch_status", "batch_id", "status"),
        Index("ix_jobs_status_heartbeat", "status", "heartbeat_at"),
        # The pacer's next jobs of one batch and queue, in line order: an index range, however
        # many jobs of other queues (lanes, models) the batch or the table holds. PostgreSQL
        # does not order by line_no through ``published_at IS NULL``: a partial index there
        # (migration 0005 says why).
        # Order: shared prompt prefixes together (``prefix_key``, migration 0008), then line order.
        Index("ix_jobs_pacing", "batch_id", "status", "published_at", "queue", "prefix_key", "line_no").ddl_if(dialect="sqlite"),
        Index("ix_jobs_unpublished", "batch_id", "queue", "prefix_key", "line_no",
              postgresql_where=text("status = 'queued' AND published_at IS NULL")).ddl_if(dialect="postgresql"),
        Index("ix_jobs_batch_line", "batch_id", "line_no", "id"),  # input order: output files, export
        # A batch's duplicates, and a computed row's copies (settled with it): partial indexes,
        # so the rows that are neither cost a bulk insert nothing more (migration 0008).
        Index("ix_jobs_batch_digest", "batch_id", "request_digest", sqlite_where=text("request_digest IS NOT NULL"),
              postgresql_where=text("request_digest IS NOT NULL")),
        Index("ix_jobs_duplicate_of", "duplicate_of", sqlite_where=text("duplicate_of IS NOT NULL"),
              postgresql_where=text("duplicate_of IS NOT NULL")),
    )

    id: Mapped[str] = mapped_column(NulSafeString(64), primary_key=True)
    batch_id: Mapped[str | None] = mapped_column(NulSafeString(64), ForeignKey("batches.id", ondelete="CASCADE"))
    custom_id: Mapped[str | None] = mapped_column(NulSafeString(255))
    line_no: Mapped[int | None]
    model: Mapped[str] = mapped_column(String(255))
    endpoint: Mapped[str] = mapped_column(String(32), default="completions")  # "chat" | "completions"
    prompt: Mapped[str | None] = mapped_column(NulSafeText)
    prompt_token_ids_in: Mapped[list[Any] | None]  # a prompt given as token ids
    # The prompt as the producer tokenized it, where it did (to check its length): the engine
    # takes these ids instead of tokenizing the text or conversation again (migration 0007).
    prompt_tokens: Mapped[list[int] | None] = mapped_column(TokenIds)
    messages: Mapped[list[Any] | None]
    params: Mapped[dict[str, Any] | None]
    status: Mapped[str] = mapped_column(String(16), default=QUEUED)  # indexed by (status, heartbeat_at)
    # ``attempts`` only grows: it is the fence every write names. Attempts given back without
    # blame (a drain, a dying engine, ``--retry-failed``) are counted in ``attempts_forgiven``,
    # and only the difference counts against ``max_attempts``.
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    attempts_forgiven: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    queue: Mapped[str | None] = mapped_column(String(255))  # the Redis queue its messages go to
    priority: Mapped[int | None]  # lower is more urgent (worker.dispatch.lanes); None is the bulk lane's
    user: Mapped[str | None] = mapped_column(NulSafeString(255))  # OpenAI's end-user id, as given
    cache_salt: Mapped[str | None] = mapped_column(NulSafeString(255))  # vLLM's: tenants share no cache
    # Bulk once (migration 0008). ``request_digest``: what the result is a pure function of,
    # besides the model (``worker.request.cache_key``); NULL: never cached nor deduplicated (an
    # unseeded sampled request, or ``cache=False``). ``prefix_key``: the pacer's order, prompts
    # that share a prefix next to each other. ``duplicate_of``: the row of the same batch whose
    # run answers this one (it is never published; settled with it); ``has_duplicates`` marks
    # that row. ``cached``: answered from the result cache at ingest; ``cached_timings``: the
    # timings of the run that computed it (this row's own say when it was answered).
    request_digest: Mapped[str | None] = mapped_column(String(32))
    prefix_key: Mapped[bytes | None] = mapped_column(LargeBinary)
    duplicate_of: Mapped[str | None] = mapped_column(NulSafeString(64))
    has_duplicates: Mapped[bool | None] = mapped_column(Boolean)
    cached: Mapped[bool | None] = mapped_column(Boolean)
    cached_timings: Mapped[dict[str, Any] | None]
    worker: Mapped[str | None] = mapped_column(String(255))
    device: Mapped[str | None] = mapped_column(String(64))
    # results
    output_text: Mapped[str | None] = mapped_column(NulSafeText)
    output_token_ids: Mapped[list[Any] | None]
    outputs: Mapped[list[Any] | None]  # every sample when n > 1: [{text, token_ids, finish_reason}]
    finish_reason: Mapped[str | None] = mapped_column(String(16))
    error: Mapped[str | None] = mapped_column(NulSafeText)
    error_type: Mapped[str | None] = mapped_column(String(64))
    # timings (epoch seconds)
    enqueued_at: Mapped[float | None]
    started_at: Mapped[float | None]
    heartbeat_at: Mapped[float | None]
    published_at: Mapped[float | None]  # last time a message for it was sent
    recovered_at: Mapped[float | None]  # last time a lost or drained attempt was put back in the queue
    first_scheduled_at: Mapped[float | None]
    first_token_at: Mapped[float | None]
    finished_at: Mapped[float | None]
    # derived
    queue_wait_s: Mapped[float | None]
    ttft_s: Mapped[float | None]
    tpot_s: Mapped[float | None]
    tokens_per_s: Mapped[float | None]
    # counts
    num_prompt_tokens: Mapped[int | None]
    num_cached_tokens: Mapped[int | None]
    num_output_tokens: Mapped[int | None]
    num_draft_tokens: Mapped[int | None]
    num_accepted_tokens: Mapped[int | None]
    num_preemptions: Mapped[int | None]
    num_steps: Mapped[int | None]
    max_batch_size: Mapped[int | None]
    num_waiting_steps: Mapped[int | None]  # engine steps from reaching the engine to first scheduled


# How an attempt ended without the job's result (``JobAttempt.outcome``).
GIVEN_BACK, LOST = "given back", "lost"


class JobAttempt(Base):
    """An attempt that ended without ending its job: given back (a drain, a dying engine, a
    worker that had to restart) or lost (its lease expired: the worker vanished). Written only
    then, in the transaction that puts the job back in the queue: the attempt that ends the job
    is the job row itself (worker, status, error, finished_at), so the usual path writes
    nothing here. ``charged``: whether it counts against ``max_attempts`` (the job's own fault
    as far as anyone can tell); ``jobs.attempts - jobs.attempts_forgiven`` sums the same."""

    __tablename__ = "job_attempts"

    job_id: Mapped[str] = mapped_column(NulSafeString(64), ForeignKey("jobs.id", ondelete="CASCADE"),
                                        primary_key=True)
    attempt: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    worker: Mapped[str | None] = mapped_column(String(255))
    device: Mapped[str | None] = mapped_column(String(64))
    started_at: Mapped[float | None]
    ended_at: Mapped[float]
    outcome: Mapped[str] = mapped_column(String(16))
    cause: Mapped[str | None] = mapped_column(NulSafeText)
    charged: Mapped[bool] = mapped_column(Boolean)


# Worker states, as ``specbatch status`` shows them.
W_STARTING, W_READY, W_DRAINING, W_STOPPED, W_FAILED = "starting", "ready", "draining", "stopped", "failed"
#: The process left with an exit code (``Worker.exit_code``; ``worker.run.exit_codes``).
W_EXITED = "exited"


class Worker(Base):
    """One worker process by node name: a crash-looping worker shows as many starts and
    failures with its last error, whoever restarts it."""

    __tablename__ = "workers"

    name: Mapped[str] = mapped_column(String(255), primary_key=True)
    host: Mapped[str | None] = mapped_column(String(255))
    pid: Mapped[int | None]
    device: Mapped[str | None] = mapped_column(String(64))
    queue: Mapped[str | None] = mapped_column(String(255))
    model: Mapped[str | None] = mapped_column(String(255))
    state: Mapped[str] = mapped_column(String(16))
    error: Mapped[str | None] = mapped_column(NulSafeText)
    starts: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    failures: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    started_at: Mapped[float | None]
    heartbeat_at: Mapped[float | None]
    stopped_at: Mapped[float | None]
    exit_code: Mapped[int | None]  # the code its last exit was recorded with (state ``exited``)


class CachedResult(Base):
    """One result of the exact result cache (``worker.store.results_cache``): a greedy or seeded
    request's answer, keyed by the model's identity and the request's digest; a hit is answered
    at ingest and never reaches a queue or an engine."""

    __tablename__ = "results_cache"
    __table_args__ = (Index("ix_results_cache_used", "used_at"),)

    key: Mapped[str] = mapped_column(String(64), primary_key=True)  # (model key, request digest)
    model_key: Mapped[str] = mapped_column(String(32), index=True)
    result: Mapped[dict[str, Any]]  # the job's result columns
    timings: Mapped[dict[str, Any]]  # the computing run's timings, kept apart
    size_bytes: Mapped[int] = mapped_column(Integer)
    hits: Mapped[int] = mapped_column(Integer, default=0)
    created_at: Mapped[float]
    used_at: Mapped[float]  # eviction is by age of last use


class ModelDigest(Base):
    """A model's files, digested once (``engine.model_digest``) and remembered by their path,
    sizes and modification times: a changed file is digested again."""

    __tablename__ = "model_digests"

    path: Mapped[str] = mapped_column(NulSafeText, primary_key=True)
    signature: Mapped[str] = mapped_column(String(64))
    digest: Mapped[str] = mapped_column(String(64))
    computed_at: Mapped[float]
    seconds: Mapped[float]


class CacheCounter(Base):
    """Counters of the result cache since the store was made: hits, misses, duplicates."""

    __tablename__ = "cache_counters"

    name: Mapped[str] = mapped_column(String(32), primary_key=True)
    value: Mapped[int] = mapped_column(BigInteger, default=0)
