"""The scheduler: one rule, vLLM v1's.

Every sequence knows how many of its tokens are computed (``num_computed_tokens``) and how many
it has (``num_tokens_with_spec``: prompt + output + proposed drafts). Each step hands out tokens
under a budget (``max_num_batched_tokens``, ``max_num_seqs``) so computed catches up: running
sequences first, then waiting ones in arrival order. That single rule yields mixed prefill and
decode in one step, chunked prefill, prefix-cache hits (they start with tokens computed) and
draft verification (drafts are scheduled tokens). When blocks run out, the most recently
admitted running sequence is preempted and recomputed later; the waiting queue stays FIFO, so
no request starves. Waiting sequences hold no blocks between steps, so a request is failed as
too large only when it could not fit in an empty cache.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.block_manager import BlockManager
from engine.sequence import Sequence, SequenceStatus


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
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
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
        budget = self.max_num_batched_tokens
        bm = self.block_manager
        scheduled_ids: set[int] = set()

        # 1. Running sequences first, in admission order.
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = self._fit_drafts(seq, budget)
            if num_new <= 0:
                i += 1
                continue
            while not bm.can_allocate(seq, num_new):
                victim = self.running[-1]
                if victim is seq:
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
            scheduled_ids.add(seq.seq_id)
            budget -= num_new
            i += 1

        # 2. Waiting sequences in FIFO order, unless this step had to preempt.
        if out.preempted:
            return out
        skipped: list[Sequence] = []
        # Prompt blocks that requests admitted in this step are computing now (not yet cached).
        inflight: set[bytes] = set()
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            leader = seq.request.seqs[0]
            if seq is not leader and leader.num_computed_tokens < leader.num_prompt_tokens and not leader.is_finished:
                # A sibling sample waits for the first sample's prompt, then shares its blocks.
                skipped.append(self.waiting.popleft())
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
                self.waiting.popleft()
                bm.free(seq)
                out.failed.append((seq, self._too_large(seq)))
                continue
            if not bm.can_allocate(seq, num_new):
                # FIFO: later arrivals never jump a blocked head. It gives back the prefix hits it
                # just attached: a waiting sequence holds no blocks between steps, so the running
                # ones (or this one, once they finish) can always have the whole cache.
                bm.free(seq)
                seq.num_computed_tokens = 0
                if not self.running and not out.scheduled:  # nothing else holds a block
                    self.waiting.popleft()
                    out.failed.append((seq, self._too_large(seq)))
                    continue
                break
            if self._shares_inflight_prefix(seq, inflight, num_new):
                # An earlier request in this step is computing this prompt's next block: wait one
                # step and take it from the prefix cache instead of computing it again.
                bm.free(seq)
                seq.num_computed_tokens = 0
                skipped.append(self.waiting.popleft())
                continue
            self.waiting.popleft()
            bm.allocate(seq, num_new)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, num_new))
            budget -= num_new
        for seq in reversed(skipped):
            self.waiting.appendleft(seq)
        return out

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
