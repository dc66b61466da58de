"""``Speculator``: the engine's one entry point for speculation.

The engine calls ``verify`` instead of plain sampling after each forward (the runner already
laid out ``1 + len(drafts)`` logits rows per sampling sequence), ``propose`` at the end of each
step for the running sequences, and ``finished`` when a sample ends. Everything about which
proposer runs, how many tokens it may propose (adaptive k) and the bookkeeping after
verification (rejected drafts leave ``num_computed_tokens`` and their KV slots) lives here.
"""

from __future__ import annotations

import logging
import time

import torch

from engine.sampler import SampleRow, noise_keys
from engine.sequence import Sequence, SequenceStatus
from engine.spec.adaptive import Acceptance, RealizedCost, StepCost, best_k_for_costs, expected_tokens
from engine.spec.calibration import DRAFT_LAYOUTS, TARGET_LAYOUTS, time_layouts
from engine.spec.config import MAX_SPEC_TOKENS, SpeculativeConfig
from engine.spec.proposer import EMPTY, Proposer
from engine.spec.rejection import accept_prefix, sample_rejection
from specbatch_kernels.counter_rng import ACCEPT, RESAMPLE

log = logging.getLogger(__name__)

# Counters added to ``engine.stats``.
STAT_KEYS = (
    "spec_steps",
    "spec_draft_tokens",
    "spec_accepted_tokens",
    "spec_emitted_tokens",
    "spec_rejections",  # verifications that rejected a draft (per-token acceptance = A / (A + R))
    "spec_proposer_failures",
    "spec_forced_tokens",  # drafts that were a grammar's forced tokens (structured output)
    "spec_forced_accepted",
    "spec_grammar_cut_tokens",  # proposer drafts dropped because the grammar refuses them
)
#: The acceptance forced-token drafts are costed with: a forced row is one-hot, so they are
#: accepted by construction (only a draft cut by the step's token budget is lost). Below 1 only
#: to keep the cost model's formula finite. With it the cost model still says no where a
#: verified token costs more than a step of its own; on the CPU it said yes up to k = 10 at batch
#: 16, where 0.95 gave k = 4-5 and, with the measured cost drifting on a shared machine, some
#: runs drafted a third as much (bench/structured.py: 1.15x vs 0.94x unconstrained).
FORCED_ALPHA = 0.99
PROBE_EVERY = 8  # a sequence held at k = 0 by low acceptance retries k = 1 this often
# Where the expected gain is marginal (below CONTROL_BELOW), every CONTROL_EVERY-th step runs the
# other way (plain if speculating, speculating if held off by measured cost), so the realized
# cost of both kinds is measured close together in time, on the machine as it is now.
CONTROL_EVERY = 8
CONTROL_BELOW = 1.5


def make_proposer(config: SpeculativeConfig, engine) -> Proposer:
    if config.method == "ngram":
        from engine.spec.ngram import NgramProposer

        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    if config.method == "suffix":
        from engine.spec.suffix import SuffixProposer

        return SuffixProposer(
            config.suffix_max_depth,
            config.suffix_max_cached_tokens,
            config.suffix_min_token_prob,
            config.suffix_max_spec_factor,
        )
    from engine.spec.draft import DraftModelProposer

    return DraftModelProposer(config, engine)


class Speculator:
    def __init__(self, config: SpeculativeConfig, engine, proposer: Proposer | None = None) -> None:
        self.config = config
        self.engine = engine
        self.proposer = proposer or make_proposer(config, engine)
        self.acceptance = Acceptance(config.acceptance_decay)
        self.target_cost = StepCost()  # a step (forward + verification) vs tokens and sequences
        self.draft_cost = StepCost()  # one draft-model forward vs its tokens and sequences
        self.proposer_seconds_per_token = 0.0  # model-free proposers: EMA of their cost per draft
        # Draft model: seconds per draft step spent outside its timed forwards (layout, sampling,
        # bookkeeping). Left out, the cost model thought a same-size draft nearly free of it and
        # speculated at a loss (measured 0.77x with the target as its own draft).
        self.draft_overhead_per_step = 0.0
        self.held: dict[int, int] = {}  # seq_id -> steps at k = 0 since the last probe
        self.last_c = 0.0  # Leviathan's c at the last choice with k > 0 (benchmarks report it)
        self.realized = RealizedCost()
        self.choices = 0  # propose calls that chose k (control steps count from it)
        self.pending_proposer = (0.0, 0.0)  # (seconds, predicted seconds) of the drafts in flight
        if config.adaptive:
            self.calibrate()

    def calibrate(self) -> None:
        """Time synthetic steps of the target (and the draft model) before any request runs."""
        for n, batch, seconds in time_layouts(self.engine.runner, TARGET_LAYOUTS):
            self.target_cost.observe(n, batch, seconds, calibration=True)
        draft_runner = getattr(self.proposer, "runner", None)
        if draft_runner is not None:
            for n, batch, seconds in time_layouts(draft_runner, DRAFT_LAYOUTS):
                self.draft_cost.observe(n, batch, seconds, calibration=True)

    # -------------------------------------------------------------- verify
    def verify(self, sched, inputs, logits: torch.Tensor) -> list[tuple[Sequence, list[int]]]:
        start = time.perf_counter()
        engine = self.engine
        entries: list[tuple[Sequence, int, list[int]]] = []
        for i, row0, num_rows in inputs.sample_rows:
            seq = sched.scheduled[i].seq
            drafts = seq.draft_token_ids
            if len(drafts) != num_rows - 1:  # cannot happen: the runner laid the rows out from them
                raise RuntimeError(f"{num_rows} logits rows for {len(drafts)} drafts")
            entries.append((seq, row0, list(drafts)))
        # Only decode/verify steps feed the cost model: a prefill chunk's cost per token differs.
        decode_only = len(entries) == len(sched.scheduled) and all(
            item.num_new_tokens == 1 + len(item.seq.draft_token_ids) for item in sched.scheduled
        )
        if not any(drafts for _seq, _row0, drafts in entries):
            # Nothing to verify (auto held every sequence at k = 0): the engine's plain sampler
            # is the same decision at a fraction of the bookkeeping.
            accepted_out = engine._sample(sched, inputs, logits)
            self._count_step(sum(len(tokens) for _seq, tokens in accepted_out))
            self._observe_step(sched, decode_only, start)
            return accepted_out
        results = self._accept(entries, logits)

        accepted_out: list[tuple[Sequence, list[int]]] = []
        want_logprobs: list[tuple[Sequence, int, list[int]]] = []
        stats = self._stats()
        for (seq, row0, drafts), result in zip(entries, results):
            tokens, num_accepted = result
            if drafts:
                rejected = len(drafts) - num_accepted
                seq.num_computed_tokens -= rejected
                seq.draft_token_ids = []
                seq.draft_probs = None
                engine.block_manager.trim(seq)
                metrics = seq.request.metrics
                metrics.num_draft_tokens += len(drafts)
                metrics.num_accepted_tokens += num_accepted
                forced = min(seq.num_forced_drafts, len(drafts))
                seq.num_forced_drafts = 0
                if forced:
                    stats["spec_forced_tokens"] += forced
                    stats["spec_forced_accepted"] += min(forced, num_accepted)
                if len(drafts) > forced:  # the proposer's own drafts (after the forced ones)
                    self.acceptance.update(seq.seq_id, len(drafts) - forced, max(0, num_accepted - forced))
                stats["spec_draft_tokens"] += len(drafts)
                stats["spec_accepted_tokens"] += num_accepted
                stats["spec_rejections"] += int(rejected > 0)
            stats["spec_emitted_tokens"] += len(tokens)
            if seq.params.logprobs is not None:
                want_logprobs.append((seq, row0, tokens))
            accepted_out.append((seq, tokens))
        if want_logprobs:
            self._logprobs(logits, want_logprobs)
        stats["spec_steps"] += 1
        self._observe_step(sched, decode_only, start)
        return accepted_out

    def _accept(self, entries: list[tuple[Sequence, int, list[int]]], logits: torch.Tensor) -> list[tuple[list[int], int]]:
        """Sample every target row (1 + drafts per sequence) and keep each agreeing prefix.

        Rows are sampled exactly as plain steps would sample those positions (same noise, same
        distribution), so the emitted tokens are the non-speculative ones. ``rejection`` mode
        runs Leviathan/Chen on its sampled (non-greedy) sequences instead.
        """
        sampler = self.engine.sampler
        rows, index = [], []
        for seq, row0, drafts in entries:
            for j in range(len(drafts) + 1):
                rows.append(SampleRow(seq, drafts[:j]))
                index.append(row0 + j)
        rows_logits = logits[torch.tensor(index, device=logits.device)]
        leviathan = self.config.acceptance == "rejection"
        plain = [r for r, row in enumerate(rows) if not (leviathan and not row.seq.params.greedy)]
        sampled = [0] * len(rows)
        if plain:
            sub = sampler.sample(rows_logits[torch.tensor(plain, device=logits.device)], [rows[r] for r in plain])
            for r, token in zip(plain, sub):
                sampled[r] = token
        results, offset = [], 0
        for seq, _row0, drafts in entries:
            n = len(drafts) + 1
            if leviathan and not seq.params.greedy:
                own = rows[offset : offset + n]
                probs = sampler.target_probs(rows_logits[offset : offset + n], own)
                results.append(sample_rejection(
                    probs, drafts, seq.draft_probs, noise_keys(own[:-1], ACCEPT), noise_keys(own, RESAMPLE)
                ))
            else:
                results.append(accept_prefix(sampled[offset : offset + n], drafts))
            offset += n
        return results

    def _observe_step(self, sched, decode_only: bool, start: float) -> None:
        """Feed the step's cost (forward + verification) to the cost model, for decode steps
        only: a prefill chunk's cost per token differs."""
        proposer_seconds, proposer_predicted = self.pending_proposer
        self.pending_proposer = (0.0, 0.0)
        if decode_only:
            seconds = self.engine.last_forward_seconds + time.perf_counter() - start
            n, batch = sched.num_tokens, len(sched.scheduled)
            if self.target_cost.ready:
                speculative = n > batch
                predicted = self.target_cost.predict(n, batch)
                if speculative:
                    seconds_all, predicted = seconds + proposer_seconds, predicted + proposer_predicted
                else:
                    seconds_all = seconds
                self.realized.observe(speculative, seconds_all, predicted)
            self.target_cost.observe(n, batch, seconds)

    def _stats(self) -> dict:
        stats = self.engine.stats
        for key in STAT_KEYS:  # the engine builds its stats after its speculator
            stats.setdefault(key, 0)
        return stats

    def _count_step(self, emitted: int) -> None:
        stats = self._stats()
        stats["spec_emitted_tokens"] += emitted
        stats["spec_steps"] += 1

    def _logprobs(self, logits: torch.Tensor, items: list[tuple[Sequence, int, list[int]]]) -> None:
        """The model's logprobs of every emitted token (row j of a sequence scored token j)."""
        index, tokens, nums = [], [], []
        for seq, row0, toks in items:
            for j, token in enumerate(toks):
                index.append(row0 + j)
                tokens.append(token)
                nums.append(seq.params.logprobs)
        lps = self.engine.sampler.logprobs(logits[torch.tensor(index, device=logits.device)], tokens, nums)
        offset = 0
        for seq, _row0, toks in items:
            seq.logprobs.extend(lps[offset : offset + len(toks)])
            offset += len(toks)

    # ------------------------------------------------------------- propose
    def propose(self, running: list[Sequence]) -> None:
        """Give each decoding sequence its drafts (possibly none) for the next step."""
        engine = self.engine
        seqs = [
            s
            for s in running
            if s.status is SequenceStatus.RUNNING and s.num_tokens - s.num_computed_tokens == 1 and not s.draft_token_ids
        ]
        if not seqs:
            return
        ks = self.choose_k(seqs)
        for seq, k in zip(seqs, ks):
            seq.spec_k = k
            seq.spec_alpha = self.acceptance.alpha(seq.seq_id)
        forced = self._forced(seqs)
        lookahead = getattr(self.proposer, "supports_lookahead", False) and any(forced)
        start = time.perf_counter()
        try:
            if lookahead:  # the proposer drafts what follows the forced tokens
                proposals = self.proposer.propose(seqs, ks, lookahead=forced)
            else:
                proposals = self.proposer.propose(seqs, ks)
        except Exception:  # a proposer failure fails nothing: this step runs without drafts
            log.exception("speculative proposer %r failed; this step runs without speculation", self.config.method)
            engine.stats["spec_proposer_failures"] = engine.stats.get("spec_proposer_failures", 0) + 1
            proposals = [EMPTY] * len(seqs)
        seconds = time.perf_counter() - start
        proposed = 0
        for seq, k, proposal, fixed in zip(seqs, ks, proposals, forced):
            tokens = proposal.tokens[:k] if proposal is not EMPTY else []
            probs = proposal.probs
            if seq.grammar is not None:
                tokens, probs = self._constrain(seq, tokens, probs, fixed, lookahead)
            if not tokens:
                continue
            seq.draft_token_ids = list(tokens)
            seq.draft_probs = probs[: len(tokens)] if probs is not None else None
            proposed += len(tokens)
        self.pending_proposer = (seconds, self._predicted_proposer(len(seqs), max(ks, default=0), proposed))
        self._observe_proposer(seconds, proposed)

    def _forced(self, seqs: list[Sequence]) -> list[list[int]]:
        """Each sequence's forced grammar tokens to draft (empty where none, or where the cost
        model says verifying even near-certain drafts does not pay at this batch size)."""
        if not self.engine.config.forced_token_drafts or not any(s.grammar is not None for s in seqs):
            return [[] for _ in seqs]
        k_max = self.config.k_max
        if self.config.adaptive:
            factor = self.realized.factor()
            ratios = [1.0] + [max(1.0, r * factor) for r in self.step_ratios(len(seqs), k_max)[1:]]
            k_forced = best_k_for_costs(FORCED_ALPHA, ratios, self.config.min_speedup)
        else:
            k_forced = k_max
        out = []
        for seq in seqs:
            limit = min(k_forced, self._room(seq, k_max))
            out.append(seq.grammar.forced_tokens(limit) if seq.grammar is not None and limit > 0 else [])
        return out

    def _constrain(self, seq: Sequence, tokens: list[int], probs, forced: list[int], lookahead: bool):
        """Drafts for a sequence with a grammar: its forced tokens first, then the proposer's,
        all cut at the first token the grammar refuses.

        A proposer that takes a lookahead (ngram, suffix) drafted after the forced tokens, so its
        drafts follow them. One that cannot (the draft model, which would have to run the forced
        tokens through itself first) drafted from the committed context: its drafts are kept
        past the forced ones only where they start with them; otherwise they would be rejected
        inside the forced span anyway, and the forced tokens go alone.
        """
        stats = self._stats()
        if forced:
            if lookahead:
                tokens = (list(forced) + list(tokens))[: max(len(forced), self._room(seq, MAX_SPEC_TOKENS))]
                probs = None  # point masses (only the draft model has probabilities, and no lookahead)
            elif tokens[: len(forced)] == forced and len(tokens) > len(forced):
                pass  # the proposer agrees and continues past them: keep its drafts (and probs)
            else:
                tokens, probs = list(forced), None
        allowed = seq.grammar.valid_prefix(tokens) if tokens else 0
        if allowed < len(tokens):
            stats["spec_grammar_cut_tokens"] += len(tokens) - allowed
            tokens = tokens[:allowed]
        seq.num_forced_drafts = min(len(forced), len(tokens))
        return tokens, probs

    def _predicted_proposer(self, batch: int, k: int, proposed: int) -> float:
        """What the cost model expects the proposer to have cost for these drafts."""
        if self.config.method == "draft":
            per_step = self.draft_cost.predict(batch, batch) if self.draft_cost.ready else 0.0
            return k * (per_step + self.draft_overhead_per_step)
        return proposed * self.proposer_seconds_per_token

    def _observe_proposer(self, seconds: float, proposed: int) -> None:
        timings = getattr(self.proposer, "timings", None)
        if timings is not None:  # the draft model: fit its forward cost, and what lies around it
            for n, batch, t in timings:
                self.draft_cost.observe(n, batch, t)
            if timings:
                overhead = max(0.0, seconds - sum(t for _n, _b, t in timings)) / len(timings)
                ema = self.draft_overhead_per_step
                self.draft_overhead_per_step = overhead if ema == 0 else 0.8 * ema + 0.2 * overhead
            timings.clear()
        elif proposed:
            per_token = seconds / proposed
            ema = self.proposer_seconds_per_token
            self.proposer_seconds_per_token = per_token if ema == 0 else 0.8 * ema + 0.2 * per_token

    def step_ratios(self, batch: int, k_max: int) -> list[float]:
        """``r[k]``: cost of a step where each of ``batch`` decoding sequences carries k drafts
        (the target verifying ``batch * (1 + k)`` tokens plus k proposer steps), over a plain step."""
        target = self.target_cost
        plain = target.predict(batch, batch) if target.ready else 0.0
        if plain <= 0:
            return [1.0] * (k_max + 1)  # nothing measured yet: assume drafts are free
        ratios = [1.0]
        for k in range(1, k_max + 1):
            if self.config.method == "draft":
                per_step = self.draft_cost.predict(batch, batch) if self.draft_cost.ready else plain
                draft = k * (per_step + self.draft_overhead_per_step)
            else:
                draft = k * batch * self.proposer_seconds_per_token
            verify = target.predict(batch * (1 + k), batch) / plain
            # Never cheaper than the calibration's back-to-back timings say verification is.
            floor = target.calibrated_ratio(batch * (1 + k), batch)
            ratios.append(max(verify, floor or 0.0) + draft / plain)
        return ratios

    def choose_k(self, seqs: list[Sequence]) -> list[int]:
        k_max = self.config.k_max
        limits = [self._room(seq, k_max) for seq in seqs]
        if not self.config.adaptive:
            return limits
        model = self.step_ratios(len(seqs), k_max)
        factor = self.realized.factor()
        ratios = [1.0] + [max(1.0, r * factor) for r in model[1:]]  # drafts are never free
        ks = self._choose(seqs, limits, ratios)
        self.choices += 1
        if self.choices % CONTROL_EVERY == 0:
            gain = max(expected_tokens(self.acceptance.global_alpha, k) / ratios[k] for k in range(len(ratios)))
            if max(ks) > 0 and gain < CONTROL_BELOW:
                ks = [0] * len(seqs)  # a plain step to compare with
            elif max(ks) == 0 and factor > 1.0:
                ks = self._choose(seqs, limits, model)  # what the model alone would do, measured again
        chosen = max(ks)
        if chosen:
            self.last_c = (ratios[chosen] - 1.0) / chosen
        return ks

    def _choose(self, seqs: list[Sequence], limits: list[int], ratios: list[float]) -> list[int]:
        min_speedup = self.config.min_speedup
        worth_probing = best_k_for_costs(0.9, ratios, min_speedup) > 0
        ks = []
        for seq, limit in zip(seqs, limits):
            alpha = self.acceptance.alpha(seq.seq_id)
            k = best_k_for_costs(alpha, ratios[: limit + 1], min_speedup) if limit else 0
            if k == 0 and limit and worth_probing:
                # Held at 0 by a low acceptance estimate that would otherwise never be revised.
                waited = self.held.get(seq.seq_id, 0) + 1
                if waited >= PROBE_EVERY:
                    k, waited = 1, 0
                self.held[seq.seq_id] = waited
            ks.append(k)
        return ks

    def _room(self, seq: Sequence, k: int) -> int:
        """Drafts beyond ``max_tokens`` (the last emitted token is the bonus) or the context are wasted."""
        params = seq.params
        k = min(k, params.max_tokens - seq.num_output_tokens - 1, self.engine.max_model_len - seq.num_tokens - 1)
        return max(k, 0)

    def finished(self, seq: Sequence) -> None:
        self.acceptance.forget(seq.seq_id)
        self.held.pop(seq.seq_id, None)
        try:
            self.proposer.finished(seq)
        except Exception:
            log.exception("speculative proposer %r failed to release a sequence", self.config.method)
