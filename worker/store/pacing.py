"""The pacer's reads and writes (``worker.dispatch.pacer``): open batches, what each has in
flight, and its next unpublished jobs (by shared prompt prefix, then line order)."""

from __future__ import annotations

import time
from typing import Any

from sqlalchemy import Select, and_, func, literal, or_, select, update

from worker.store.connection import StoreBase
from worker.store.models import QUEUED, RUNNING, Batch, Job
from worker.store.rows import MESSAGE_FIELDS

#: A queued job not yet published, with 'queued' written into the SQL, not bound: PostgreSQL
#: matches its partial index's predicate only to constants, and a statement psycopg has
#: prepared (its fifth run on) gets a generic plan that knows no parameter's value (with a
#: bound one, the pacer's queries fell back to scanning the batch: tiny jobs 0.87x -> 0.64x).
UNPUBLISHED = and_(Job.status == literal(QUEUED, literal_execute=True), Job.published_at.is_(None))


def unpublished_select(batch_id: str, queue: str, limit: int) -> Select:
    """The batch's next ``limit`` unpublished queued jobs of ``queue``, prompts sharing a prefix
    together (``prefix_key``: ``worker.request.cache_key``), then in line order, as their
    messages need them (``MESSAGE_FIELDS``): an ordered index range on either database
    (migrations 0005, 0008). Published grouped, a bulk batch's rows behind one system prompt
    reach an engine together and share its KV blocks, instead of evicting each other's."""
    cols = [getattr(Job, f) for f in MESSAGE_FIELDS]
    return (select(*cols).where(Job.batch_id == batch_id, UNPUBLISHED, Job.queue == queue)
            .order_by(Job.prefix_key, Job.line_no).limit(limit))



class Pacing(StoreBase):
    """The pacer's side of the store."""

    def open_batches(self) -> list[tuple[str, int | None]]:
        """(id, max_in_flight) of batches not finished, oldest first: the pacer's round-robin."""
        with self.reader.connect() as conn:
            rows = conn.execute(
                select(Batch.id, Batch.max_in_flight).where(Batch.finished_at.is_(None)).order_by(Batch.created_at)
            ).all()
        return [(r.id, r.max_in_flight) for r in rows]

    def in_flight(self, batch_id: str) -> int:
        """Jobs of the batch published and not yet final (waiting in Redis, reserved or running)."""
        with self.reader.connect() as conn:
            return conn.execute(
                select(func.count()).select_from(Job).where(
                    Job.batch_id == batch_id,
                    or_(Job.status == RUNNING, and_(Job.status == QUEUED, Job.published_at.is_not(None),
                                                    Job.duplicate_of.is_(None))),
                )  # a held duplicate is not in flight: counted, it could fill the cap its first row waits on
            ).scalar_one()

    def take_unpublished(self, batch_id: str, queue: str, limit: int) -> list[dict[str, Any]]:
        """Mark the batch's next ``limit`` unpublished queued jobs of ``queue`` (``unpublished_select``'s order)
        published, and return them as their messages need them (``MESSAGE_FIELDS``). Empty when none are left."""
        with self.reader.connect() as conn:
            rows = conn.execute(unpublished_select(batch_id, queue, limit)).mappings().all()
        if rows:
            with self._write() as conn:
                conn.execute(update(Job).where(Job.id.in_([r["id"] for r in rows]), Job.published_at.is_(None))
                             .values(published_at=time.time()))
        return [dict(r) for r in rows]

    def has_unpublished(self, batch_id: str) -> bool:
        with self.reader.connect() as conn:
            return conn.execute(
                select(Job.id).where(Job.batch_id == batch_id, UNPUBLISHED).limit(1)
            ).first() is not None

