"""Draft-model proposer: a smaller model with the target's tokenizer, batched over all sequences.

Its paged KV cache is its own tensors indexed by the *target's* block tables (same num_blocks,
same block_size), so it needs no block bookkeeping of its own: a sequence's blocks hold the
target's K/V in the target's cache and the draft's in the draft's. Per sequence the proposer
only remembers how far its own cache is valid; every step it catches up on the tokens the
target accepted (one flat forward for all sequences, the last real token included, which
yields the first draft), then runs k - 1 single-token steps. The drafts' own K/V lands in
lookahead slots it allocates through the block manager, as vLLM does; the scheduler then finds
them allocated, and verification trims what was rejected.

Drafts are drawn from ``q`` = the draft's distribution after the request's own sampling
transforms, with the request's own noise at the same (seed, sample, position) as the target
will use (``Sampler.sample`` on the draft's logits): where ``q`` and ``p`` agree the two races
pick the same token, which is what coupled verification accepts. ``acceptance="rejection"``
also needs ``q`` itself, which is then returned with the drafts.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time

import torch

from engine.attention import ATTN_IMPLEMENTATION
from engine.config import parse_dtype
from engine.loader import load_model
from engine.model_runner import ModelRunner
from engine.sampler import SampleRow, noise_keys
from engine.sequence import Sequence
from engine.spec.proposer import EMPTY, Proposal
from engine.step_inputs import StepInputs

log = logging.getLogger(__name__)


class DraftRunner(ModelRunner):
    """A ``ModelRunner`` whose KV cache has exactly the target's number of blocks."""

    def __init__(self, model, config, max_model_len: int, num_blocks: int) -> None:
        self._fixed_num_blocks = num_blocks
        super().__init__(model, config, max_model_len)

    def _num_blocks(self, max_model_len: int) -> int:
        return self._fixed_num_blocks

    def prepare_draft(self, items: list[tuple[Sequence, list[int], int]]) -> StepInputs:
        """Inputs for feeding ``tokens`` at positions ``start..`` of each sequence; logits at each last."""
        chunks = [(seq.block_table, tokens, start) for seq, tokens, start in items]
        ends = list(itertools.accumulate(len(tokens) for _, tokens, _ in items))
        return self.layout(chunks, [end - 1 for end in ends], [])


@dataclasses.dataclass(slots=True)
class _State:
    epoch: int  # the request's preemption count when this state was built
    base: int = 0  # draft K/V valid for positions < base ...
    fed: list[int] = dataclasses.field(default_factory=list)  # ... and for these drafts after it, if accepted

    def valid(self, tokens: list[int]) -> int:
        """Positions whose draft K/V matches ``tokens`` (always leaving the last token to feed)."""
        n = 0
        for fed, real in zip(self.fed, tokens[self.base :]):
            if fed != real:
                break
            n += 1
        return min(self.base + n, len(tokens) - 1)


def check_vocab(draft_model, target_vocab: int, name: str) -> None:
    vocab = draft_model.config.get_text_config().vocab_size
    if vocab != target_vocab:
        raise ValueError(
            f"draft model {name!r} has a vocabulary of {vocab} tokens but the target has {target_vocab}; "
            "a draft must share the target's tokenizer"
        )


class DraftModelProposer:
    def __init__(self, config, engine, model=None) -> None:
        ecfg = engine.config
        dtype = parse_dtype(config.draft_dtype, ecfg.device) if config.draft_dtype else ecfg.dtype
        name = config.draft_model if isinstance(config.draft_model, str) else type(config.draft_model).__name__
        if model is None and isinstance(config.draft_model, str):
            model = load_model(config.draft_model, dtype, ecfg.device, ecfg.trust_remote_code, ecfg.fuse_layers)
        elif model is None:  # a model object: put our paged attention in it
            model = config.draft_model.to(device=ecfg.device, dtype=dtype).eval().requires_grad_(False)
            model.set_attn_implementation(ATTN_IMPLEMENTATION)
        check_vocab(model, engine.vocab_size, name)
        text_config = model.config.get_text_config()
        self.max_len = min(engine.max_model_len, getattr(text_config, "max_position_embeddings", None) or 2048)
        runner_config = dataclasses.replace(ecfg, dtype=dtype, speculative_config=None)
        self.runner = DraftRunner(model, runner_config, engine.max_model_len, engine.runner.num_blocks)
        self.block_manager = engine.block_manager
        self.sampler = engine.sampler
        self.keep_probs = config.acceptance == "rejection"
        self.max_catchup_tokens = ecfg.max_num_batched_tokens
        self.states: dict[int, _State] = {}
        # (tokens, sequences, seconds) of each draft forward: the speculator fits the draft's cost.
        self.timings: list[tuple[int, int, float]] = []

    def _state(self, seq: Sequence) -> _State:
        epoch = seq.request.metrics.num_preemptions
        state = self.states.get(seq.seq_id)
        if state is None or state.epoch != epoch:
            state = self.states[seq.seq_id] = _State(epoch)
        return state

    def _reserve(self, seq: Sequence, k: int) -> int:
        """Allocate slots for the k - 1 drafts the draft model feeds itself; return the k that fits."""
        bm = self.block_manager
        room = len(seq.block_table) * bm.block_size - seq.num_tokens + 1
        room += bm.num_free_blocks * bm.block_size
        k = min(k, room, self.max_len - seq.num_tokens)
        if k <= 0:
            return 0
        bm.allocate(seq, seq.num_tokens + k - 1 - seq.num_computed_tokens)
        return k

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Proposal]:
        out: list[Proposal] = [EMPTY] * len(seqs)
        active: list[tuple[int, Sequence, int]] = []
        feed: list[tuple[Sequence, list[int], int]] = []
        budget = self.max_catchup_tokens
        for i, (seq, k) in enumerate(zip(seqs, ks)):
            if k <= 0:
                continue
            state = self._state(seq)
            start = state.valid(seq.token_ids)
            tokens = seq.token_ids[start:]
            if len(tokens) > budget:
                continue  # catches up in a later step
            k = self._reserve(seq, k)
            if k <= 0:
                continue
            budget -= len(tokens)
            active.append((i, seq, k))
            feed.append((seq, tokens, start))
        if not active:
            return out
        drafts: list[list[int]] = [[] for _ in active]
        probs: list[list[torch.Tensor]] = [[] for _ in active]
        live = list(range(len(active)))
        for step in range(max(k for _, _, k in active)):
            if step > 0:
                live = [j for j in live if active[j][2] > step]
                feed = [(active[j][1], [drafts[j][-1]], active[j][1].num_tokens + step - 1) for j in live]
            start_time = time.perf_counter()
            inputs = self.runner.prepare_draft(feed)
            logits = self.runner.forward(inputs)
            self.timings.append((int(inputs.input_ids.numel()), len(feed), time.perf_counter() - start_time))
            rows = [SampleRow(active[j][1], drafts[j]) for j in live]
            tokens, q = self._sample(logits, rows)
            for r, j in enumerate(live):
                drafts[j].append(tokens[r])
                if q[r] is not None:
                    probs[j].append(q[r])
        for j, (i, seq, k) in enumerate(active):
            state = self.states[seq.seq_id]
            state.base = seq.num_tokens
            state.fed = drafts[j][: k - 1]
            out[i] = Proposal(drafts[j], torch.stack(probs[j]) if probs[j] else None)
        return out

    def _sample(self, logits: torch.Tensor, rows: list[SampleRow]) -> tuple[list[int], list[torch.Tensor | None]]:
        """Tokens drawn as the target would draw them (same noise); ``q`` only for rejection mode."""
        sampler = self.sampler
        q: list[torch.Tensor | None] = [None] * len(rows)
        random_rows = [r for r, row in enumerate(rows) if not row.seq.params.greedy]
        if not (self.keep_probs and random_rows):
            return sampler.sample(logits, rows), q
        tokens = sampler.processed_logits(logits, rows).argmax(-1).tolist()
        sub = [rows[r] for r in random_rows]
        probs = sampler.target_probs(logits[random_rows], sub)
        for j, (r, token) in enumerate(zip(random_rows, sampler.draw(probs, noise_keys(sub)))):
            q[r] = probs[j]
            tokens[r] = token
        return tokens, q

    def finished(self, seq: Sequence) -> None:
        self.states.pop(seq.seq_id, None)
