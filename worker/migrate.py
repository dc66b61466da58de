"""Schema migrations, run programmatically so ``specbatch db upgrade`` works from any
directory of an editable install (the ``migrations/`` folder sits beside ``worker/``)."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine, text

MIGRATIONS_DIR = Path(__file__).resolve().parent.parent / "migrations"
#: Any fixed 64-bit number; PostgreSQL workers starting together migrate one at a time.
_PG_LOCK_KEY = 0x5BEC_BA7C


def alembic_config() -> Config:
    if not (MIGRATIONS_DIR / "env.py").exists():
        raise RuntimeError(f"migrations folder not found at {MIGRATIONS_DIR}; install with `pip install -e .`")
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    return cfg


def head_revision() -> str | None:
    return ScriptDirectory.from_config(alembic_config()).get_current_head()


def current_revision(engine: Engine) -> str | None:
    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def upgrade(engine: Engine, revision: str = "head") -> None:
    """Upgrade to ``revision`` on ``engine``'s own connection (keeps its search_path)."""
    cfg = alembic_config()
    with engine.begin() as conn:
        if conn.dialect.name == "postgresql":
            conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": _PG_LOCK_KEY})
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, revision)


def is_current(engine: Engine) -> bool:
    return current_revision(engine) == head_revision()
