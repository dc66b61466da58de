"""Waiting out a database outage: store calls retried with backoff while it is unreachable.

Workers hold a finished result in memory (its message unacked) until it is written; producers
wait for the database to come back rather than drop a submission.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, TypeVar

from sqlalchemy.exc import InterfaceError, OperationalError

from worker.common.config import settings

log = logging.getLogger(__name__)
T = TypeVar("T")


def db_retry_seconds() -> float:
    """How long a task keeps retrying the database (its message stays unacked meanwhile)."""
    return settings().db_retry_seconds


def with_db_retry(what: str, fn: Callable[[], T], *, until_written: bool = False) -> T:
    """Run a store call, retrying with backoff while the database is unreachable. A finished
    result waits here, in memory, until it is written: the message is acked only after.

    ``until_written``: no deadline. For the writes that end an attempt this worker holds (a
    result, a give-back): given up after ``DB_RETRY_SECONDS`` the job stayed ``running``, its
    lease expired and the reaper re-ran it, an attempt charged to a job for a database outage.
    Waiting keeps the attempt's lease tracked, refreshed as soon as the database is back."""
    deadline = float("inf") if until_written else time.monotonic() + db_retry_seconds()
    delay = 0.2
    while True:
        try:
            return fn()
        except (OperationalError, InterfaceError) as exc:
            if time.monotonic() > deadline:
                raise
            log.warning("%s: database unreachable (%s); retrying in %.1f s", what, type(exc).__name__, delay)
            time.sleep(delay)
            delay = min(delay * 2, 5.0)
