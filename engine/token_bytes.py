"""A token id's exact bytes and its display text, for logprobs.

OpenAI's logprobs give each token as text plus ``bytes``: a token may hold part of a UTF-8
character (byte-level BPE splits emoji and CJK), and only the bytes can be joined back into
the text. Decoding one id alone turns such a fragment into U+FFFD, so the bytes come from the
token's vocabulary piece instead: byte-level BPE pieces map back through GPT-2's byte
alphabet, SentencePiece byte fallbacks are ``<0xAB>``, anything else is its decoded text.
"""

from __future__ import annotations

import re
import threading
from contextlib import nullcontext

_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def _byte_decoder() -> dict[str, int]:
    """GPT-2's reversible byte -> printable character map, inverted."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1)
    )
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


_BYTE_DECODER = _byte_decoder()


def _uses_byte_level(tokenizer) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    return decoder is not None and "ByteLevel" in type(decoder).__name__ + repr(decoder)[:200]


class TokenBytes:
    """``pieces(ids) -> [(text, bytes)]`` with a cache; safe from any thread given the
    tokenizer's lock (fast tokenizers are not re-entrant)."""

    def __init__(self, tokenizer, lock: threading.Lock | None = None) -> None:
        self.tokenizer = tokenizer
        self._lock = lock or nullcontext()
        self._byte_level = _uses_byte_level(tokenizer)
        self._cache: dict[int, tuple[str, bytes]] = {}

    def pieces(self, ids: list[int]) -> list[tuple[str, bytes]]:
        missing = sorted({i for i in ids if i not in self._cache})
        if missing:
            with self._lock:
                found = {i: self._piece(i) for i in missing}
            self._cache.update(found)
        return [self._cache[i] for i in ids]

    def _piece(self, token_id: int) -> tuple[str, bytes]:
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        data: bytes | None = None
        if isinstance(piece, str):
            match = _BYTE_FALLBACK.match(piece)
            if match:
                data = bytes([int(match.group(1), 16)])
            elif self._byte_level and piece and all(ch in _BYTE_DECODER for ch in piece):
                data = bytes(_BYTE_DECODER[ch] for ch in piece)
        if data is None:
            data = self.tokenizer.decode([token_id], skip_special_tokens=False).encode("utf-8")
        return data.decode("utf-8", errors="replace"), data
