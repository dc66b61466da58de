"""Attempt history: ``job_attempts`` holds each attempt that ended without ending its job
(given back, or lost when its lease expired), with its worker, end, cause and whether it was
charged against ``max_attempts``; ``specbatch status JOB`` shows them. The attempt that ends
the job stays on the job row, so a job that succeeds at once writes nothing here.
And ``workers.exit_code``: the code a worker process recorded as it exited, so ``status``
shows ``exited N`` instead of the state it had before (``ready`` for a process long gone).

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-04
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "job_attempts",
        sa.Column("job_id", sa.String(64), sa.ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True),
        sa.Column("attempt", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("worker", sa.String(255), nullable=True),
        sa.Column("device", sa.String(64), nullable=True),
        sa.Column("started_at", sa.Float(precision=53), nullable=True),
        sa.Column("ended_at", sa.Float(precision=53), nullable=False),
        sa.Column("outcome", sa.String(16), nullable=False),
        sa.Column("cause", sa.Text, nullable=True),
        sa.Column("charged", sa.Boolean, nullable=False),
    )


    with op.batch_alter_table("workers") as batch:
        batch.add_column(sa.Column("exit_code", sa.Integer, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("workers") as batch:
        batch.drop_column("exit_code")
    op.drop_table("job_attempts")
