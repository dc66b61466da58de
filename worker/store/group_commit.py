"""Group commit: the claims and results of a worker's task threads, many per transaction.

Why: each task thread wrote its claim and its result in a transaction of its own, and on SQLite
the process's writers take turns on one lock (``Store._write``), so with one-token jobs the
store, not the engine, set the pace: every job paid two lock hand-overs, two BEGIN/COMMITs and
two connection check-outs between its message and its ack. Here one writer thread takes every
write waiting, runs them in one transaction and commits once; each caller gets its own answer
only after that commit, so a claim is durable before its job runs, as before.

A write that raises rolls the shared transaction back; the writer then runs each write of that
group in a transaction of its own, so one bad write fails alone. A commit that fails (the
database is away) fails every write of the group; callers retry as they always did
(``worker.store.dbretry``).
"""

from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable, TypeVar

from sqlalchemy.engine import Connection

log = logging.getLogger(__name__)
T = TypeVar("T")

#: The most writes one transaction takes (a bound on how long the lock is held).
MAX_GROUP = 256


class GroupCommit:
    """``run(write)`` from any thread: ``write(conn)`` runs in a shared transaction, then returns."""

    def __init__(self, begin: Callable[[], Any], *, max_group: int = MAX_GROUP) -> None:
        self._begin = begin  # a context manager factory yielding a Connection in a write transaction
        self._max_group = max_group
        self._queue: queue.SimpleQueue[tuple[Callable[[Connection], Any], Future] | None] = queue.SimpleQueue()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="specbatch-group-commit", daemon=True)
        self._thread.start()
        self.groups = 0  # transactions committed, and the writes they held: the batching achieved
        self.writes = 0

    def run(self, write: Callable[[Connection], T]) -> T:
        if self._stopped:
            with self._begin() as conn:
                return write(conn)
        future: Future = Future()
        self._queue.put((write, future))
        return future.result()

    def stop(self) -> None:
        self._stopped = True
        self._queue.put(None)
        self._thread.join(timeout=10.0)

    def _take_group(self) -> list[tuple[Callable[[Connection], Any], Future]] | None:
        first = self._queue.get()
        if first is None:
            return None
        group = [first]
        while len(group) < self._max_group:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is None:
                self._queue.put(None)  # stop after this group
                break
            group.append(item)
        return group

    def _run(self) -> None:
        while True:
            group = self._take_group()
            if group is None:
                return
            try:
                self._commit_group(group)
            except BaseException:  # never leave a caller waiting
                log.exception("group commit failed")
                for _write, future in group:
                    if not future.done():
                        future.set_exception(RuntimeError("group commit failed"))

    def _commit_group(self, group: list[tuple[Callable[[Connection], Any], Future]]) -> None:
        results: list[Any] = []
        try:
            with self._begin() as conn:
                for write, _future in group:
                    results.append(write(conn))
        except Exception as exc:
            if len(group) == 1:
                group[0][1].set_exception(exc)
                return
            for write, future in group:  # one at a time: a bad write fails alone
                try:
                    with self._begin() as conn:
                        future.set_result(write(conn))
                except Exception as own:
                    future.set_exception(own)
            return
        self.groups += 1
        self.writes += len(group)
        for (_write, future), result in zip(group, results):
            future.set_result(result)
