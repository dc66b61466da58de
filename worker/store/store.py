"""The store: jobs and batches in SQL, written idempotently.

Delivery is at least once (``acks_late`` + Redis redelivery), so every write here is safe to
repeat: unique job ids and ``(batch_id, custom_id)``, dialect upserts, and *attempt fencing*:
a worker claims a job by bumping ``attempts`` with a compare-and-swap and every later write
names that attempt, so a stale or duplicate copy can never overwrite a newer result.
Every public method opens its own short transaction, so one ``Store`` is safe to share
across threads (Sessions never are).

``Store`` is one object made of parts by concern, each its own module: the connection
(``connection``), what a row is (``rows``), the producer's writes (``ingest_writes``), a
worker's attempts (``leases``), recovery of lost leases and messages (``recovery``), the pacer's
queries (``pacing``), the workers table (``workers``), reads (``reads``) and the result cache
with duplicates computed once (``results_cache``).
"""

from __future__ import annotations

from worker.store.ingest_writes import IngestWrites
from worker.store.leases import Leases
from worker.store.pacing import Pacing
from worker.store.reads import Reads
from worker.store.recovery import Recovery
from worker.store.results_cache import ResultCache
from worker.store.workers import WorkerRegistry


class Store(IngestWrites, Leases, Recovery, Pacing, WorkerRegistry, Reads, ResultCache):
    """Jobs, batches and workers in SQL (SQLite or PostgreSQL): one per process, shared by its threads."""
