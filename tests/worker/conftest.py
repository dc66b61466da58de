"""Fixtures for worker tests: real SQLite files and a fresh PostgreSQL schema per test, and
a private Redis database per test on the real server (or an embedded one if none is up)."""

from __future__ import annotations

import os
import sys
import tempfile
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

PG_URL = os.environ.get("SPECBATCH_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
REDIS_URL = os.environ.get("SPECBATCH_TEST_REDIS_URL", "redis://127.0.0.1:6379")


def _pg_available() -> bool:
    try:
        import psycopg

        psycopg.connect(PG_URL.replace("+psycopg", ""), connect_timeout=2).close()
        return True
    except Exception:
        return False


@contextmanager
def pg_schema() -> Iterator[str]:
    """A PostgreSQL URL whose ``search_path`` is a schema made for the caller (dropped after)."""
    if not _pg_available():
        # CI and this project's machines run PostgreSQL: its absence is a failure, unless the
        # person running the tests says explicitly that they have none.
        if os.environ.get("SPECBATCH_TEST_SKIP_PG") == "1":
            pytest.skip("SPECBATCH_TEST_SKIP_PG=1: no PostgreSQL at " + PG_URL)
        pytest.fail(f"PostgreSQL not reachable at {PG_URL} (start it, or set SPECBATCH_TEST_SKIP_PG=1)")
    import psycopg

    schema = f"sbtest_{uuid.uuid4().hex[:12]}"
    plain = PG_URL.replace("+psycopg", "")
    with psycopg.connect(plain, autocommit=True) as conn:
        conn.execute(f'CREATE SCHEMA "{schema}"')
    yield f"{PG_URL}?options=-csearch_path%3D{schema}"
    with psycopg.connect(plain, autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA "{schema}" CASCADE')


@pytest.fixture
def pg_url():
    """A PostgreSQL URL whose ``search_path`` is a schema made for this test (dropped after)."""
    with pg_schema() as url:
        yield url


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def module_db_url(request, tmp_path_factory):
    """``db_url`` held for a whole module (its module-scoped worker)."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path_factory.mktemp('db') / 'specbatch.db'}"
        return
    with pg_schema() as url:
        yield url


@pytest.fixture
def sqlite_url(tmp_path):
    return f"sqlite:///{tmp_path / 'specbatch.db'}"


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request, tmp_path):
    if request.param == "sqlite":
        return request.getfixturevalue("sqlite_url")
    return request.getfixturevalue("pg_url")


@contextmanager
def own_redis_db() -> Iterator[str]:
    """A Redis database (1..15) on the real server that no other test holds meanwhile, also
    across pytest-xdist's processes (a lock file each), or an embedded server if none is up.
    Queue names are unique per test anyway; Celery's worker registry and events are per
    database, so two tests sharing one would see each other's workers."""
    import fcntl

    import redis

    try:
        redis.Redis.from_url(REDIS_URL, socket_connect_timeout=2).ping()
    except Exception:
        from worker.dispatch.embedded import embedded_redis_url

        yield embedded_redis_url()
        return
    lock_dir = Path(tempfile.gettempdir()) / "specbatch-test-redis-dbs"
    lock_dir.mkdir(exist_ok=True)
    start = uuid.uuid4().int % 15
    while True:
        for i in range(15):
            db = 1 + (start + i) % 15
            handle = open(lock_dir / f"{db}.lock", "w")
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                handle.close()
                continue
            try:
                yield f"{REDIS_URL}/{db}"
            finally:
                handle.close()  # closing releases the lock
            return
        time.sleep(0.1)  # all 15 held: more tests at once than databases


@pytest.fixture
def redis_url():
    """A Redis database of its own on the real server (``own_redis_db``)."""
    with own_redis_db() as url:
        yield url


@pytest.fixture(scope="module")
def module_redis_url():
    """``redis_url`` held for a whole module (its module-scoped worker or run)."""
    with own_redis_db() as url:
        yield url


@pytest.fixture
def unique_queue():
    return f"gen.test-{uuid.uuid4().hex[:10]}"
