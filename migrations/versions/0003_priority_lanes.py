"""Priority lanes: each job's priority and the engine steps it waited inside the engine, the
OpenAI ``user`` a line names, a per-batch cap of jobs in flight, and an index the
pacer uses to take each batch's next unpublished jobs in line order.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("priority", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("num_waiting_steps", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("user", sa.String(255), nullable=True))
    with op.batch_alter_table("batches") as batch:
        batch.add_column(sa.Column("max_in_flight", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("priority", sa.Integer(), nullable=True))
    op.create_index("ix_jobs_pacing", "jobs", ["batch_id", "status", "published_at", "line_no"])


def downgrade() -> None:
    op.drop_index("ix_jobs_pacing", table_name="jobs")
    with op.batch_alter_table("batches") as batch:
        batch.drop_column("priority")
        batch.drop_column("max_in_flight")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("user")
        batch.drop_column("num_waiting_steps")
        batch.drop_column("priority")
