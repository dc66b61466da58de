"""Bulk once: the exact result cache, duplicates computed once, prefix-ordered pacing.

``results_cache`` holds greedy and seeded results by (model identity, request digest);
``model_digests`` remembers each model's digest by its files' path, sizes and times;
``cache_counters`` counts hits, misses and duplicates. ``jobs`` gains the request's digest, its
prompt-prefix order key, the row a duplicate copies, whether it was answered from the cache
(with the computing run's timings kept apart) and vLLM's ``cache_salt``. The pacer's index
orders by the prefix key before the line, so a batch's jobs are published grouped by the
prompt prefix they share (``worker.request.cache_key.prefix_key``).

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-07
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

UNPUBLISHED = "status = 'queued' AND published_at IS NULL"
Epoch = sa.Float(precision=53)


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("cache_salt", sa.String(255), nullable=True))
        batch.add_column(sa.Column("request_digest", sa.String(32), nullable=True))
        batch.add_column(sa.Column("prefix_key", sa.LargeBinary, nullable=True))
        batch.add_column(sa.Column("duplicate_of", sa.String(64), nullable=True))
        batch.add_column(sa.Column("has_duplicates", sa.Boolean, nullable=True))
        batch.add_column(sa.Column("cached", sa.Boolean, nullable=True))
        batch.add_column(sa.Column("cached_timings", sa.JSON, nullable=True))
    for name, column in (("ix_jobs_batch_digest", ["batch_id", "request_digest"]),
                         ("ix_jobs_duplicate_of", ["duplicate_of"])):
        where = sa.text(f"{column[-1]} IS NOT NULL")
        op.create_index(name, "jobs", column, sqlite_where=where, postgresql_where=where)
    if op.get_bind().dialect.name == "postgresql":
        op.drop_index("ix_jobs_unpublished", table_name="jobs")
        op.create_index("ix_jobs_unpublished", "jobs", ["batch_id", "queue", "prefix_key", "line_no"],
                        postgresql_where=sa.text(UNPUBLISHED))
    else:
        op.drop_index("ix_jobs_pacing", table_name="jobs")
        op.create_index("ix_jobs_pacing", "jobs", ["batch_id", "status", "published_at", "queue", "prefix_key", "line_no"])
    op.create_table(
        "results_cache",
        sa.Column("key", sa.String(64), primary_key=True),
        sa.Column("model_key", sa.String(32), nullable=False),
        sa.Column("result", sa.JSON, nullable=False),
        sa.Column("timings", sa.JSON, nullable=False),
        sa.Column("size_bytes", sa.Integer, nullable=False),
        sa.Column("hits", sa.Integer, nullable=False),
        sa.Column("created_at", Epoch, nullable=False),
        sa.Column("used_at", Epoch, nullable=False),
    )
    op.create_index("ix_results_cache_used", "results_cache", ["used_at"])
    op.create_index("ix_results_cache_model_key", "results_cache", ["model_key"])
    op.create_table(
        "model_digests",
        sa.Column("path", sa.Text, primary_key=True),
        sa.Column("signature", sa.String(64), nullable=False),
        sa.Column("digest", sa.String(64), nullable=False),
        sa.Column("computed_at", Epoch, nullable=False),
        sa.Column("seconds", Epoch, nullable=False),
    )
    op.create_table(
        "cache_counters",
        sa.Column("name", sa.String(32), primary_key=True),
        sa.Column("value", sa.BigInteger, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("cache_counters")
    op.drop_table("model_digests")
    op.drop_index("ix_results_cache_model_key", table_name="results_cache")
    op.drop_index("ix_results_cache_used", table_name="results_cache")
    op.drop_table("results_cache")
    if op.get_bind().dialect.name == "postgresql":
        op.drop_index("ix_jobs_unpublished", table_name="jobs")
        op.create_index("ix_jobs_unpublished", "jobs", ["batch_id", "queue", "line_no"],
                        postgresql_where=sa.text(UNPUBLISHED))
    else:
        op.drop_index("ix_jobs_pacing", table_name="jobs")
        op.create_index("ix_jobs_pacing", "jobs", ["batch_id", "status", "published_at", "queue", "line_no"])
    op.drop_index("ix_jobs_duplicate_of", table_name="jobs")
    op.drop_index("ix_jobs_batch_digest", table_name="jobs")
    with op.batch_alter_table("jobs") as batch:
        for name in ("cached_timings", "cached", "has_duplicates", "duplicate_of", "prefix_key", "request_digest",
                     "cache_salt"):
            batch.drop_column(name)
