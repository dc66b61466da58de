"""The scheduler's waiting queue, ordered by (priority, arrival) with aging.

vLLM's ``scheduling_policy="priority"``: a lower ``priority`` value is served first, ties in
arrival order. Aging keeps a low-priority request from starving: its place is fixed when it
arrives, at ``arrival_step + priority * aging_steps``, so a request of priority 1 is overtaken
only by priority-0 requests that arrive less than ``aging_steps`` steps after it; whatever
arrives later queues behind it. The key never changes while a sequence waits, so the queue is a
sorted list (insert by bisection) rather than a heap re-sorted every step. With
``policy="fcfs"`` every key is the arrival order and the queue is plain FIFO.
"""

from __future__ import annotations

import bisect
from collections import Counter
from typing import Iterator

from engine.sequence import Sequence

POLICIES = ("fcfs", "priority")


class WaitingQueue:
    """Sequences waiting to be (re)admitted, lowest key first."""

    def __init__(self, policy: str = "fcfs", aging_steps: int = 1000) -> None:
        if policy not in POLICIES:
            raise ValueError(f"scheduling_policy must be one of {POLICIES}, got {policy!r}")
        self.policy = policy
        self.aging_steps = aging_steps
        self._keys: list[tuple[int, int, int]] = []
        self._seqs: list[Sequence] = []
        self._priorities: Counter[int] = Counter()

    def key(self, seq: Sequence) -> tuple[int, int, int]:
        request = seq.request
        place = 0 if self.policy == "fcfs" else request.arrival_step + request.priority * self.aging_steps
        return (place, request.arrival_order, seq.index)

    # deque-like interface (the scheduler and step recovery use these) ---------------------
    def append(self, seq: Sequence) -> None:
        """Insert ``seq`` at its place (a preempted sequence returns to where it arrived)."""
        key = self.key(seq)
        at = bisect.bisect_right(self._keys, key)
        self._keys.insert(at, key)
        self._seqs.insert(at, seq)
        self._priorities[seq.request.priority] += 1

    appendleft = append  # order is by key: "back at the front" is where its key puts it

    def popleft(self) -> Sequence:
        self._keys.pop(0)
        seq = self._seqs.pop(0)
        self._forget(seq)
        return seq

    def remove(self, seq: Sequence) -> None:
        at = self._seqs.index(seq)
        del self._keys[at]
        del self._seqs[at]
        self._forget(seq)

    def _forget(self, seq: Sequence) -> None:
        priority = seq.request.priority
        self._priorities[priority] -= 1
        if not self._priorities[priority]:
            del self._priorities[priority]

    def best_priority(self) -> int | None:
        """The most urgent priority among waiting sequences (None when empty)."""
        return min(self._priorities) if self._priorities else None

    def __getitem__(self, i: int) -> Sequence:
        return self._seqs[i]

    def __len__(self) -> int:
        return len(self._seqs)

    def __bool__(self) -> bool:
        return bool(self._seqs)

    def __iter__(self) -> Iterator[Sequence]:
        return iter(list(self._seqs))

    def __contains__(self, seq: object) -> bool:
        return seq in self._seqs
