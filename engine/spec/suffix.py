"""Suffix decoding: propose what most often followed the current context's longest matched suffix
in this run's outputs, or in the request's own prompt and output (SuffixDecoding, arXiv
2411.04975; ArcticInference's cache, in Python).

``SuffixIndex`` is a trie holding every substring of length ``<= max_depth`` of the token lists
inserted into it, each node counting its occurrences. Lists grow by appending (a running
sequence's output as it is accepted): each new token extends the at most
``max_depth`` substrings that ended at the previous token, O(depth) per token. Lists are kept
in FIFO order and the oldest finished ones are evicted (their counts subtracted) once the
index holds more than ``max_tokens`` tokens. The trie is closed under suffixes, so the longest
suffix of a context present in it is found by binary search on its length.

A bulk job whose outputs share structure (JSON records with the same keys, one template) thus
drafts the shared parts after the first few requests, and more of them as the run goes on.
"""

from __future__ import annotations

from collections import OrderedDict

from engine.sequence import Sequence
from engine.spec.ngram import NgramIndex, continuation
from engine.spec.proposer import EMPTY, Proposal


class Node:
    __slots__ = ("count", "children")

    def __init__(self) -> None:
        self.count = 0
        self.children: dict[int, Node] = {}


class _Entry:
    """One inserted token list and the nodes of the substrings ending at its last token."""

    __slots__ = ("tokens", "active", "done")

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.active: list[Node] = []  # active[d - 1]: node of the last d tokens, d < max_depth
        self.done = False


class SuffixIndex:
    def __init__(self, max_depth: int = 24, max_tokens: int = 200_000) -> None:
        self.max_depth = max_depth
        self.max_tokens = max_tokens
        self.root = Node()
        self.entries: OrderedDict[object, _Entry] = OrderedDict()
        self.num_tokens = 0

    # ------------------------------------------------------------- building
    def extend(self, key: object, tokens: list[int]) -> None:
        """Append ``tokens`` to the list ``key`` (created on first use)."""
        entry = self.entries.get(key)
        if entry is None:
            entry = self.entries[key] = _Entry()
        depth = self.max_depth
        root = self.root
        active = entry.active
        for token in tokens:
            nxt: list[Node] = []
            for parent in [root, *active]:
                child = parent.children.get(token)
                if child is None:
                    child = parent.children[token] = Node()
                child.count += 1
                if len(nxt) < depth - 1:
                    nxt.append(child)
            active = nxt
        entry.active = active
        entry.tokens.extend(tokens)
        self.num_tokens += len(tokens)
        self._evict()

    def close(self, key: object) -> None:
        """``key`` will not grow any more; it may now be evicted."""
        entry = self.entries.get(key)
        if entry is not None:
            entry.done = True
            entry.active = []
            self._evict()

    def _evict(self) -> None:
        while self.num_tokens > self.max_tokens:
            victim = next((k for k, e in self.entries.items() if e.done), None)
            if victim is None:
                return  # only running lists left: they stay until they finish
            self._remove(self.entries.pop(victim).tokens)

    def _remove(self, tokens: list[int]) -> None:
        depth = self.max_depth
        for start in range(len(tokens)):
            node = self.root
            for token in tokens[start : start + depth]:
                child = node.children[token]
                child.count -= 1
                if child.count == 0:
                    del node.children[token]
                    break  # the whole subtree counted only this occurrence
                node = child
        self.num_tokens -= len(tokens)

    # ------------------------------------------------------------ querying
    def _walk(self, tokens: list[int]) -> Node | None:
        node = self.root
        for token in tokens:
            node = node.children.get(token)
            if node is None:
                return None
        return node

    def longest_suffix(self, context: list[int]) -> tuple[int, Node]:
        """``(length, node)`` of the longest suffix of ``context`` that has a continuation."""
        lo, hi = 0, min(len(context), self.max_depth - 1)
        while lo < hi:  # present(m) is monotone: the trie is closed under suffixes
            mid = (lo + hi + 1) // 2
            if self._walk(context[len(context) - mid :]) is not None:
                lo = mid
            else:
                hi = mid - 1
        for m in range(lo, 0, -1):
            node = self._walk(context[len(context) - m :])
            if node is not None and node.children:
                return m, node
        return 0, self.root

    def speculate(self, context: list[int], k: int, min_prob: float = 0.1, spec_factor: float = 1.0) -> list[int]:
        return self.speculate_with_length(context, k, min_prob, spec_factor)[1]

    def speculate_with_length(
        self, context: list[int], k: int, min_prob: float = 0.1, spec_factor: float = 1.0
    ) -> tuple[int, list[int]]:
        """``(match length, up to k tokens)``: the most frequent continuation of the longest
        matched suffix, while its estimated probability (the product of child/parent counts
        along the path) stays ``>= min_prob``; at most ``match length * spec_factor`` tokens."""
        length, node = self.longest_suffix(context)
        matched = length
        if length == 0:
            return 0, []
        k = min(k, max(1, int(length * spec_factor)))
        out: list[int] = []
        prob = 1.0
        while len(out) < k:
            if not node.children:  # at max depth: re-anchor on the extended context
                length, node = self.longest_suffix(context + out)
                if length == 0:
                    break
            token, child = max(node.children.items(), key=lambda kv: kv[1].count)
            prob *= child.count / node.count
            if prob < min_prob:
                break
            out.append(token)
            node = child
        return matched, out


class SuffixProposer:
    """Drafts from two indexes, as ArcticInference does: a global ``SuffixIndex`` over the outputs
    of this run (running and finished sequences), and the sequence's own prompt and output (a
    prompt-lookup index, longest n-gram up to ``LOCAL_MAX_N``). The longer match wins; on a tie
    the global one, whose counts say how often the continuation held.

    Prompts stay out of the global index on purpose: a bulk job repeats one instruction in every
    prompt, and its words would otherwise outvote the outputs' own structure (after ``"name`` the
    instruction's ``",`` instead of the records' ``":``).

    A sequence's output is inserted up to, not including, its last token, so the context being
    matched is not trivially found as its own (continuation-less) occurrence.
    """

    LOCAL_MAX_N = 8

    def __init__(self, max_depth: int, max_tokens: int, min_prob: float, spec_factor: float) -> None:
        self.index = SuffixIndex(max_depth, max_tokens)
        self.min_prob = min_prob
        self.spec_factor = spec_factor
        self.inserted: dict[int, int] = {}  # seq_id -> tokens of it in the global index
        self.local: dict[int, NgramIndex] = {}

    def _sync(self, seq: Sequence, end: int) -> None:
        done = self.inserted.get(seq.seq_id, seq.num_prompt_tokens)
        if end > done:
            self.index.extend(seq.seq_id, seq.token_ids[done:end])
        self.inserted[seq.seq_id] = max(done, end)

    def _local(self, seq: Sequence, k: int, ahead: list[int] | None = None) -> tuple[int, list[int]]:
        index = self.local.get(seq.seq_id)
        if index is None:
            index = self.local[seq.seq_id] = NgramIndex(1, self.LOCAL_MAX_N)
        hit = index.match(seq.token_ids, ahead)
        if hit is None:
            return 0, []
        pos, n = hit
        context = seq.token_ids + ahead if ahead else seq.token_ids
        return n, continuation(context, pos, min(k, max(1, int(n * self.spec_factor))))

    supports_lookahead = True

    def propose(self, seqs: list[Sequence], ks: list[int], lookahead: list[list[int]] | None = None) -> list[Proposal]:
        out: list[Proposal] = []
        for i, (seq, k) in enumerate(zip(seqs, ks)):
            self._sync(seq, seq.num_tokens - 1)
            if k <= 0:
                out.append(EMPTY)
                continue
            ahead = lookahead[i] if lookahead else None
            context = seq.token_ids + ahead if ahead else seq.token_ids  # the indexes hold committed tokens only
            length, tokens = self.index.speculate_with_length(context, k, self.min_prob, self.spec_factor)
            local_length, local_tokens = self._local(seq, k, ahead)
            if local_length > length:
                tokens = local_tokens
            out.append(Proposal(tokens) if tokens else EMPTY)
        return out

    def finished(self, seq: Sequence) -> None:
        if seq.seq_id in self.inserted and seq.finish_reason not in ("abort", "error"):
            self._sync(seq, seq.num_tokens)
        self.inserted.pop(seq.seq_id, None)
        self.local.pop(seq.seq_id, None)
        self.index.close(seq.seq_id)
