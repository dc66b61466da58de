"""The pacer's index on PostgreSQL becomes a partial one over unpublished queued jobs, in line
order per batch and queue; two indexes covered by others' leading columns go.

PostgreSQL does not take ``published_at IS NULL`` as an equality for ordering, so taking a
batch's next 8,192 jobs through (batch, status, published_at, queue, line_no) sorted every
unpublished job of the batch (160 ms a pacer tick at 200,000 jobs); and a table loaded moments
ago (no statistics yet) led the planner to (batch, status) instead, filtering every job of the
batch to find none of another lane (85 ms a tick, 38 us a line of a 200,000-line ingest). The
partial index (batch, queue, line_no) WHERE queued AND unpublished is an ordered range in both
cases, and smaller: a job leaves it once published. SQLite uses the full index as an ordered
range already (it takes IS NULL as an equality) and cannot match a partial index's predicate
to a bound parameter, so it keeps it.

``ix_jobs_status`` (status) is the prefix of ``ix_jobs_status_heartbeat``; on PostgreSQL
``ix_jobs_batch_status`` keeps serving (batch, status) counts. Fewer indexes to maintain: a
bulk insert writes each row into five (PostgreSQL) or six (SQLite) instead of seven.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-02
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

UNPUBLISHED = "status = 'queued' AND published_at IS NULL"


def upgrade() -> None:
    op.drop_index("ix_jobs_status", table_name="jobs")
    if op.get_bind().dialect.name == "postgresql":
        op.drop_index("ix_jobs_pacing", table_name="jobs")
        op.create_index("ix_jobs_unpublished", "jobs", ["batch_id", "queue", "line_no"],
                        postgresql_where=sa.text(UNPUBLISHED))


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.drop_index("ix_jobs_unpublished", table_name="jobs")
        op.create_index("ix_jobs_pacing", "jobs", ["batch_id", "status", "published_at", "queue", "line_no"])
    op.create_index("ix_jobs_status", "jobs", ["status"])
