"""Priority lanes: a service's job is answered while a bulk run fills the same workers.

A job's ``priority`` is an integer (vLLM's meaning: lower is more urgent) or a lane name:
``interactive`` is 0, ``bulk`` is 1. Each model has two Redis queues: ``<queue>.interactive``
for priority <= 0 and ``<queue>`` itself for the bulk lane. Workers consume both, interactive
first (kombu's ``priority`` queue order), keep a reserve of task threads that bulk messages may
not take (see ``LaneGovernor``), and hand the priority to the engine, which schedules by
(priority, arrival), preempts bulk work for urgent work and keeps urgent prefixes cached longer.
"""

from __future__ import annotations

from worker.request.priority import BULK, INTERACTIVE


def lane_of(priority: int) -> str:
    return INTERACTIVE if priority <= 0 else BULK


def lane_queue(base: str, priority: int) -> str:
    """The Redis queue of a job: ``<base>.interactive`` for urgent jobs, ``<base>`` for bulk."""
    return f"{base}.{INTERACTIVE}" if lane_of(priority) == INTERACTIVE else base


def lane_queues(base: str) -> list[str]:
    """The queues a worker of ``base`` consumes, most urgent first."""
    return [f"{base}.{INTERACTIVE}", base]


def base_queue(queue: str) -> str:
    suffix = f".{INTERACTIVE}"
    return queue[: -len(suffix)] if queue.endswith(suffix) else queue
