"""Logprobs between the engine, the store and the output line.

The engine gives, per sampled position, ``{token id: logprob}`` holding the sampled token and
the top ``k`` alternatives. The worker packs that compactly into the job's ``outputs`` JSON
(``pack``): per position ``[logprob, [[id, logprob], ... top k, best first]]`` plus each id's
text and bytes once (``pieces``, from the worker's tokenizer, which the producer lacks).
``chat_logprobs`` and ``completion_logprobs`` render the two OpenAI shapes from that.
"""

from __future__ import annotations

from typing import Any, Callable

Pieces = Callable[[list[int]], list[tuple[str, bytes]]]


def pack(token_ids: list[int], logprobs: list[dict[int, float]], k: int, pieces: Pieces) -> dict[str, Any]:
    """``{"logprobs": [...], "pieces": {...}}`` for one sample's stored output."""
    rows = []
    ids: set[int] = set(token_ids)
    for token, entry in zip(token_ids, logprobs):
        # Stable sort: a sampled token tied with the k-th alternative stays in (it came first).
        top = sorted(entry.items(), key=lambda item: -item[1])[:k]
        ids.update(t for t, _ in top)
        rows.append([entry[token], [[t, lp] for t, lp in top]])
    ordered = sorted(ids)
    table = {str(i): [text, data.hex()] for i, (text, data) in zip(ordered, pieces(ordered))}
    return {"logprobs": rows, "pieces": table}


def _piece(sample: dict[str, Any], token: int) -> tuple[str, list[int]]:
    text, hexed = sample["pieces"][str(token)]
    return text, list(bytes.fromhex(hexed))


def chat_logprobs(sample: dict[str, Any]) -> dict[str, Any] | None:
    """``choices[].logprobs`` of a chat completion: ``{"content": [...], "refusal": null}``."""
    rows = sample.get("logprobs")
    if rows is None:
        return None
    content = []
    for token, (lp, top) in zip(sample["token_ids"], rows):
        text, data = _piece(sample, token)
        alternatives = []
        for alt, alt_lp in top:
            alt_text, alt_data = _piece(sample, alt)
            alternatives.append({"token": alt_text, "bytes": alt_data, "logprob": alt_lp})
        content.append({"token": text, "bytes": data, "logprob": lp, "top_logprobs": alternatives})
    return {"content": content, "refusal": None}


def completion_logprobs(sample: dict[str, Any]) -> dict[str, Any] | None:
    """``choices[].logprobs`` of a completion (the legacy shape): tokens, their logprobs, the
    top alternatives plus the sampled token per position (as OpenAI and vLLM give them), and
    each token's character offset into the returned text."""
    rows = sample.get("logprobs")
    if rows is None:
        return None
    tokens, token_logprobs, tops, offsets = [], [], [], []
    offset = 0
    for token, (lp, top) in zip(sample["token_ids"], rows):
        text, _ = _piece(sample, token)
        tokens.append(text)
        token_logprobs.append(lp)
        alternatives = {_piece(sample, alt)[0]: alt_lp for alt, alt_lp in top}
        alternatives.setdefault(text, lp)
        tops.append(alternatives)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}
