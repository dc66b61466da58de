"""The store's tables as SQLAlchemy 2 typed models. Timestamps are ``time.time()`` epoch
seconds (double precision), the same clock the engine's ``RequestMetrics`` use, so the
worker copies them one to one and derived latencies keep sub-millisecond precision."""

from __future__ import annotations

from typing import Any

from sqlalchemy import JSON, Float, ForeignKey, Index, Integer, String, UniqueConstraint
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from .sqltypes import NulSafeString, NulSafeText  # user text may hold NUL (see sqltypes)

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
    created_at: Mapped[float]
    finished_at: Mapped[float | None]


class Job(Base):
    """One generation request and everything learnt while running it."""

    __tablename__ = "jobs"
    __table_args__ = (
        UniqueConstraint("batch_id", "custom_id", name="uq_jobs_batch_custom_id"),
        Index("ix_jobs_batch_status", "batch_id", "status"),
    )

    id: Mapped[str] = mapped_column(NulSafeString(64), primary_key=True)
    batch_id: Mapped[str | None] = mapped_column(NulSafeString(64), ForeignKey("batches.id", ondelete="CASCADE"))
    custom_id: Mapped[str | None] = mapped_column(NulSafeString(255))
    line_no: Mapped[int | None]
    model: Mapped[str] = mapped_column(String(255))
    endpoint: Mapped[str] = mapped_column(String(32), default="completions")  # "chat" | "completions"
    prompt: Mapped[str | None] = mapped_column(NulSafeText)
    prompt_token_ids_in: Mapped[list[Any] | None]  # a prompt given as token ids
    messages: Mapped[list[Any] | None]
    params: Mapped[dict[str, Any] | None]
    status: Mapped[str] = mapped_column(String(16), default=QUEUED, index=True)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
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
