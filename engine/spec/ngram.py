"""Prompt-lookup (n-gram) proposer: copy what followed the last n tokens earlier in the context.

Each sequence keeps a hash index ``n-gram -> position right after its latest occurrence`` for every
n in ``[prompt_lookup_min, prompt_lookup_max]``, extended incrementally as tokens arrive, so a
step costs O(new tokens x n) dict operations per sequence instead of a scan of the context.
The longest n that matches wins. The latest occurrence is used: in rewriting and extraction the
most recent copy of a phrase is the one being followed. A continuation that runs into the end
of the context repeats with the match's period, which drafts repetitive loops in full.
"""

from __future__ import annotations

from engine.sequence import Sequence
from engine.spec.proposer import EMPTY, Proposal


class NgramIndex:
    """n-gram index over one token list; ``indexed`` is the next follow-position to add."""

    __slots__ = ("n_min", "n_max", "maps", "indexed")

    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min, self.n_max = n_min, n_max
        self.maps: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(n_min, n_max + 1)}
        self.indexed = 1

    def extend(self, tokens: list[int], end: int) -> None:
        """Index every n-gram followed by a token at a position ``< end``."""
        maps = self.maps
        for i in range(self.indexed, end):
            for n, table in maps.items():
                if n <= i:
                    table[tuple(tokens[i - n : i])] = i
        self.indexed = max(self.indexed, end)

    def match(self, tokens: list[int], ahead: list[int] | None = None) -> tuple[int, int] | None:
        """``(follow position, n)`` of the longest n-gram ending the context seen before, if any.

        ``ahead``: tokens decided after ``tokens`` but not committed (a grammar's forced ones):
        the n-gram ending them is looked up, and only ``tokens`` is indexed.
        """
        self.extend(tokens, len(tokens))
        if ahead:
            tokens = tokens + ahead
        length = len(tokens)
        for n in range(min(self.n_max, length - 1), self.n_min - 1, -1):
            pos = self.maps[n].get(tuple(tokens[length - n :]))
            if pos is not None:
                return pos, n
        return None


def continuation(tokens: list[int], pos: int, k: int) -> list[int]:
    """``k`` tokens from ``pos``; past the end the draft repeats itself (period ``len - pos``)."""
    length = len(tokens)
    out: list[int] = []
    for j in range(k):
        p = pos + j
        out.append(tokens[p] if p < length else out[p - length])
    return out


class NgramProposer:
    supports_lookahead = True

    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min, self.n_max = n_min, n_max
        self.indexes: dict[int, NgramIndex] = {}

    def propose(self, seqs: list[Sequence], ks: list[int], lookahead: list[list[int]] | None = None) -> list[Proposal]:
        out: list[Proposal] = []
        for i, (seq, k) in enumerate(zip(seqs, ks)):
            if k <= 0:
                out.append(EMPTY)
                continue
            index = self.indexes.get(seq.seq_id)
            if index is None:
                index = self.indexes[seq.seq_id] = NgramIndex(self.n_min, self.n_max)
            ahead = lookahead[i] if lookahead else None
            hit = index.match(seq.token_ids, ahead)
            context = seq.token_ids + ahead if ahead else seq.token_ids
            out.append(Proposal(continuation(context, hit[0], k)) if hit else EMPTY)
        return out

    def finished(self, seq: Sequence) -> None:
        self.indexes.pop(seq.seq_id, None)
