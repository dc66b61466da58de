"""Fault tolerance: where each job's message goes, when it was last published or recovered,
attempts given back without blame, and a row per worker process (crash loops show).

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-01
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

EPOCH = sa.Float(precision=53)


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("queue", sa.String(255), nullable=True))
        batch.add_column(sa.Column("published_at", EPOCH, nullable=True))
        batch.add_column(sa.Column("recovered_at", EPOCH, nullable=True))
        batch.add_column(sa.Column("attempts_forgiven", sa.Integer(), nullable=False, server_default="0"))
    op.create_index("ix_jobs_status_heartbeat", "jobs", ["status", "heartbeat_at"])
    op.create_table(
        "workers",
        sa.Column("name", sa.String(255), primary_key=True),
        sa.Column("host", sa.String(255), nullable=True),
        sa.Column("pid", sa.Integer(), nullable=True),
        sa.Column("device", sa.String(64), nullable=True),
        sa.Column("queue", sa.String(255), nullable=True),
        sa.Column("model", sa.String(255), nullable=True),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("starts", sa.Integer(), nullable=False, server_default="0"),
        sa.Column("failures", sa.Integer(), nullable=False, server_default="0"),
        sa.Column("started_at", EPOCH, nullable=True),
        sa.Column("heartbeat_at", EPOCH, nullable=True),
        sa.Column("stopped_at", EPOCH, nullable=True),
    )


def downgrade() -> None:
    op.drop_table("workers")
    op.drop_index("ix_jobs_status_heartbeat", table_name="jobs")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("attempts_forgiven")
        batch.drop_column("recovered_at")
        batch.drop_column("published_at")
        batch.drop_column("queue")
