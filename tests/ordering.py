"""The suite's order: tests that mostly wait start first, spread over pytest-xdist's processes.

A test that waits out an outage or a restart (``@pytest.mark.waits(seconds)``) costs little CPU,
so it is free while other tests keep the cores busy, and pure waste at the end of the run: the
last run before this order ended with two 130-s Redis restart tests on an otherwise idle
machine (1,072 s, where the other processes were done at 830 s).

Work stealing (``--dist worksteal``) first hands each process one contiguous share of the
collection (the first ``n // k`` items, then a half of the rest, ...), which it runs from the
front; idle processes steal from the back of the others'. So each share here begins with its
waiting tests (spread by their declared seconds, longest first) and continues with a
contiguous run of the other tests in their own order, which keeps module fixtures together.
"""

from __future__ import annotations

from typing import Any


def _waits(item: Any) -> float | None:
    marker = item.get_closest_marker("waits")
    if marker is None:
        return None
    return float(marker.args[0] if marker.args else marker.kwargs.get("seconds", 60))


def share_sizes(total: int, processes: int) -> list[int]:
    """The sizes of work stealing's first shares (``len(pending) // nodes_remaining`` each)."""
    sizes, left = [], total
    for remaining in range(processes, 0, -1):
        sizes.append(left // remaining)
        left -= sizes[-1]
    return sizes


def waiting_tests_first(items: list[Any], processes: int) -> list[Any]:
    """``items`` in an order whose shares each start with their waiting tests (see above)."""
    waiting = sorted((item for item in items if _waits(item) is not None), key=lambda item: -_waits(item))
    if not waiting:
        return items
    processes = max(1, processes)
    sizes = share_sizes(len(items), processes)
    heads: list[list[Any]] = [[] for _ in range(processes)]
    loads = [0.0] * processes
    for item in waiting:  # the longest first, each to the least loaded share with room
        open_shares = [k for k in range(processes) if len(heads[k]) < sizes[k]] or list(range(processes))
        k = min(open_shares, key=lambda k: loads[k])
        heads[k].append(item)
        loads[k] += _waits(item)
    waiting_ids = {id(item) for item in waiting}
    rest = iter([item for item in items if id(item) not in waiting_ids])
    ordered: list[Any] = []
    for k in range(processes):
        ordered += heads[k]
        ordered += [next(rest) for _ in range(max(0, sizes[k] - len(heads[k])))]
    ordered += list(rest)
    return ordered
