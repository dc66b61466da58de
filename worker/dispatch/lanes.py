"""Priority lanes: a service's job is answered while a bulk run fills the same workers.

A job's ``priority`` is an integer (vLLM's meaning: lower is more urgent) or a lane name:
``interactive`` is 0, ``bulk`` is 1. Each model has two Redis queues: ``<queue>.interactive``
for priority <= 0 and ``<queue>`` itself for the bulk lane. Workers consume both, interactive
first (kombu's ``priority`` queue order), keep a reserve of task threads that bulk messages may
not take (see ``LaneGovernor``), and hand the priority to the engine, which schedules by
(priority, arrival), preempts bulk work for urgent work and keeps urgent prefixes cached longer.
"""

from __future__ import annotations

from typing import Any

INTERACTIVE, BULK = "interactive", "bulk"
LANE_PRIORITY = {INTERACTIVE: 0, BULK: 1}
MAX_PRIORITY = 1_000_000  # the engine's bound


def parse_priority(value: Any, default: str = BULK) -> int:
    """A job's engine priority from a lane name, an integer (or its string) or None (the default)."""
    if value is None:
        value = default
    if isinstance(value, str):
        name = value.strip().lower()
        if name in LANE_PRIORITY:
            return LANE_PRIORITY[name]
        try:
            value = int(name)
        except ValueError:
            raise ValueError(f"priority must be 'interactive', 'bulk' or an integer, got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"priority must be 'interactive', 'bulk' or an integer, got {value!r}")
    if abs(value) > MAX_PRIORITY:
        raise ValueError(f"priority must be within [-{MAX_PRIORITY}, {MAX_PRIORITY}], got {value}")
    return value


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
