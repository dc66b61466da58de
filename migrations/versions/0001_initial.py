"""Initial schema: batches and jobs.

Revision ID: 0001
Revises:
Create Date: 2025-01-01
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

EPOCH = sa.Float(precision=53)


def upgrade() -> None:
    op.create_table(
        "batches",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("name", sa.String(255), nullable=True, unique=True),
        sa.Column("input_file", sa.Text(), nullable=True),
        sa.Column("model", sa.String(255), nullable=False),
        sa.Column("params", sa.JSON(), nullable=True),
        sa.Column("num_total", sa.Integer(), nullable=False),
        sa.Column("num_queued", sa.Integer(), nullable=False),
        sa.Column("num_running", sa.Integer(), nullable=False),
        sa.Column("num_succeeded", sa.Integer(), nullable=False),
        sa.Column("num_failed", sa.Integer(), nullable=False),
        sa.Column("num_cancelled", sa.Integer(), nullable=False),
        sa.Column("created_at", EPOCH, nullable=False),
        sa.Column("finished_at", EPOCH, nullable=True),
    )
    op.create_table(
        "jobs",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("batch_id", sa.String(64), sa.ForeignKey("batches.id", ondelete="CASCADE"), nullable=True),
        sa.Column("custom_id", sa.String(255), nullable=True),
        sa.Column("line_no", sa.Integer(), nullable=True),
        sa.Column("model", sa.String(255), nullable=False),
        sa.Column("endpoint", sa.String(32), nullable=False),
        sa.Column("prompt", sa.Text(), nullable=True),
        sa.Column("prompt_token_ids_in", sa.JSON(), nullable=True),
        sa.Column("messages", sa.JSON(), nullable=True),
        sa.Column("params", sa.JSON(), nullable=True),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("worker", sa.String(255), nullable=True),
        sa.Column("device", sa.String(64), nullable=True),
        sa.Column("output_text", sa.Text(), nullable=True),
        sa.Column("output_token_ids", sa.JSON(), nullable=True),
        sa.Column("outputs", sa.JSON(), nullable=True),
        sa.Column("finish_reason", sa.String(16), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("error_type", sa.String(64), nullable=True),
        *[
            sa.Column(name, EPOCH, nullable=True)
            for name in (
                "enqueued_at", "started_at", "heartbeat_at", "first_scheduled_at", "first_token_at",
                "finished_at", "queue_wait_s", "ttft_s", "tpot_s", "tokens_per_s",
            )
        ],
        *[
            sa.Column(name, sa.Integer(), nullable=True)
            for name in (
                "num_prompt_tokens", "num_cached_tokens", "num_output_tokens", "num_draft_tokens",
                "num_accepted_tokens", "num_preemptions", "num_steps", "max_batch_size",
            )
        ],
        sa.UniqueConstraint("batch_id", "custom_id", name="uq_jobs_batch_custom_id"),
    )
    op.create_index("ix_jobs_batch_status", "jobs", ["batch_id", "status"])
    op.create_index("ix_jobs_status", "jobs", ["status"])


def downgrade() -> None:
    op.drop_index("ix_jobs_status", table_name="jobs")
    op.drop_index("ix_jobs_batch_status", table_name="jobs")
    op.drop_table("jobs")
    op.drop_table("batches")
