"""Fixtures for worker tests: real SQLite files and a fresh PostgreSQL schema per test, and
a private Redis database per test on the real server (or an embedded one if none is up)."""

from __future__ import annotations

import os
import sys
import uuid
from pathlib import Path

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


@pytest.fixture
def pg_url():
    """A PostgreSQL URL whose ``search_path`` is a schema made for this test (dropped after)."""
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
def sqlite_url(tmp_path):
    return f"sqlite:///{tmp_path / 'specbatch.db'}"


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request, tmp_path):
    if request.param == "sqlite":
        return request.getfixturevalue("sqlite_url")
    return request.getfixturevalue("pg_url")


@pytest.fixture
def redis_url():
    """A Redis database of its own on the real server (db 1..15 picked at random)."""
    import redis

    try:
        r = redis.Redis.from_url(REDIS_URL, socket_connect_timeout=2)
        r.ping()
    except Exception:
        from worker.dispatch.embedded import embedded_redis_url

        yield embedded_redis_url()
        return
    db = 1 + uuid.uuid4().int % 15
    url = f"{REDIS_URL}/{db}"
    yield url


@pytest.fixture
def unique_queue():
    return f"gen.test-{uuid.uuid4().hex[:10]}"
