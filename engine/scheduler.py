"""The scheduler: one rule, vLLM v1's.

Every sequence knows how many of its tokens are computed (``num_computed_tokens``) and how many
it has (``num_tokens_with_spec``: prompt + output + proposed drafts). Each step hands out tokens
under a budget (``max_num_batched_tokens``, ``max_num_seqs``) so computed catches up: running
sequences first, then waiting ones in the queue's admission order. That single rule yields
mixed prefill and decode in one step, chunked prefill, prefix-cache hits (they start with tokens
computed) and draft verification (drafts are scheduled tokens). When blocks run out, the most
recently admitted running sequence is preempted and recomputed later; the waiting sequence tried
first then blocks the ones after it until it fits, so no request starves. Waiting sequences hold
no blocks between steps, so a request is failed as too large only when it could not fit in an
empty cache.

Admission order (``WaitingQueue.admission_order``, whose module docstring is the rule): with
``admission="prefix"`` (the default), among equally urgent waiting requests the one with the
longest cached prefix is tried first, and a request passed over by later arrivals goes in
arrival order again after ``prefix_aging_steps`` steps; ``admission="fifo"`` tries them in
queue order. Everything else below applies to whichever sequence is tried.

Priorities (``scheduling_policy="priority"``, vLLM's): the waiting queue is ordered by
(priority, arrival) with aging (``WaitingQueue``). Running sequences of a lower priority than
the most urgent waiting one are scheduled after the waiting ones, so a new urgent request gets
this step's budget; when it cannot be admitted for want of blocks or sequence slots, the
lowest-priority, most recently admitted running sequence is preempted (recomputed later).
``reserved_seqs`` slots are kept for priority <= 0 while urgent work is about (an urgent request
arrived within ``URGENT_RESERVE_HOLD_S``): background work (priority > 0) never fills the last of
them, so an urgent request usually needs no preemption at all; a run with no urgent work keeps
its whole batch (the first urgent request after a quiet spell preempts, losslessly).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Iterator

from engine.block_manager import BlockManager
from engine.sequence import Sequence, SequenceStatus
from engine.waiting_queue import WaitingQueue


#: Urgent-only steps never take more than this share of the last ``URGENT_ONLY_WINDOW_S`` seconds
#: of stepping: under a stream of urgent work that never lets up (or a machine too slow for it),
#: background requests still get at least half the engine's time. Counted in time, not steps:
#: an urgent-only step is several times cheaper than a full one on a CPU, so a cap in steps
#: bound far too early (measured with SmolLM2: 1 urgent job/s took 73% of the steps but 30% of
#: the time) and made urgent jobs wait a full-batch step for every token. A share of the
#: engine's own step time is not fooled by a busy machine: both kinds of step slow down alike.
URGENT_ONLY_MAX_SHARE = 0.5
#: The reserve of sequence slots holds for this long after the last urgent request arrived.
URGENT_RESERVE_HOLD_S = 120.0
URGENT_ONLY_WINDOW_S = 10.0

#: Waiting sequences a step may pass over (siblings, a shared prefix in flight, bulk work at the
#: reserve) looking for one to admit, so a long queue never costs a scan per step.
MAX_SKIPPED = 64


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        """True when this step reaches the end of the sequence, so it yields logits."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens_with_spec


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    failed: list[tuple[Sequence, str]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int, *,
                 policy: str = "fcfs", aging_steps: int = 1000, reserved_seqs: int = 0,
                 urgent_only_steps: int = 0, admission: str = "prefix", prefix_aging_steps: int = 64) -> None:
        if not 0 <= reserved_seqs < max_num_seqs:
            raise ValueError(f"reserved_seqs must be in [0, max_num_seqs), got {reserved_seqs}")
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.priority_policy = policy == "priority"
        self.reserved_seqs = reserved_seqs if self.priority_policy else 0
        self.urgent_only_steps = urgent_only_steps if self.priority_policy else 0
        self._urgent_streak = 0
        self._urgent_seen_at: float | None = None  # time.monotonic() of the last urgent arrival
        self._last_urgent_only = False  # whether the step being run was urgent-only
        self._recent_steps: deque[tuple[float, bool]] = deque()  # (seconds, urgent-only), newest last
        self._recent_seconds = 0.0  # their total and the urgent-only part, kept as steps come and go
        self._recent_urgent_seconds = 0.0
        self.waiting = WaitingQueue(policy, aging_steps, admission=admission, prefix_aging_steps=prefix_aging_steps)
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_steps = 0  # schedule() calls: the clock of aging and of num_waiting_steps
        self._scheduled_now: set[int] = set()  # seq ids given tokens in the step being scheduled
        self._preempted_now: set[int] = set()  # seq ids preempted in it: readmitted a step later

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        if seq.index == 0 and seq.request.metrics.first_scheduled_time is None:
            seq.request.arrival_step = self.num_steps
        if seq.request.priority <= 0:
            self._urgent_seen_at = time.monotonic()
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence) -> None:
        """Take a finished or aborted sequence out and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        reset_for_recompute(seq)
        seq.request.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        out.preempted.append(seq)
        self._preempted_now.add(seq.seq_id)

    def _victim(self, than: Sequence | None = None) -> Sequence | None:
        """The running sequence to preempt: lowest priority, then most recently admitted, never
        one already scheduled in this step. With ``than`` (a waiting sequence, under the
        priority policy) only one both less urgent and behind it in the aged order: a bulk
        request that has waited its turn is not thrown out again by later urgent arrivals."""
        if not self.priority_policy:
            if than is not None or not self.running or self.running[-1].seq_id in self._scheduled_now:
                return None
            return self.running[-1]
        victim = None
        for seq in reversed(self.running):
            if seq.seq_id not in self._scheduled_now and (victim is None or seq.request.priority > victim.request.priority):
                victim = seq
        if victim is not None and than is not None and (
            victim.request.priority <= than.request.priority or self.waiting.key(victim) <= self.waiting.key(than)
        ):
            return None
        return victim

    def _fit_drafts(self, seq: Sequence, budget: int) -> int:
        """Tokens to schedule for a running sequence; drafts past the budget are dropped."""
        wanted = seq.num_tokens_with_spec - seq.num_computed_tokens
        if wanted <= budget:
            return wanted
        if seq.draft_token_ids:
            keep = max(0, budget - (seq.num_tokens - seq.num_computed_tokens))
            seq.draft_token_ids = seq.draft_token_ids[:keep]
            if seq.draft_probs is not None:
                seq.draft_probs = seq.draft_probs[:keep]
        return min(budget, seq.num_tokens_with_spec - seq.num_computed_tokens)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self.num_steps += 1
        self._scheduled_now.clear()
        self._preempted_now.clear()
        budget = self.max_num_batched_tokens
        # Running sequences less urgent than a waiting one go after the waiting ones.
        urgent = self.waiting.best_priority() if self.priority_policy else None
        if self._urgent_only_step(urgent):
            # Only priority <= 0 this step: a small batch, so urgent tokens come at small-batch pace.
            budget = self._schedule_running([s for s in self.running if s.request.priority <= 0], budget, out)
            if not out.preempted:
                self._schedule_waiting(budget, out, only_urgent=True)
            return out
        first, deferred = list(self.running), []
        if urgent is not None and any(s.request.priority > urgent for s in first):
            deferred = [s for s in first if s.request.priority > urgent]
            first = [s for s in first if s.request.priority <= urgent]

        # 1. Running sequences first, in admission order.
        budget = self._schedule_running(first, budget, out)
        # 2. Waiting sequences in (priority, arrival) order, unless this step had to preempt
        #    (then only waiting ones more urgent than everything preempted).
        if not out.preempted or (urgent is not None and urgent < min(s.request.priority for s in out.preempted)):
            budget = self._schedule_waiting(budget, out)
        # 3. Running sequences that yielded to more urgent waiting ones.
        if deferred:
            self._schedule_running(deferred, budget, out)
        return out

    def _urgent_only_step(self, best_waiting: int | None) -> bool:
        """With ``urgent_only_steps`` = k, while urgent (priority <= 0) and background requests
        both run, k steps of every k + 1 leave the background ones out, and never more than
        ``URGENT_ONLY_MAX_SHARE`` of the recent step time (see ``record_step_time``). Where a
        step's cost grows with its batch (CPUs), urgent requests then decode at small-batch
        speed and bulk work still advances; where it hardly grows (GPUs), keep k = 0."""
        self._last_urgent_only = self._choose_urgent_only(best_waiting)
        return self._last_urgent_only

    def record_step_time(self, seconds: float) -> None:
        """The engine reports how long the step just scheduled took; the urgent-only share is
        kept over the last ``URGENT_ONLY_WINDOW_S`` seconds of them."""
        if not self.urgent_only_steps:
            return
        urgent = self._last_urgent_only
        self._recent_steps.append((seconds, urgent))
        self._recent_seconds += seconds
        self._recent_urgent_seconds += seconds if urgent else 0.0
        while self._recent_seconds > URGENT_ONLY_WINDOW_S and len(self._recent_steps) > 1:
            old, was_urgent = self._recent_steps.popleft()
            self._recent_seconds -= old
            self._recent_urgent_seconds -= old if was_urgent else 0.0

    def _choose_urgent_only(self, best_waiting: int | None) -> bool:
        if not self.urgent_only_steps:
            return False
        urgent = (best_waiting is not None and best_waiting <= 0) or any(s.request.priority <= 0 for s in self.running)
        if not urgent or not any(s.request.priority > 0 for s in self.running):
            self._urgent_streak = 0
            return False
        if self._recent_urgent_seconds >= URGENT_ONLY_MAX_SHARE * URGENT_ONLY_WINDOW_S:
            return False  # the share is spent: background work gets this step too
        if self._urgent_streak < self.urgent_only_steps:
            self._urgent_streak += 1
            return True
        self._urgent_streak = 0
        return False

    def _schedule_running(self, seqs: list[Sequence], budget: int, out: SchedulerOutput) -> int:
        bm = self.block_manager
        for seq in seqs:
            if budget <= 0:
                break
            if seq.status is not SequenceStatus.RUNNING or seq.seq_id in self._scheduled_now:
                continue  # preempted earlier in this step (or, never again, readmitted already)
            num_new = self._fit_drafts(seq, budget)
            if num_new <= 0:
                continue
            while not bm.can_allocate(seq, num_new):
                victim = self._victim()
                if victim is seq or victim is None:
                    break
                self._preempt(victim, out)
            if not bm.can_allocate(seq, num_new):
                if not bm.can_ever_fit(seq.num_tokens):
                    # Too large for an empty cache: no amount of waiting helps.
                    out.failed.append((seq, self._too_large(seq)))
                    self.running.remove(seq)
                    bm.free(seq)
                else:
                    self._preempt(seq, out)
                continue
            bm.allocate(seq, num_new)
            out.scheduled.append(ScheduledSeq(seq, num_new))
            self._scheduled_now.add(seq.seq_id)
            budget -= num_new
        return budget

    def _seq_limit(self, seq: Sequence) -> int:
        """How many sequences may run once ``seq`` is admitted (background work leaves a reserve)."""
        return self.max_num_seqs - (self.reserved_seqs if seq.request.priority > 0 and self.reserve_active() else 0)

    def reserve_active(self) -> bool:
        """Whether the reserve holds: an urgent request arrived within ``URGENT_RESERVE_HOLD_S``."""
        return (self.reserved_seqs > 0 and self._urgent_seen_at is not None
                and time.monotonic() - self._urgent_seen_at < URGENT_RESERVE_HOLD_S)

    def _schedule_waiting(self, budget: int, out: SchedulerOutput, only_urgent: bool = False) -> int:
        bm = self.block_manager
        if not self.waiting or budget <= 0:
            return budget
        if len(self.running) >= self.max_num_seqs and self._victim(than=self.waiting[0]) is None:
            # No slot and none to take: the first sequence tried would stop here (none of the
            # head's run may preempt either), so rank nothing.
            return budget
        skipped: set[int] = set()  # seq ids passed over in this step (they keep their place)
        admitted: list[Sequence] = []
        # Prompt blocks that requests admitted in this step are computing now (not yet cached).
        inflight: set[bytes] = set()
        candidates = self._admission_candidates(skipped)
        while self.waiting and budget > 0 and len(skipped) <= MAX_SKIPPED:
            seq = next(candidates, None)
            if seq is None:
                break
            if only_urgent and seq.request.priority > 0:
                break
            if len(self.running) >= self._seq_limit(seq):
                victim = self._victim(than=seq)
                if victim is not None and len(self.running) >= self.max_num_seqs:
                    self._preempt(victim, out)  # an urgent request takes a background slot
                elif len(self.running) >= self.max_num_seqs or not self.priority_policy:
                    break
                else:  # only the reserve is left: an urgent request behind this one may use it
                    skipped.add(seq.seq_id)
                    continue
            leader = seq.request.seqs[0]
            if seq is not leader and leader.num_computed_tokens < leader.num_prompt_tokens and not leader.is_finished:
                # A sibling sample waits for the first sample's prompt, then shares its blocks.
                skipped.add(seq.seq_id)
                continue
            if not seq.block_table and seq.num_computed_tokens == 0:
                if seq is not leader and leader.block_table and not leader.is_finished:
                    seq.num_computed_tokens = bm.share_prefix(leader, seq, seq.num_tokens)
                else:
                    seq.num_computed_tokens = bm.match_prefix(seq)
                if seq.request.metrics.first_scheduled_time is None:
                    seq.request.metrics.num_cached_tokens = max(
                        seq.request.metrics.num_cached_tokens, seq.num_computed_tokens
                    )
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not bm.can_ever_fit(seq.num_tokens):
                self.waiting.remove(seq)
                bm.free(seq)
                out.failed.append((seq, self._too_large(seq)))
                continue
            while not bm.can_allocate(seq, num_new):
                victim = self._victim(than=seq)  # an urgent request takes a background one's blocks
                if victim is None:
                    break
                self._preempt(victim, out)
            if not bm.can_allocate(seq, num_new):
                # Head-blocking: nothing tried after this one jumps it. It gives back the prefix
                # hits it just attached: a waiting sequence holds no blocks between steps, so the
                # running ones (or this one, once they finish) can always have the whole cache.
                bm.free(seq)
                seq.num_computed_tokens = 0
                if not self.running and not out.scheduled:  # nothing else holds a block
                    self.waiting.remove(seq)
                    out.failed.append((seq, self._too_large(seq)))
                    continue
                break
            if self._shares_inflight_prefix(seq, inflight, num_new):
                # An earlier request in this step is computing this prompt's next block: wait one
                # step and take it from the prefix cache instead of computing it again.
                bm.free(seq)
                seq.num_computed_tokens = 0
                skipped.add(seq.seq_id)
                continue
            self.waiting.remove(seq)
            bm.allocate(seq, num_new)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, num_new))
            self._scheduled_now.add(seq.seq_id)
            admitted.append(seq)
            budget -= num_new
        self.waiting.note_admitted(admitted, self.num_steps)
        return budget

    def _admission_candidates(self, skipped: set[int]) -> Iterator[Sequence]:
        """Waiting sequences in the order to try them (``WaitingQueue.admission_order``). Each one
        yielded is admitted, failed or skipped before the next is asked for; the order is built
        again when its window is spent or the queue gained a sequence (a preemption in this step).
        A sequence preempted in this step waits for the next: its slot and blocks went to the one
        it yielded to (readmitted at once, it was also scheduled again with the running ones that
        yield to waiting ones: twice in one step)."""
        while True:
            inserts = self.waiting.num_inserts
            exclude = skipped | self._preempted_now
            order = self.waiting.admission_order(self.num_steps, exclude, self._cached_prefix)
            if not order:
                return
            for seq in order:
                if self.waiting.num_inserts != inserts:
                    break
                yield seq

    def _cached_prefix(self, seq: Sequence) -> int:
        """Tokens ``seq`` would start with computed if admitted now: what a sibling shares with
        its leader's blocks, otherwise the prefix cache's hit (read only)."""
        leader = seq.request.seqs[0]
        if seq is not leader and leader.block_table and not leader.is_finished:
            bs = self.block_manager.block_size
            return min(seq.num_tokens - 1, leader.num_computed_tokens, len(leader.block_table) * bs) // bs * bs
        return self.block_manager.cached_prefix_tokens(seq)

    def _shares_inflight_prefix(self, seq: Sequence, inflight: set, num_new: int) -> bool:
        """True when ``seq``'s next uncomputed prompt block is being computed in this step by a
        request admitted before it (SGLang's in-batch prefix caching: a bulk job's shared
        instruction is computed once, not once per request of the first step). Otherwise record
        the full prompt blocks ``seq`` computes now, for the requests after it."""
        bm = self.block_manager
        if not bm.enable_prefix_caching or seq.num_computed_tokens % bm.block_size:
            return False
        first = seq.num_computed_tokens // bm.block_size
        last = min(seq.num_computed_tokens + num_new, seq.num_prompt_tokens) // bm.block_size
        if last <= first:
            return False
        keys = bm.prompt_block_keys(seq, first, last)
        if keys[0] in inflight:
            return True
        inflight.update(keys)
        return False

    def _too_large(self, seq: Sequence) -> str:
        bm = self.block_manager
        return (
            f"request {seq.request.request_id} needs {bm.blocks_needed(seq.num_tokens_with_spec)} KV-cache blocks "
            f"of {bm.block_size} tokens but the whole cache holds {bm.num_blocks}; raise kv_cache_memory_bytes"
        )


def reset_for_recompute(seq: Sequence) -> None:
    """Forget a sequence's computed KV and drafts (its blocks are already freed): it waits and
    recomputes its tokens so far, as after a preemption."""
    seq.num_computed_tokens = 0
    seq.draft_token_ids = []
    seq.draft_probs = None
    seq.status = SequenceStatus.WAITING
