"""Batches written the way ``specbatch run`` writes them, for tests that need jobs in a store.

Through the streaming ingest (``worker.ingest.stream.Ingest``), parsed in this process and with
nothing published (no pacer), so a test's rows are exactly what a producer stores: validated
lines, bad lines kept as failed jobs, duplicates caught, a batch reopened by name.
"""

from __future__ import annotations

import json
from typing import Any, Iterable

from worker.ingest.stream import Ingest, IngestResult
from worker.store.rows import INSERT_CHUNK
from worker.store.store import Store


def ingest_lines(store: Store, lines: Iterable[dict[str, Any] | str], *, name: str | None = None,
                 model: str = "m", queue: str = "q", retry_failed: bool = False,
                 chunk: int = INSERT_CHUNK, input_file: str | None = None) -> IngestResult:
    """Write ``lines`` (dicts are dumped as JSON; strings go in as they are) into a batch."""
    ingest = Ingest(store, model=model, queue_for=lambda _model, _priority: queue, priority=1,
                    retry_failed=retry_failed, chunk=chunk, first_chunk=chunk, parse_in_child=False)
    return ingest.run([line if isinstance(line, str) else json.dumps(line) for line in lines],
                      name=name, input_file=input_file)


def job_ids(store: Store, batch_id: str) -> list[str]:
    """A batch's job ids in input-line order."""
    return [job.id for job in store.jobs(batch_id)]
