"""The grammar's token mask for a whole batch of sample rows, in one tensor operation.

Each row samples the position after ``row.seq``'s committed tokens and ``row.extra`` (drafts
already placed before it in verification, or a draft model's own drafts). Rows of one sequence
are visited shortest ``extra`` first, so the matcher advances draft by draft and fills a mask
row at each step (O(drafts) accepts, not O(drafts^2)), then rolls everything back. A row behind
a draft the grammar refuses gets no mask: that draft is rejected at the refused row anyway (its
mask excludes it), so the rows after it are never used. Where the grammar forces the text that
follows, the row's mask admits only the first token of that text's canonical tokenisation
(``GrammarState.forced_next`` says why), so forced positions are decided by the grammar alone.

The masks go into one ``[rows, ceil(vocab/32)]`` int32 bitmask and are applied by xgrammar's
kernel (C++ on the CPU, CUDA/Triton on a GPU) to the rows that have a grammar, before
temperature, top-k/p and the noise race: a seeded sample stays a function of (seed, sample,
position, distribution), the distribution now being the masked one.
"""

from __future__ import annotations

import torch

from engine.sequence import Sequence


def _bit(j: int) -> int:
    """Bit ``j`` of an int32 word, as the signed value int32 stores it."""
    return (1 << j) - (1 << 32) if j == 31 else 1 << j


def grammar_rows(rows) -> list[int]:
    return [r for r, row in enumerate(rows) if row.seq.grammar is not None]


def fill_bitmask(rows, indices: list[int], words: int) -> tuple[torch.Tensor, dict[int, int]]:
    """Bitmask ``[len(rows), words]`` with every grammar row's mask (other rows all ones), and
    ``{row: token}`` for the rows the grammar forces to one token."""
    bitmask = torch.full((len(rows), words), -1, dtype=torch.int32)
    forced_rows: dict[int, int] = {}
    by_seq: dict[int, tuple[Sequence, list[int]]] = {}
    for r in indices:
        seq = rows[r].seq
        by_seq.setdefault(seq.seq_id, (seq, []))[1].append(r)
    for seq, members in by_seq.values():
        state = seq.grammar
        members.sort(key=lambda r: len(rows[r].extra))
        pushed: list[int] = []
        refused: list[int] | None = None  # a prefix ending in a refused draft: rows behind it unmasked
        try:
            for r in members:
                extra = rows[r].extra
                if refused is not None and extra[: len(refused)] == refused:
                    continue
                common = 0
                limit = min(len(pushed), len(extra))
                while common < limit and pushed[common] == extra[common]:
                    common += 1
                if common < len(pushed):
                    state.pop(len(pushed) - common)
                    del pushed[common:]
                todo = extra[common:]
                n = state.push(todo)
                pushed.extend(todo[:n])
                if n < len(todo):
                    refused = extra[: len(pushed) + 1]
                    continue
                forced = state.forced_next()
                if forced is None:
                    state.fill(bitmask, r)
                else:  # one admitted token: forced rows are one-hot whatever the noise
                    bitmask[r] = 0
                    bitmask[r, forced // 32] = _bit(forced % 32)
                    forced_rows[r] = forced
        finally:
            state.pop(len(pushed))
    return bitmask, forced_rows


def apply_grammar_mask(logits: torch.Tensor, rows, words: int) -> dict[int, int]:
    """Mask, in place, every row whose sequence has a grammar (a no-op when none has); return
    the forced rows' tokens (their sampling is decided: the sampler skips their noise)."""
    indices = grammar_rows(rows)
    if not indices:
        return {}
    import xgrammar as xgr

    bitmask, forced = fill_bitmask(rows, indices, words)
    if logits.device.type != "cpu":
        bitmask = bitmask.to(logits.device, non_blocking=True)
    vocab = min(logits.shape[1], words * 32)
    if logits.dtype == torch.float32 and logits.is_contiguous():
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab, indices=indices)
    else:
        from engine.structured.state import unpack

        idx = torch.tensor(indices, device=logits.device)
        allowed = unpack(bitmask[idx])[:, :vocab]
        logits[idx, :vocab] = logits[idx, :vocab].masked_fill(~allowed, float("-inf"))
    if logits.shape[1] > vocab:  # ids past the grammar's vocabulary are never admitted
        logits[torch.tensor(indices, device=logits.device), vocab:] = float("-inf")
    return forced
