"""The scheduler's waiting queue: ordered by (priority, arrival) with aging, and the order in
which the scheduler tries its head for admission (longest cached prefix first, with aging).

Queue order. vLLM's ``scheduling_policy="priority"``: a lower ``priority`` value is served
first, ties in arrival order. Aging keeps a low-priority request from starving: its place is
fixed when it arrives, at ``arrival_step + priority * aging_steps``, so a request of priority 1
is overtaken only by priority-0 requests that arrive less than ``aging_steps`` steps after it;
whatever arrives later queues behind it. The key never changes while a sequence waits, so the
queue is a sorted list (insert by bisection) rather than a heap re-sorted every step. With
``policy="fcfs"`` every key is the arrival order and the queue is plain FIFO.

Admission order (``admission="prefix"``, SGLang's longest-prefix-match policy; vLLM has only
the queue order, which ``admission="fifo"`` keeps exactly). Each step the scheduler tries the
first ``PREFIX_WINDOW`` waiting sequences (so a long queue never costs a full scan) in this
order. Equally urgent sequences are a *run*: consecutive sequences of the queue with the same
``priority`` (under ``fcfs``, the whole window). Runs keep their queue order, so reordering
never moves a sequence past one of another priority and priorities with their aging decide
exactly as before. Within a run, the sequence with the longest cached prefix (prompt tokens, or
prompt + output after a preemption, already in the prefix cache; a sibling counts what it would
share with its leader) goes first, ties in queue order: it costs the fewest new tokens and
blocks, and it takes its prefix before the prefix is evicted. A sequence is *passed over* when
one behind it in the queue is admitted before it; from the step that first happens it may be
passed over for ``prefix_aging_steps`` steps, after which it is *overdue*: overdue sequences go
first in their run, in queue order, so it is admitted like under FIFO from then on. The clock
starts at the first pass-over, not at arrival: a bulk job submits thousands of requests at once,
and a clock from arrival would turn its whole queue back to FIFO after ``prefix_aging_steps``.
"""

from __future__ import annotations

import bisect
from collections import Counter
from typing import Callable, Iterator

from engine.sequence import Sequence

POLICIES = ("fcfs", "priority")
ADMISSIONS = ("prefix", "fifo")

#: Waiting sequences (from the queue's head) the prefix order ranks per step: ranking reads the
#: prefix cache for each, and the head is where the next admissions come from anyway.
PREFIX_WINDOW = 256


class WaitingQueue:
    """Sequences waiting to be (re)admitted, lowest key first."""

    def __init__(self, policy: str = "fcfs", aging_steps: int = 1000, *, admission: str = "prefix",
                 prefix_aging_steps: int = 64) -> None:
        if policy not in POLICIES:
            raise ValueError(f"scheduling_policy must be one of {POLICIES}, got {policy!r}")
        if admission not in ADMISSIONS:
            raise ValueError(f"admission must be one of {ADMISSIONS}, got {admission!r}")
        self.policy = policy
        self.aging_steps = aging_steps
        self.admission = admission
        self.prefix_aging_steps = prefix_aging_steps
        self._keys: list[tuple[int, int, int]] = []
        self._seqs: list[Sequence] = []
        self._priorities: Counter[int] = Counter()
        self._passed_since: dict[int, int] = {}  # seq_id -> step it was first passed over
        self.num_inserts = 0  # bumped by every insert: an admission order built before is stale

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
        self.num_inserts += 1

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
        self._passed_since.pop(seq.seq_id, None)  # back in the queue later, its clock starts anew

    def best_priority(self) -> int | None:
        """The most urgent priority among waiting sequences (None when empty)."""
        return min(self._priorities) if self._priorities else None

    # admission order --------------------------------------------------------------------------
    def admission_order(self, now: int, exclude: set[int], cached_tokens: Callable[[Sequence], int]) -> list[Sequence]:
        """The first ``PREFIX_WINDOW`` sequences not in ``exclude`` (seq ids), in the order to try
        them at step ``now`` (the module docstring gives the rule); ``cached_tokens(seq)`` is how
        many of its tokens it would start with computed."""
        window: list[Sequence] = []
        for seq in self._seqs:
            if seq.seq_id not in exclude:
                window.append(seq)
                if len(window) == PREFIX_WINDOW:
                    break
        if self.admission == "fifo":
            return window
        order: list[Sequence] = []
        for run in self._runs(window):
            order += run if len(run) == 1 else self._rank(run, now, cached_tokens)
        return order

    def _runs(self, window: list[Sequence]) -> Iterator[list[Sequence]]:
        """Consecutive sequences of equal urgency: the same priority (all of them under fcfs)."""
        if self.policy == "fcfs":
            yield window
            return
        run: list[Sequence] = []
        for seq in window:
            if run and seq.request.priority != run[0].request.priority:
                yield run
                run = []
            run.append(seq)
        if run:
            yield run

    def _rank(self, run: list[Sequence], now: int, cached_tokens: Callable[[Sequence], int]) -> list[Sequence]:
        """Overdue sequences first in queue order, then the longest cached prefix, ties in queue order."""
        def rank(item: tuple[int, Sequence]) -> tuple[int, int, int]:
            at, seq = item
            if self.is_overdue(seq, now):
                return (0, 0, at)
            return (1, -cached_tokens(seq), at)

        return [seq for _at, seq in sorted(enumerate(run), key=rank)]

    def is_overdue(self, seq: Sequence, now: int) -> bool:
        """Passed over in ``prefix_aging_steps`` steps already: it goes in queue order now."""
        since = self._passed_since.get(seq.seq_id)
        return since is not None and now - since >= self.prefix_aging_steps

    def note_admitted(self, admitted: list[Sequence], now: int) -> None:
        """After a step's admissions: start the clock of every sequence still waiting ahead (in
        queue order) of one admitted at step ``now``, unless it runs already."""
        if self.admission == "fifo" or not admitted:
            return
        last = max(self.key(seq) for seq in admitted)
        for key, seq in zip(self._keys, self._seqs):
            if key >= last:
                break
            self._passed_since.setdefault(seq.seq_id, now)

    def passed_since(self, seq: Sequence) -> int | None:
        """The step ``seq`` was first passed over in (None if it never was while waiting)."""
        return self._passed_since.get(seq.seq_id)

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
