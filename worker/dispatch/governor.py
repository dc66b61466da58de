"""Keep a reserve of task threads for the interactive lane.

Celery reserves at most ``concurrency`` messages per worker (``acks_late``, prefetch 1), from
all its queues together. A bulk run would take every one of them, and an interactive message
would then wait in Redis until some bulk job finished. The governor stops consuming the bulk
queue while the bulk messages this worker holds reach ``concurrency - reserve``, and resumes
once they fall back below, so ``reserve`` threads are always free to take interactive work at
once. It runs in the consumer's thread: on every received message (Celery's ``task_received``)
and on a short timer, and it cancels and re-adds only the kombu consumer of the bulk queue (the
queue stays advertised to ``inspect active_queues`` and Flower).

It also stops every lane for good when the process can take no more work (its engine died,
``stop_taking_messages``): a dying worker that kept consuming handed each message back to
itself hundreds of times a second until it exited, and took new ones it could only hand back.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from celery import bootsteps, signals
from celery.worker import state

from worker.common.config import settings
from worker.request.priority import INTERACTIVE

log = logging.getLogger(__name__)


def _reserve_setting() -> int | None:
    """``SPECBATCH_INTERACTIVE_RESERVE`` when set: the reserve whatever the concurrency."""
    value = settings().interactive_reserve
    return None if value is None else max(0, value)


def interactive_reserve_for(bulk_threads: int) -> int:
    """The reserve to add on top of ``bulk_threads`` (default 1/8 of them, at least one)."""
    setting = _reserve_setting()
    return setting if setting is not None else (max(1, bulk_threads // 8) if bulk_threads > 0 else 0)


def interactive_reserve(concurrency: int) -> int:
    """Task threads bulk work may not take out of ``concurrency``: the inverse of
    ``interactive_reserve_for`` (default 1/9 of them), so the default concurrency, 2 x
    max-num-seqs plus a reserve of 1/8 of that, leaves bulk work exactly 2 x max-num-seqs."""
    setting = _reserve_setting()
    reserve = setting if setting is not None else (max(1, concurrency // 9) if concurrency > 1 else 0)
    return min(reserve, max(0, concurrency - 1))


class LaneGovernor(bootsteps.StartStopStep):
    """A consumer bootstep (``app.steps["consumer"].add(LaneGovernor)``)."""

    requires = {"celery.worker.consumer.tasks:Tasks"}

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        self.consumer = None
        self.paused: dict[str, Any] = {}  # bulk queue name -> its kombu Queue, while paused
        self.cap = 0
        self.timer = None

    def start(self, c: Any) -> None:
        self.consumer = c
        concurrency = c.controller.concurrency if c.controller is not None else c.pool.num_processes
        self.cap = concurrency - interactive_reserve(concurrency)
        _governors.append(self)
        self.timer = c.timer.call_repeatedly(0.1, self.check)

    def stop(self, c: Any) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self in _governors:
            _governors.remove(self)
        self.paused.clear()
        self.consumer = None

    def bulk_queues(self) -> list[Any]:
        task_consumer = getattr(self.consumer, "task_consumer", None)
        if task_consumer is None:
            return []
        return [q for q in task_consumer.queues if not q.name.endswith(f".{INTERACTIVE}")]

    def held(self, names: set[str], pending: Any = None) -> int:
        """Bulk messages this worker holds (reserved: waiting for or running in a thread), plus
        ``pending``, a request just received and not yet counted as reserved."""
        reserved = tuple(state.reserved_requests)
        count = sum(1 for r in reserved if _routing_key(r) in names)
        if pending is not None and pending not in reserved and _routing_key(pending) in names:
            count += 1
        return count

    def check(self, pending: Any = None) -> None:
        """Pause or resume the bulk lane. Never raises: it runs inside the consumer's event loop
        (a timer or a message callback), where an exception would stop the worker; with the
        broker away it does nothing, and Celery's reconnect starts every queue afresh."""
        try:
            self._check(pending)
        except Exception as exc:
            log.debug("lane governor skipped a check: %r", exc)

    def _check(self, pending: Any = None) -> None:
        c = self.consumer
        task_consumer = getattr(c, "task_consumer", None)
        if task_consumer is None:
            return
        if _stopped.is_set():
            for queue in list(task_consumer.queues):
                task_consumer.cancel_by_queue(queue.name)
            self.paused.clear()
            return
        names = {q.name for q in self.bulk_queues()} | set(self.paused)
        if not names:
            return
        held = self.held(names, pending)
        if held >= self.cap and not self.paused:
            for queue in self.bulk_queues():
                self.paused[queue.name] = queue
                task_consumer.cancel_by_queue(queue.name)
            log.debug("bulk lane paused: %d bulk messages held (cap %d)", held, self.cap)
        elif held < self.cap and self.paused:
            for name, queue in list(self.paused.items()):
                task_consumer.add_queue(queue)
                del self.paused[name]
            task_consumer.consume()
            log.debug("bulk lane resumed: %d bulk messages held (cap %d)", held, self.cap)


_governors: list[LaneGovernor] = []
_stopped = threading.Event()  # this process takes no more messages (``stop_taking_messages``)


def stop_taking_messages() -> None:
    """Cancel every lane's consumer at the governor's next check (within 0.1 s, in the
    consumer's thread, where kombu's consumer may be touched): the messages this process
    reserved still run (and are handed back), no new one arrives."""
    _stopped.set()


def holding_messages() -> int:
    """Messages this process has reserved and not yet acked (waiting for or running in a thread)."""
    return len(state.reserved_requests)


def _routing_key(request: Any) -> str | None:
    return (getattr(request, "delivery_info", None) or {}).get("routing_key")


@signals.task_received.connect
def _on_received(sender=None, request=None, **_: Any) -> None:
    """Each received message: pause the bulk lane the moment it reaches its cap."""
    for governor in list(_governors):
        if governor.consumer is sender:
            governor.check(pending=request)
