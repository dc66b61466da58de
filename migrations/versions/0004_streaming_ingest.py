"""Streaming ingest: when a batch's input was fully written. While it is NULL the batch is
still being read in chunks, so it is never marked finished between two chunks (its workers
may run dry before the next chunk lands). Batches written before this revision are whole.
And an index in input order, (batch, line, id), which output files and exports page through;
the pacer's index gains the queue, so taking a batch's next jobs of one queue is an index range
(it scanned every unpublished job of the batch's other queues, and a million-job batch on
another model's queue made each pacer tick take seconds).

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("batches") as batch:
        batch.add_column(sa.Column("ingested_at", sa.Float(precision=53), nullable=True))
    op.execute("UPDATE batches SET ingested_at = created_at")
    op.create_index("ix_jobs_batch_line", "jobs", ["batch_id", "line_no", "id"])
    op.drop_index("ix_jobs_pacing", table_name="jobs")
    op.create_index("ix_jobs_pacing", "jobs", ["batch_id", "status", "published_at", "queue", "line_no"])


def downgrade() -> None:
    op.drop_index("ix_jobs_pacing", table_name="jobs")
    op.create_index("ix_jobs_pacing", "jobs", ["batch_id", "status", "published_at", "line_no"])
    op.drop_index("ix_jobs_batch_line", table_name="jobs")
    with op.batch_alter_table("batches") as batch:
        batch.drop_column("ingested_at")
