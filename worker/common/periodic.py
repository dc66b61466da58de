"""A daemon thread that calls one function every few seconds until stopped.

The pacer, the reaper and the heartbeat each run beside the Celery worker on a timer of their
own. They share this loop so that the parts that must not differ between them do not: a tick
that raises (the database or Redis is away, the usual case) is logged and the loop goes on,
since a maintenance thread that died on an outage would leave leases unrefreshed, expired jobs
unreaped or queues unfilled for the rest of the process's life; and ``stop`` returns promptly,
because the wait between ticks is an ``Event`` and not a sleep.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable, TypeVar

log = logging.getLogger(__name__)
P = TypeVar("P", bound="PeriodicThread")


class PeriodicThread:
    """Call ``tick`` every ``interval`` seconds on a daemon thread named ``name``. The pacer, the
    reaper and the heartbeat are such threads (subclasses), so their ``start``/``stop`` are these.

    ``first_now``: tick once as soon as the thread starts (the pacer and the reaper: a worker
    starting fills its queues and sweeps at once), else wait an interval first (the heartbeat:
    leases were just written by the claims it refreshes).
    """

    def __init__(self, name: str, interval: float, tick: Callable[[], object], *, first_now: bool = True) -> None:
        self.name = name
        self.interval = interval
        self._tick = tick
        self._first_now = first_now
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self: P) -> P:
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Stop ticking; wait up to ``timeout`` for a tick in progress (not from the tick itself)."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _run(self) -> None:
        if not self._first_now and self._stop.wait(self.interval):
            return
        while not self._stop.is_set():
            try:
                self._tick()
            except Exception:  # the database or the broker is away: try again next interval
                log.warning("%s: tick failed", self.name, exc_info=True)
            if self._stop.wait(self.interval):
                return
