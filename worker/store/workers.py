"""The workers table: each worker process's start, state, beats and exit, for ``status``."""

from __future__ import annotations

import time
from typing import Any

from sqlalchemy import case, func, select, update

from worker.store.connection import StoreBase
from worker.store.models import RUNNING, W_EXITED, W_FAILED, W_STARTING, W_STOPPED, Job, Worker


class WorkerRegistry(StoreBase):
    """Worker processes as ``status`` shows them."""

    def worker_starting(self, name: str, **info: Any) -> None:
        """Record a worker process starting (a restart of the same name counts up ``starts``)."""
        now = time.time()
        with self._write() as conn:
            found = conn.execute(select(Worker.name).where(Worker.name == name)).first()
            values = dict(info, state=W_STARTING, error=None, started_at=now, heartbeat_at=now, stopped_at=None,
                          exit_code=None)
            if found is None:
                conn.execute(self._insert(Worker).values(name=name, starts=1, failures=0, **values))
            else:
                conn.execute(update(Worker).where(Worker.name == name).values(starts=Worker.starts + 1, **values))

    def worker_state(self, name: str, state: str, error: str | None = None) -> None:
        now = time.time()
        values: dict[str, Any] = dict(state=state, heartbeat_at=now)
        if error is not None:
            values["error"] = error
        if state in (W_STOPPED, W_FAILED):
            values["stopped_at"] = now
        if state == W_FAILED:
            values["failures"] = Worker.failures + 1
        with self._write() as conn:
            conn.execute(update(Worker).where(Worker.name == name).values(**values))

    def worker_exited(self, name: str, code: int, error: str | None = None) -> None:
        """The process is leaving with ``code``: ``status`` shows ``exited N`` from now on. A
        non-zero exit counts as a failure unless the state already said ``failed``."""
        now = time.time()
        values: dict[str, Any] = dict(state=W_EXITED, exit_code=code, heartbeat_at=now, stopped_at=now)
        if error is not None:
            values["error"] = error
        if code != 0:
            values["failures"] = Worker.failures + case((Worker.state == W_FAILED, 0), else_=1)
        with self._write() as conn:
            conn.execute(update(Worker).where(Worker.name == name).values(**values))

    def worker_beat(self, name: str) -> None:
        with self._write() as conn:
            conn.execute(update(Worker).where(Worker.name == name).values(heartbeat_at=time.time()))

    def workers(self) -> list[Worker]:
        with self.Session() as s:
            return list(s.scalars(select(Worker).order_by(Worker.name)))

    def running_counts_by_worker(self) -> dict[str, int]:
        with self.reader.connect() as conn:
            rows = conn.execute(select(Job.worker, func.count()).where(Job.status == RUNNING).group_by(Job.worker))
            return {w: n for w, n in rows if w}

