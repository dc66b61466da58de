"""A proven upper bound on a prompt's token count, from its UTF-8 length, where the tokenizer
allows one: most bulk prompts are far under the context, and counting them exactly was the
largest cost of ingesting a file (about 55 us of CPU a line of 40 tokens, more than parsing).

The bound holds for a BPE tokenizer without a normalizer whose pre-tokenizers only split
(byte-level without an added prefix space, on regexes, digits, punctuation or whitespace):
every BPE symbol then stands for at least one byte of the text (a byte-level character, a
character, or an unknown one) and a merge only joins symbols, so each token covers at least
one byte, and each added token matches at least one. A prompt then has at most as many tokens
as bytes, plus the special tokens the post-processor adds. Any other tokenizer gets no bound,
and every prompt is counted exactly.
"""

from __future__ import annotations

import json
from typing import Any

#: Pre-tokenizers that only cut the text into pieces (none adds characters).
SPLITTING = frozenset({"Split", "Digits", "Punctuation", "Whitespace", "WhitespaceSplit", "UnicodeScripts"})


def byte_bounded(backend: Any) -> bool:
    """Whether ``backend`` (a ``tokenizers.Tokenizer``) makes at most one token per byte."""
    if type(backend.model).__name__ != "BPE" or backend.normalizer is not None:
        return False
    pre = backend.pre_tokenizer
    if pre is None:
        return True
    try:
        state = json.loads(pre.__getstate__())
    except Exception:  # a custom pre-tokenizer: nothing is proven
        return False
    return _only_splits(state)


def _only_splits(state: dict[str, Any]) -> bool:
    kind = state.get("type")
    if kind == "Sequence":
        return all(_only_splits(member) for member in state.get("pretokenizers", []))
    if kind == "ByteLevel":
        return state.get("add_prefix_space") is False
    return kind in SPLITTING


def surely_fits(text: str, limit: int, extra: int = 0) -> bool:
    """``text`` tokenized (plus ``extra`` special tokens) has fewer than ``limit`` tokens, by
    its UTF-8 length alone (at most 4 bytes a character, so most texts need no encoding)."""
    room = limit - extra
    return 4 * len(text) < room or len(text) < room and len(text.encode("utf-8", "surrogatepass")) < room
