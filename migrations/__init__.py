"""Alembic environment and revisions, shipped inside the wheel (``specbatch db upgrade`` finds them
through this package, from any directory and from an installed wheel)."""
