"""The store's connection to its database: URLs, engines (SQLite made fit for many writer
threads), write transactions and schema upgrades, shared by every part of ``Store``."""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Callable, Iterator, TypeVar

from sqlalchemy import Connection, Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.orm import sessionmaker

from worker.common.config import settings
from worker.store import json_text, migrate
from worker.store.group_commit import GroupCommit

T = TypeVar("T")


def normalize_url(url: str) -> str:
    """Use psycopg 3 for plain ``postgresql://`` / ``postgres://`` URLs."""
    if url.startswith("postgres://"):
        url = "postgresql://" + url[len("postgres://") :]
    if url.startswith("postgresql://"):
        url = "postgresql+psycopg://" + url[len("postgresql://") :]
    return url


#: Execution option of the read-only engine view: on SQLite its transactions begin DEFERRED.
READ_ONLY = "specbatch_read_only"


def make_engine(url: str) -> Engine:
    """An engine with SQLite made fit for many writer threads (WAL, busy timeout, and
    ``BEGIN IMMEDIATE`` for writes so a read-then-write never dies on a lock upgrade; reads,
    through the ``READ_ONLY`` view, begin DEFERRED and never wait for the write lock)."""
    url = normalize_url(url)
    if make_url(url).get_backend_name() != "sqlite":
        return create_engine(url, pool_size=4, max_overflow=16, pool_timeout=120, pool_pre_ping=True,
                             json_serializer=json_text.dumps)
    engine = create_engine(url, pool_size=4, max_overflow=16, pool_timeout=120, json_serializer=json_text.dumps)

    @event.listens_for(engine, "connect")
    def _sqlite_pragmas(dbapi_conn, _record) -> None:  # pragma: no cover - trivial
        dbapi_conn.isolation_level = None  # we emit BEGIN ourselves below
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA busy_timeout = 30000")
        cur.execute("PRAGMA foreign_keys = ON")
        if make_url(url).database not in (None, "", ":memory:"):
            cur.execute("PRAGMA journal_mode = WAL")
            cur.execute("PRAGMA synchronous = NORMAL")
        cur.close()

    @event.listens_for(engine, "begin")
    def _sqlite_begin(conn) -> None:  # pragma: no cover - trivial
        read_only = conn.get_execution_options().get(READ_ONLY, False)
        conn.exec_driver_sql("BEGIN DEFERRED" if read_only else "BEGIN IMMEDIATE")

    return engine



class StoreBase:
    """A database connection: engine, read-only view, write transactions (SQLite's writers take
    turns on a lock) and group commit; the parts of ``Store`` add their queries to it."""

    def __init__(self, url: str, *, auto_upgrade: bool | None = None, group_commit: bool = False) -> None:
        """``group_commit``: claims and results of many threads share transactions (a worker)."""
        self.url = normalize_url(url)
        self.engine = make_engine(self.url)
        # SQLite: this process's writers queue on a lock before BEGIN IMMEDIATE (see _write).
        self._write_lock = threading.RLock() if make_url(self.url).get_backend_name() == "sqlite" else None
        self.reader = self.engine.execution_options(**{READ_ONLY: True})  # same pool, no write lock
        self.Session = sessionmaker(self.reader, expire_on_commit=False)
        self.dialect = self.engine.dialect.name
        if auto_upgrade is None:
            auto_upgrade = self.dialect == "sqlite" or settings().auto_migrate
        if auto_upgrade and not migrate.is_current(self.engine):
            self.upgrade()
        self._group = GroupCommit(self._write) if group_commit else None

    @contextmanager
    def _write(self) -> Iterator[Connection]:
        """A write transaction. On SQLite the threads of this process take turns on a lock
        first: SQLite's busy handler sleeps in growing steps (1, 2, 5, 10 … ms) and so wakes late,
        and with dozens of task threads writing results a job's claim waited behind them; a
        lock hands over at once. Other processes (a producer) still meet the busy handler."""
        if self._write_lock is None:
            with self.engine.begin() as conn:
                yield conn
            return
        with self._write_lock, self.engine.begin() as conn:
            yield conn

    def upgrade(self) -> None:
        migrate.upgrade(self.engine)

    def dispose(self) -> None:
        self.engine.dispose()

    def _insert(self, table):
        """The dialect's INSERT, which has ``on_conflict_do_update/nothing``."""
        if self.dialect == "postgresql":
            from sqlalchemy.dialects.postgresql import insert
        elif self.dialect == "sqlite":
            from sqlalchemy.dialects.sqlite import insert
        else:  # pragma: no cover
            raise NotImplementedError(f"upserts are implemented for sqlite and postgresql, not {self.dialect}")
        return insert(table)

    def _write_op(self, write: Callable[[Connection], T]) -> T:
        """``write(conn)`` in a write transaction: shared with other threads' writes when this
        store group-commits (a worker's claims and results: ``worker.store.group_commit``)."""
        if self._group is not None:
            return self._group.run(write)
        with self._write() as conn:
            return write(conn)

