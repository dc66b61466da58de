"""Per-request and per-sample state the scheduler and runner share.

A ``Request`` is what a user submitted; it owns ``n`` ``Sequence``s (one per sample) that are
scheduled independently. The scheduler's one rule reads two numbers off a sequence:
``num_computed_tokens`` and ``num_tokens_with_spec`` (prompt + output + proposed drafts).
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

from typing import TYPE_CHECKING

import torch

from engine.outputs import RequestMetrics
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.structured.state import GrammarState

_seq_counter = itertools.count()
_request_counter = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    request: "Request"
    index: int
    token_ids: list[int]
    num_prompt_tokens: int
    seq_id: int = field(default_factory=lambda: next(_seq_counter))
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    # Number of leading blocks whose content is registered in the prefix cache.
    num_hashed_blocks: int = 0
    # (digest, parent reference) of each hashed block: where the prefix-cache chain continues.
    block_hashes: list[tuple[bytes, tuple]] = field(default_factory=list)
    # Memo of the prefix-cache digests of its leading full blocks, under the salt they were
    # computed with: token ids only ever grow (a preempted sequence recomputes prompt + output),
    # so they stay valid, and the waiting queue's prefix order reads them every step.
    prefix_digests: list[bytes] = field(default_factory=list)
    prefix_digests_salt: str | None = None
    draft_token_ids: list[int] = field(default_factory=list)
    draft_probs: torch.Tensor | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float = 0.0
    # Incremental detokenisation state (used only when stop strings must be watched).
    text: str = ""
    prefix_offset: int = 0
    read_offset: int = 0
    # Speculation bookkeeping (adaptive k per sequence).
    spec_k: int = 0
    spec_alpha: float = 0.7
    # Structured output: the sample's grammar state (committed tokens only), and how many of
    # its current drafts are the grammar's forced tokens (they lead the drafts).
    grammar: "GrammarState | None" = None
    num_forced_drafts: int = 0
    # No token was left to sample (a logit_bias and min_tokens banning everything between
    # them): the sampler gave EOS, and that EOS ends the sample whatever ignore_eos says.
    cornered: bool = False

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self.token_ids) + len(self.draft_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def all_token_ids_with_spec(self) -> list[int]:
        return self.token_ids + self.draft_token_ids if self.draft_token_ids else self.token_ids


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    seqs: list[Sequence] = field(default_factory=list)
    error: str | None = None
    aborted: bool = False
    # Mixed into the root of this request's prefix-cache chain: only requests with the same salt
    # share cached blocks (vLLM's ``cache_salt``).
    cache_salt: str | None = None
    # The seed sampling uses: params.seed, or one drawn fresh at submission (reported back).
    seed: int | None = None
    # vLLM's request priority: lower is served first (under scheduling_policy="priority").
    priority: int = 0
    # Arrival order (ties between equal keys) and the scheduler step it arrived at (aging).
    arrival_order: int = field(default_factory=lambda: next(_request_counter))
    arrival_step: int = 0

    @property
    def is_finished(self) -> bool:
        return all(seq.is_finished for seq in self.seqs)
