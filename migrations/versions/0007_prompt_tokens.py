"""``jobs.prompt_tokens``: the prompt as the producer tokenized it to check its length (packed
uint32, ``worker.store.sqltypes.TokenIds``). The worker hands these ids to the engine, so a
prompt is tokenized once: at the producer where its length needed counting, else in the engine.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-05
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("prompt_tokens", sa.LargeBinary, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("prompt_tokens")
