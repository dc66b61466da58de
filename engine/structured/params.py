"""``StructuredOutputsParams``: what a request's output must match (vLLM's names and shape).

Exactly one of ``json`` (a JSON schema, as an object or its JSON text), ``json_object`` (any
JSON object: OpenAI's ``{"type": "json_object"}``), ``regex``, ``choice`` (a list of strings)
or ``grammar`` (EBNF in xgrammar's dialect, GBNF-like) is given. Only the shape is checked here;
whether the grammar compiles is known when the engine compiles it, and a failure there fails
that request alone.

``disable_any_whitespace`` is vLLM's field with a different default: True here. JSON is
generated with ``json.dumps``'s separators (``", "`` and ``": "``) and no other whitespace:
one layout makes keys, quotes and commas forced tokens (drafted for free) and keeps a sampled
model from running away in whitespace at temperature 1. False allows any JSON whitespace.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

#: Bound on a grammar's source text (a schema's JSON, a regex, an EBNF, the choices joined).
MAX_SPEC_CHARS = 1_000_000
KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutputsParams:
    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = True

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                "structured_outputs needs exactly one of json, json_object, regex, choice or grammar"
                + (f" (got {', '.join(given)})" if given else "")
            )
        if self.json is not None:
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except ValueError as exc:
                    raise ValueError(f"structured_outputs json is not valid JSON text: {exc}") from None
            if not isinstance(schema, dict):
                raise ValueError(f"structured_outputs json must be a JSON schema object, got {type(schema).__name__}")
            try:
                json.dumps(schema, allow_nan=False)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"structured_outputs json must be plain JSON: {str(exc)[:80]}") from None
            object.__setattr__(self, "json", schema)
        if self.json_object is not None and self.json_object is not True:
            raise ValueError(f"structured_outputs json_object must be true, got {str(self.json_object)[:40]}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs {name} must be a non-empty string")
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise ValueError("structured_outputs choice must be a non-empty list of non-empty strings")
            object.__setattr__(self, "choice", list(self.choice))
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError("structured_outputs disable_any_whitespace must be true or false")
        if len(self.source()) > MAX_SPEC_CHARS:
            raise ValueError(f"structured_outputs {self.kind} is over {MAX_SPEC_CHARS} characters")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def source(self) -> str:
        """The grammar's source as canonical text (schemas with sorted keys)."""
        kind = self.kind
        if kind == "json":
            return json.dumps(self.json, sort_keys=True, ensure_ascii=False)
        if kind == "json_object":
            return ""
        if kind == "choice":
            return json.dumps(self.choice, ensure_ascii=False)
        return getattr(self, kind)

    def key(self) -> tuple[str, str, bool]:
        """What identifies a compiled grammar: equal keys share one compilation."""
        return (self.kind, self.source(), self.disable_any_whitespace)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {self.kind: getattr(self, self.kind)}
        if not self.disable_any_whitespace:
            out["disable_any_whitespace"] = False
        return out

    @classmethod
    def from_any(cls, value: Any) -> "StructuredOutputsParams | None":
        """A params object, a dict of its fields (JSON), or None."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"structured_outputs must be an object, got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(str(k)[:40] for k in value if k not in known)
        if unknown:
            raise ValueError(f"structured_outputs has unsupported field(s): {', '.join(unknown)} "
                             f"(supported: {', '.join(sorted(known))})")
        return cls(**value)
