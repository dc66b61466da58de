"""The pacer: batches reach Redis a window at a time, round-robin, under their in-flight caps.

A batch's jobs are written to the store unpublished. Each worker process runs one pacer (and
the producer runs one tick right after writing a batch): whenever a queue holds fewer than
``window`` waiting messages, it tops the queue up (a message may carry several short jobs:
``worker.dispatch.publish.job_groups``), taking an equal share from every open batch
that has unpublished jobs (in line order), so two bulk runs progress together instead of one
after the other, and never more of a batch than its ``max_in_flight`` allows. Redis therefore
holds a bounded window, not every prompt of a million-line file, and the store stays the one
source of truth: a published job whose message is lost is still found by the orphan sweep.
One pacer per queue at a time (a Redis lock); a duplicate message would be harmless anyway.
"""

from __future__ import annotations

from typing import Any

from worker.common.config import settings
from worker.dispatch.publish import generation_budget, group_jobs, group_tokens, job_groups, publish_groups
from worker.common.periodic import PeriodicThread

#: Every this many ticks the pacer also closes drained batches (a few queries per open batch).
CLOSE_EVERY_TICKS = 20


def pacing_window() -> int:
    return settings().pacing_window


def pacing_seconds() -> float:
    return settings().pacing_seconds


class Pacer(PeriodicThread):
    def __init__(self, store: Any, app: Any, queues: list[str], *, owner: str = "producer",
                 window: int | None = None, interval: float | None = None) -> None:
        self.store = store
        self.app = app
        self.queues = list(queues)
        self.owner = owner
        self.window = pacing_window() if window is None else window
        self.interval = pacing_seconds() if interval is None else interval
        self._turn = 0  # rotates which batch is served first when shares do not divide evenly
        self._per_message: dict[str, int] = {}  # batch id -> jobs a message of it carries, as last seen
        self._ticks = 0  # ticks that succeeded, for closing drained batches every CLOSE_EVERY_TICKS
        super().__init__("specbatch-pacer", self.interval, self._tick_and_close)

    def _tick_and_close(self) -> None:
        self.tick()
        self._ticks += 1
        if self._ticks % CLOSE_EVERY_TICKS == 0:
            self.close_drained()

    def tick(self) -> int:
        """Top up every queue once; returns how many jobs were published."""
        batches = self.store.open_batches()
        open_ids = {batch_id for batch_id, _cap in batches}
        self._per_message = {b: k for b, k in self._per_message.items() if b in open_ids}
        if not batches:
            return 0
        published = 0
        with self.app.connection_for_write() as conn:
            client = conn.default_channel.client
            for queue in self.queues:
                lock = f"specbatch:pace:{queue}"
                if not client.set(lock, self.owner, nx=True, px=max(1000, int(self.interval * 4000))):
                    continue  # another pacer is topping this queue up
                try:
                    published += self._top_up(queue, client.llen(queue), batches)
                finally:
                    if client.get(lock) == self.owner.encode():
                        client.delete(lock)
        return published

    def _top_up(self, queue: str, waiting: int, batches: list[tuple[str, int | None]]) -> int:
        """Publish up to ``window - waiting`` messages; a message may carry several short jobs
        (``job_groups``), so each batch is asked for as many jobs as a message of it carries."""
        room = self.window - waiting
        if room <= 0:
            return 0
        queue_of = lambda row: row.get("queue") or queue  # noqa: E731
        self._turn = (self._turn + 1) % len(batches)
        active = batches[self._turn:] + batches[: self._turn]
        groups: list[list[dict[str, Any]]] = []
        # Equal shares; a batch with fewer left (or at its cap) leaves the rest of its share to others.
        while room > 0 and active:
            share = max(1, room // len(active))
            still: list[tuple[str, int | None]] = []
            for batch_id, cap in active:
                per_message = self._per_message.get(batch_id, 1)
                take = min(share, room) * per_message
                if cap is not None:
                    take = min(take, cap - self.store.in_flight(batch_id))
                got = self.store.take_unpublished(batch_id, queue, take) if take > 0 else []
                if got:
                    got_groups = job_groups(got, queue_of)
                    groups += got_groups
                    room -= len(got_groups)
                    # A batch's lines are mostly alike: its next messages carry as many as its last line's would.
                    self._per_message[batch_id] = max(1, min(group_jobs(), group_tokens() // generation_budget(got[-1])))
                if got and len(got) == take:
                    still.append((batch_id, cap))  # it may have more
                if room <= 0:
                    break
            active = still
        return publish_groups(self.app, groups, queue_of)

    def close_drained(self) -> None:
        """Mark batches with nothing left to run as finished (they leave the round-robin)."""
        for batch_id, _cap in self.store.open_batches():
            if not self.store.has_unpublished(batch_id):
                counts = self.store.batch_counts(batch_id)
                if counts["queued"] == 0 and counts["running"] == 0:
                    self.store.refresh_batch(batch_id)
