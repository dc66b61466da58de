"""What a job row is: its ids, its columns as one insert needs them, and the columns a
message and a claim read of it."""

from __future__ import annotations

import os
import time
from typing import Any, Iterable, Sequence

from worker.store.models import QUEUED


def new_id() -> str:
    """32 hex digits laid out as a UUIDv7: milliseconds since the epoch, then 74 random bits.

    Time-ordered, so a million new jobs are appended at the end of the primary-key index
    instead of landing on random pages (with uuid4 every chunk of rows dirtied about as many
    index pages as it had rows, and ingest slowed as the table grew); still unique and opaque.
    """
    return new_ids(1)[0]


def new_ids(n: int) -> list[str]:
    """``n`` ids as ``new_id`` makes them, from one read of the OS's randomness (a read per id
    was a fifth of building a bulk line's row)."""
    ms = (time.time_ns() // 1_000_000) & (2**48 - 1)
    entropy = os.urandom(10 * n)
    ids = []
    for i in range(0, 10 * n, 10):
        rand = int.from_bytes(entropy[i:i + 10], "big")
        value = ms << 80 | 0x7 << 76 | (rand >> 68 & 0xFFF) << 64 | 0b10 << 62 | (rand & (2**62 - 1))
        ids.append(f"{value:032x}")
    return ids


INVALID_INPUT = "invalid_input"  # error_type of a bad input line (never enqueued)


#: Rows per transaction when a batch is written: a large submit never holds SQLite's one write
#: lock for long, so heartbeats and claims interleave with it.
INSERT_CHUNK = 1000


#: What a publisher reads of a job to send its message: the id the message carries, and what
#: routes it (queue, or model and priority), groups it (params: its tokens to generate) and
#: labels it for Flower (batch, custom_id, line). Never the prompt: the claim returns that.
MESSAGE_FIELDS = ("id", "queue", "model", "priority", "params", "batch_id", "custom_id", "line_no")


#: What a won claim returns of its job (``UPDATE … RETURNING``): the worker's request, from
#: the store, never from a message.
CLAIM_FIELDS = ("model", "prompt", "prompt_token_ids_in", "prompt_tokens", "messages", "params", "priority", "custom_id",
                "queue", "cache_salt", "request_digest")


def job_row(
    *,
    model: str,
    id: str | None = None,
    prompt: str | None = None,
    prompt_token_ids_in: list[int] | None = None,
    prompt_tokens: list[int] | None = None,
    messages: list[dict[str, Any]] | None = None,
    params: dict[str, Any] | None = None,
    endpoint: str | None = None,
    batch_id: str | None = None,
    custom_id: str | None = None,
    line_no: int | None = None,
    status: str = QUEUED,
    enqueued_at: float | None = None,
    error: str | None = None,
    error_type: str | None = None,
    finished_at: float | None = None,
    queue: str | None = None,
    priority: int | None = None,
    user: str | None = None,
    cache_salt: str | None = None,
    request_digest: str | None = None,
    prefix_key: bytes | None = None,
) -> dict[str, Any]:
    """A complete ``jobs`` row as a dict (every row of a bulk insert has the same keys)."""
    return {
        "id": id or new_id(),
        "batch_id": batch_id,
        "custom_id": custom_id,
        "line_no": line_no,
        "model": model,
        "endpoint": endpoint or ("chat" if messages is not None else "completions"),
        "prompt": prompt,
        "prompt_token_ids_in": prompt_token_ids_in,
        "prompt_tokens": prompt_tokens,
        "messages": messages,
        "params": params or {},
        "status": status,
        "attempts": 0,
        "attempts_forgiven": 0,
        "queue": queue,
        "priority": priority,
        "user": user,
        "cache_salt": cache_salt,
        "request_digest": request_digest,
        "prefix_key": prefix_key,
        "enqueued_at": enqueued_at if enqueued_at is not None else time.time(),
        "published_at": enqueued_at if enqueued_at is not None else time.time(),
        "error": error,
        "error_type": error_type,
        "finished_at": finished_at,
    }


def chunks(items: Sequence[Any], n: int) -> Iterable[Sequence[Any]]:
    for i in range(0, len(items), n):
        yield items[i : i + n]

