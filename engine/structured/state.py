"""``GrammarState``: one sample's position in its grammar.

The matcher holds the sample's committed tokens only: ``commit`` advances it with tokens the
engine appended. Every look-ahead (the masks of verification rows after drafts, checking a
proposer's drafts, the forced continuation) pushes tokens temporarily and rolls them back
before returning, so a rejected draft never leaves a trace in the state.
"""

from __future__ import annotations

from typing import Callable

import torch

#: Forced continuations longer than this are cut (the speculator's k is far below it anyway).
MAX_FORCED = 32


class GrammarState:
    __slots__ = ("matcher", "encode", "stop_ids", "_scratch", "num_refused")

    def __init__(self, compiled, encode: Callable[[str], list[int]], stop_ids: set[int], words: int) -> None:
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(compiled, max_rollback_tokens=-1)
        self.encode = encode
        self.stop_ids = stop_ids
        self._scratch = torch.empty((1, words), dtype=torch.int32)
        self.num_refused = 0

    # ------------------------------------------------------------ committed tokens
    def commit(self, token: int) -> bool:
        """Advance with an appended token; False when the grammar refuses it (state unchanged)."""
        return bool(self.matcher.accept_token(token))

    def is_terminated(self) -> bool:
        return bool(self.matcher.is_terminated())

    def must_stop(self) -> bool:
        """The grammar is complete and admits nothing but a stop token: the sample is done."""
        matcher = self.matcher
        if matcher.is_terminated():
            return True
        if not matcher.is_completed():
            return False
        matcher.fill_next_token_bitmask(self._scratch, 0)
        allowed = unpack(self._scratch)[0]
        allowed[sorted(i for i in self.stop_ids if i < allowed.numel())] = False
        return not bool(allowed.any())

    # -------------------------------------------------------------- look-ahead
    def push(self, tokens: list[int]) -> int:
        """Accept ``tokens`` temporarily, up to the first refused one; return how many went in
        (the caller rolls them back with ``pop``)."""
        accepted = 0
        for token in tokens:
            if not self.matcher.accept_token(token):
                break
            accepted += 1
        return accepted

    def pop(self, n: int) -> None:
        if n:
            self.matcher.rollback(n)

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many leading ``tokens`` the grammar admits from here (the state is unchanged)."""
        n = self.push(tokens)
        self.pop(n)
        return n

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def forced_tokens(self, limit: int) -> list[int]:
        """The tokens of the grammar's forced continuation from here (up to ``limit``).

        xgrammar gives the forced text (``find_jump_forward_string``: every string the grammar
        admits next starts with it, e.g. ``{"name": "`` at the start of a record); its tokens are
        the tokenizer's own (canonical) tokenisation of that text, cut at the first token the
        grammar refuses token by token.
        """
        if limit <= 0 or self.matcher.is_terminated():
            return []
        text = self.matcher.find_jump_forward_string()
        if not text:
            return []
        tokens = list(self.encode(text)[: min(limit, MAX_FORCED)])
        return tokens[: self.valid_prefix(tokens)]

    def forced_next(self) -> int | None:
        """The token this position is forced to, or None where the grammar leaves a choice.

        Why force instead of sampling under the mask: inside forced text the mask admits every
        token that is a prefix of it (``"h`` as well as ``"home``), and a masked model picks odd
        splits (``h``, ``om``, ``e``, measured with SmolLM2) where its preferred word was
        masked out; the canonical tokens are what it was trained on. And it makes forced-token
        drafts accepted by construction: a forced row's distribution is one-hot.
        """
        tokens = self.forced_tokens(1)
        return tokens[0] if tokens else None


def unpack(bitmask: torch.Tensor) -> torch.Tensor:
    """``[rows, words]`` int32 bitmask -> ``[rows, 32 * words]`` bool (bit j of word w is token 32w + j)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    return ((bitmask[:, :, None] >> shifts) & 1).bool().view(bitmask.shape[0], -1)
