"""The one interface every proposer implements, so the speculator never knows which runs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from engine.sequence import Sequence


@dataclass(slots=True)
class Proposal:
    """Up to k draft tokens for one sequence.

    ``probs[i]`` is the distribution ``tokens[i]`` was drawn from (after the request's own
    sampling transforms); ``None`` means point masses (n-gram and suffix drafts).
    """

    tokens: list[int]
    probs: torch.Tensor | None = None


EMPTY = Proposal([])


class Proposer(Protocol):
    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Proposal]:
        """Drafts for each decoding sequence; ``ks[i] == 0`` asks only to keep indexes current.

        A proposer with ``supports_lookahead = True`` also takes ``lookahead=`` (one token list
        per sequence: tokens already decided after its committed ones, a grammar's forced
        tokens) and drafts what follows them.
        """
        ...

    def finished(self, seq: Sequence) -> None:
        """``seq`` has ended: drop (or archive) its per-sequence state."""
        ...


class NullProposer:
    """Proposes nothing: the speculator then carries only a grammar's forced tokens."""

    supports_lookahead = True

    def propose(self, seqs: list[Sequence], ks: list[int], lookahead: list[list[int]] | None = None) -> list[Proposal]:
        return [EMPTY] * len(seqs)

    def finished(self, seq: Sequence) -> None:
        pass
