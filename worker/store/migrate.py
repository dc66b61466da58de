"""Schema migrations, run programmatically so ``specbatch db upgrade`` works from any
directory, from an editable install and from a wheel: the repository's ``migrations/`` folder is
installed as the package ``specbatch_migrations`` (see pyproject.toml), found here by import."""

from __future__ import annotations

from importlib.util import find_spec
from pathlib import Path

from worker.common.quiet import quiet_alembic

quiet_alembic()  # before alembic is imported: its plugin setup lines say nothing to a user

from alembic import command  # noqa: E402
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine, text

#: Any fixed 64-bit number; PostgreSQL workers starting together migrate one at a time.
_PG_LOCK_KEY = 0x5BEC_BA7C


def migrations_dir() -> Path:
    """The installed ``specbatch_migrations`` package's folder (a wheel's or the repository's)."""
    spec = find_spec("specbatch_migrations")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the specbatch_migrations package is not installed; install specbatch with pip")
    folder = Path(next(iter(spec.submodule_search_locations)))
    if not (folder / "env.py").exists():
        raise RuntimeError(f"specbatch_migrations at {folder} holds no env.py: a broken install")
    return folder


def alembic_config() -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(migrations_dir()))
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
