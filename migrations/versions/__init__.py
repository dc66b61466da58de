"""Alembic revisions, oldest first (imported by Alembic by file, not by name)."""
