"""What the engine does when a step raises: recompute, isolate, and fail only the culprit.

One exception inside a forward used to fail every request of that step. Now the step's
requests are recomputed, like a preemption (their KV blocks are freed and their tokens so far
are kept), and held apart as *suspects*. Suspects are then probed one at a time: each runs
alone until its prefill is recomputed and it has sampled a token, then rejoins the batch. A
request that fails while it runs alone is the poison: after ``max_failures`` such failures it
fails with the error, and the others finish. The running batch keeps going between probes.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import TYPE_CHECKING

from engine.scheduler import Scheduler, SchedulerOutput, reset_for_recompute
from engine.sequence import Request, Sequence

if TYPE_CHECKING:
    from engine.block_manager import BlockManager

log = logging.getLogger(__name__)


class StepRecovery:
    def __init__(self, scheduler: Scheduler, block_manager: "BlockManager", max_failures: int = 2) -> None:
        self.scheduler = scheduler
        self.block_manager = block_manager
        self.max_failures = max_failures
        self.suspects: deque[Request] = deque()
        self.probing: Request | None = None
        self._probe: Scheduler | None = None  # a scheduler over the probed request alone
        self.failures: dict[str, int] = {}  # request id -> failed steps it ran alone in

    # ------------------------------------------------------------------ state
    def has_work(self) -> bool:
        return bool(self.suspects) or self.probing is not None

    def discard(self, seq: Sequence) -> None:
        """A sequence finished or was aborted: forget it (its blocks are freed by the caller)."""
        request = seq.request
        if self._probe is not None and self.probing is request:
            if seq in self._probe.running:
                self._probe.running.remove(seq)
            elif seq in self._probe.waiting:
                self._probe.waiting.remove(seq)
            if request.is_finished:
                self._end_probe()
        elif request.is_finished and request in self.suspects:
            self.suspects.remove(request)
        if request.is_finished:
            self.failures.pop(request.request_id, None)

    # ---------------------------------------------------------------- failure
    def on_failure(self, requests: list[Request], error: str) -> list[Request]:
        """Recompute the failed step's requests; return those to fail now (the poison)."""
        alone = len(requests) == 1
        doomed: list[Request] = []
        for request in requests:
            if alone:
                count = self.failures[request.request_id] = self.failures.get(request.request_id, 0) + 1
                if count >= self.max_failures:
                    doomed.append(request)
                    log.warning("request %s failed %d times alone: %s", request.request_id, count, error)
                    continue
            self._recompute(request)
            if request is not self.probing and request not in self.suspects:
                # A lone failure is retried first; a shared one waits its turn to run alone.
                (self.suspects.appendleft if alone else self.suspects.append)(request)
        if self.probing is not None and self.probing in doomed:
            self._end_probe()
        return doomed

    def _recompute(self, request: Request) -> None:
        """Free the request's KV and make its sequences wait outside the scheduler."""
        scheduler = self.scheduler
        request.metrics.num_preemptions += 1  # also retires any draft-model state built before
        for seq in request.seqs:
            if seq.is_finished:
                continue
            for owner in (scheduler, self._probe):
                if owner is None:
                    continue
                if seq in owner.running:
                    owner.running.remove(seq)
                elif seq in owner.waiting:
                    owner.waiting.remove(seq)
            self.block_manager.free(seq)
            reset_for_recompute(seq)
            if self._probe is not None and request is self.probing:
                self._probe.waiting.append(seq)

    # ------------------------------------------------------------------ probes
    def schedule_probe(self) -> SchedulerOutput:
        """One step's schedule for the suspect under probe, alone."""
        if self.probing is None:
            self.probing = self.suspects.popleft()
            self._probe = Scheduler(self.block_manager, max(1, len(self.probing.seqs)),
                                    self.scheduler.max_num_batched_tokens)
            for seq in self.probing.seqs:
                if not seq.is_finished:
                    self._probe.add(seq)
        self._make_room()
        return self._probe.schedule()

    def _make_room(self) -> None:
        """Preempt the main batch's newest sequences until the probe's tokens fit."""
        bm = self.block_manager
        seqs = [s for s in self.probing.seqs if not s.is_finished]
        needed = sum(bm.blocks_needed(s.num_tokens + 1) for s in seqs) - sum(len(s.block_table) for s in seqs)
        while bm.num_free_blocks < needed and self.scheduler.running:
            self.scheduler._preempt(self.scheduler.running[-1], SchedulerOutput())

    def after_probe_step(self) -> None:
        """The probe's step succeeded: once its tokens are all computed it rejoins the batch."""
        if self.probing is None or self._probe is None:
            return
        pending = [s for s in self.probing.seqs if not s.is_finished]
        if any(s.num_computed_tokens < s.num_tokens - 1 for s in pending):
            return  # a chunked prefill: keep probing
        for seq in pending:
            if seq in self._probe.running:
                self._probe.running.remove(seq)
                self.scheduler.running.append(seq)
            elif seq in self._probe.waiting:
                self._probe.waiting.remove(seq)
                self.scheduler.waiting.appendleft(seq)
        self.failures.pop(self.probing.request_id, None)
        self._end_probe()

    def _end_probe(self) -> None:
        self.probing = None
        self._probe = None
