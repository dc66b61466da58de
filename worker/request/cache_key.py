"""What makes two requests the same, for the exact result cache and for duplicates in a batch.

Seeded sampling is exact here (the same tokens at any batch, proposer, worker or retry) and
greedy decoding is argmax, so a greedy or seeded result is a pure function of (model, prompt
tokens, sampling parameters, seed, grammar): a cache of them is exact, not approximate. The
key is split in two so each side computes what it knows: ``request_digest`` (the producer, at
ingest, from the tokens it made) and ``model_key`` (the model's file digest and the settings
that change its arithmetic); ``cache_key`` joins them. An unseeded sampled request has no
digest: it must be a fresh sample every time, so it is never cached nor deduplicated.

``prefix_key`` orders a bulk batch's jobs for the pacer so that prompts sharing a prefix (a
system prompt, a template's head) are published together and meet each other's KV blocks in
the engine's prefix cache instead of evicting them.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Sequence

import numpy as np

#: Bumped when anything that changes results without changing these inputs changes (the
#: seeded noise, the sampler's rules): every older entry then simply misses.
CACHE_FORMAT = 1
#: Prompt lengths (characters of the rendered prompt, about 4 a token) at which its head is
#: hashed for the pacer's order: a head shorter than 256 characters (~64 tokens) is not worth
#: grouping for (a block or three of KV), and line order (the output file growing as a prefix)
#: is worth more.
PREFIX_LEVELS = (256, 512, 1024, 2048, 4096, 8192)
#: A row's own tail, never part of its head: a level must leave at least this many characters after it.
PREFIX_TAIL = 128


def is_cacheable(temperature: float, seed_given: bool) -> bool:
    """Greedy requests and requests whose seed the user chose; never an unseeded sample (its
    seed is drawn fresh, so another run must give another sample)."""
    return temperature == 0 or seed_given


def request_digest(tokens: Sequence[int], params: dict[str, Any], cache_salt: str | None) -> str:
    """32 hex digits over the prompt's token ids, the sampling parameters as stored
    (``SamplingParams.to_dict(only_set=True)``: defaults left out, so an explicit default is
    the same request), the grammar (inside the params) and the tenant's salt. A greedy
    request's seed changes nothing it makes, so it is left out."""
    if params.get("temperature", 1.0) == 0 and "seed" in params:
        params = {k: v for k, v in params.items() if k != "seed"}
    head = json.dumps({"format": CACHE_FORMAT, "params": params, "salt": cache_salt},
                      sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    h = hashlib.blake2b(head.encode(), digest_size=16)
    h.update(np.asarray(tokens, dtype="<u4").tobytes())
    return h.hexdigest()


def model_key(weights_digest: str, *, dtype: str | None, quantization: str | None, device: str,
              engine_kwargs: str | None) -> str:
    """32 hex digits naming the model as it computes: its files' digest and the settings that
    change its arithmetic (dtype, quantization, the device kind, extra engine arguments).
    Speculative decoding is left out on purpose: it is lossless, the same tokens either way."""
    kind = device.split(":", 1)[0]
    if dtype in (None, "auto"):  # what an engine on this machine runs: bf16 or fp32 by CPU
        from engine.cpu_features import auto_dtype_name

        dtype = auto_dtype_name(kind, quantization)
    head = json.dumps({"format": CACHE_FORMAT, "weights": weights_digest, "dtype": dtype,
                       "quantization": quantization, "device": kind, "engine": engine_kwargs}, sort_keys=True)
    return hashlib.blake2b(head.encode(), digest_size=16).hexdigest()


def model_key_of(store: Any, settings: Any, model: str | None = None) -> str | None:
    """The ``model_key`` of ``settings``' model as this process runs it: its files' digest,
    remembered by the store (``Store.model_digest``: hashed once per version of the files).
    None for a model that is not a local file or folder (a hub id not fetched here): then
    nothing is cached, since nothing says which weights the name stands for."""
    from pathlib import Path

    from engine.model_hub import resolve_model

    path = Path(resolve_model(model or settings.model))
    if not path.exists():
        return None
    digest = store.model_digest(str(path.resolve()))
    return model_key(digest, dtype=settings.dtype, quantization=settings.quantization, device=settings.device,
                     engine_kwargs=settings.engine_kwargs)


def cache_key(model: str, digest: str) -> str:
    """The result cache's key: a request (``request_digest``) on a model (``model_key``)."""
    return hashlib.blake2b(f"{model}:{digest}".encode(), digest_size=32).hexdigest()


def prefix_levels(text: str) -> list[int]:
    """64-bit hashes of the rendered prompt's head at each of ``PREFIX_LEVELS`` that leaves the
    row a tail of its own (``PREFIX_TAIL`` characters, or half the prompt when that is more):
    where a system prompt or template head may end. Equal heads give equal hashes at every
    level. Taken from the text the prompt's tokens are made of, not from the tokens: rows that
    need no cache key are then not tokenized at ingest (tokenizing every row of a million-line
    file halved ingest speed), and the same text gives the same tokens anyway."""
    n = len(text)
    cut = max(n - PREFIX_TAIL, n // 2)
    h = hashlib.blake2b(digest_size=8)
    out: list[int] = []
    start = 0
    for level in PREFIX_LEVELS:
        if level > cut:
            break
        h.update(text[start:level].encode("utf-8", "surrogatepass"))
        start = level
        out.append(int.from_bytes(h.copy().digest(), "little", signed=True))
    return out


def prefix_key(levels: Sequence[int], shared: Sequence[bool]) -> bytes | None:
    """The pacer's order key of a row (``jobs.prefix_key``): its level hashes (2 bytes each)
    up to the last one another row of the batch shares (``shared``), so rows behind one head
    sort together, like a trie cut at ``PREFIX_LEVELS``, and rows that share nothing keep line
    order (None sorts apart from every group)."""
    depth = 0
    while depth < len(levels) and shared[depth]:
        depth += 1
    if not depth:
        return None
    return b"".join((levels[i] & 0xFFFF).to_bytes(2, "big") for i in range(depth))
