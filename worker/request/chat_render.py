"""Chat templates rendered by substitution, for counting a million prompts' tokens.

A Jinja chat template costs 20-25 us a conversation, more than the rest of a line's parsing.
Most bulk lines share a handful of shapes (the same roles in the same order, each content a
plain string), and for most templates a shape renders to fixed text around each content. So
each shape is rendered once with placeholder contents and cut into its literal parts; a line
of that shape is then those parts joined with its contents (about 1 us).

A template may transform content (strip it, split it on a marker, test its length): a shape
is only taken when a second rendering, with probe contents full of what templates act on
(edge whitespace, markup, newlines), equals the substitution exactly; otherwise that shape is
always rendered by the template. ``render_many`` gives what ``apply_chat_template(...,
tokenize=False, add_generation_prompt=True)`` gives.
"""

from __future__ import annotations

import re
from typing import Any, Sequence

#: Shapes remembered per tokenizer (a shape is a tuple of roles; a file has a few).
MAX_SHAPES = 256
_SLOT = "\ue000{}\ue001"  # private-use characters: no template writes them
_SLOT_RE = re.compile("\ue000(\\d+)\ue001")
_PROBE = "  <think>\u00e9\t{}</think>\n\n```x```  "


class ChatRenderer:
    """``apply_chat_template`` of many conversations, by substitution where a shape allows."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._parts: dict[tuple[str, ...], list[str] | None] = {}

    def render_many(self, conversations: Sequence[Any]) -> list[str]:
        """Each conversation's prompt text; raises as the template does for one it refuses."""
        out: list[str | None] = [None] * len(conversations)
        slow: list[int] = []
        for i, messages in enumerate(conversations):
            shape = _shape(messages)
            parts = self._shape_parts(shape) if shape is not None else None
            if parts is None:
                slow.append(i)
                continue
            pieces = [parts[0]]
            for message, literal in zip(messages, parts[1:]):
                pieces.append(message["content"])
                pieces.append(literal)
            out[i] = "".join(pieces)
        if slow:
            for i, text in zip(slow, self._template([conversations[i] for i in slow])):
                out[i] = text
        return out  # type: ignore[return-value]

    def _template(self, conversations: list[Any]) -> list[str]:
        return self.tokenizer.apply_chat_template(conversations, tokenize=False, add_generation_prompt=True)

    def _shape_parts(self, shape: tuple[str, ...]) -> list[str] | None:
        if shape in self._parts:
            return self._parts[shape]
        parts = self._compile(shape)
        if len(self._parts) < MAX_SHAPES:
            self._parts[shape] = parts
        return parts

    def _compile(self, shape: tuple[str, ...]) -> list[str] | None:
        """The literal text around each content slot, or None when substitution is not exact."""
        try:
            (rendered,) = self._template([[{"role": r, "content": _SLOT.format(i)} for i, r in enumerate(shape)]])
            pieces = _SLOT_RE.split(rendered)
            literals, slots = pieces[0::2], [int(s) for s in pieces[1::2]]
            if slots != list(range(len(shape))):  # a content dropped, repeated or moved
                return None
            probes = [_PROBE.format(i) for i in range(len(shape))]
            (probed,) = self._template([[{"role": r, "content": p} for r, p in zip(shape, probes)]])
        except Exception:  # a shape the template refuses (e.g. roles out of order): the template says why
            return None
        expected = literals[0] + "".join(p + lit for p, lit in zip(probes, literals[1:]))
        return literals if probed == expected else None


def _shape(messages: Any) -> tuple[str, ...] | None:
    """The roles of a conversation whose every message is exactly a role and a string content."""
    if type(messages) is not list or not messages:
        return None
    roles = []
    for m in messages:
        if type(m) is not dict or len(m) != 2 or type(m.get("content")) is not str or type(m.get("role")) is not str:
            return None
        roles.append(m["role"])
    return tuple(roles)
