"""A structured job's output checked again before it may succeed.

The grammar already constrained every token; this is the store's own check with a different
parser (``json`` + ``jsonschema``, ``re``), so a bug or a keyword the grammar library does not
enforce (xgrammar ignores e.g. ``format``) fails the job instead of reaching a dataset. It also
names the case the grammar cannot prevent: output cut by ``max_tokens`` mid-record.

Outcome per job (documented in README's "Structured output"): status ``failed`` with
``error_type`` ``structured_output_incomplete`` (finish_reason stays ``length``; the partial
text and tokens stay in the store for inspection) or ``structured_output_invalid`` (the text
does not parse or validate; the message names the path). Neither is retried: the same request
would end the same way; raise ``max_tokens`` (or fix the schema) and run ``--retry-failed``.
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any

from engine.structured.params import StructuredOutputsParams

INCOMPLETE = "structured_output_incomplete"
INVALID = "structured_output_invalid"


def check_samples(spec: StructuredOutputsParams, samples: list[tuple[str, str | None, int]]) -> tuple[str, str] | None:
    """``(error_type, message)`` for the first sample (text, finish reason, tokens) that is not
    a complete, valid instance of ``spec``; None when all are."""
    for index, (text, finish_reason, num_tokens) in enumerate(samples):
        which = f"sample {index}: " if len(samples) > 1 else ""
        if finish_reason == "length":
            return INCOMPLETE, (
                f"{which}structured output cut by max_tokens after {num_tokens} tokens, before the {spec.kind} was "
                "complete (finish_reason length; the partial text is kept with the job): raise max_tokens"
            )
        problem = check_text(spec, text)
        if problem is not None:
            return INVALID, f"{which}{problem}"
    return None


def check_text(spec: StructuredOutputsParams, text: str) -> str | None:
    """Why ``text`` is not an instance of ``spec``, or None."""
    kind = spec.kind
    if kind in ("json", "json_object"):
        try:
            value = json.loads(text)
        except ValueError as exc:
            return f"output is not valid JSON: {exc}"
        if kind == "json_object":
            return None if isinstance(value, dict) else f"output is JSON but not an object: {type(value).__name__}"
        return _schema_error(spec.json, value)
    if kind == "choice":
        return None if text in spec.choice else f"output {text[:80]!r} is none of the choices"
    if kind == "regex":
        try:
            pattern = re.compile(spec.regex)
        except re.error:
            return None  # xgrammar's regex dialect beyond Python's: the grammar was the check
        return None if pattern.fullmatch(text) else "output does not match the regex"
    return None  # EBNF: the grammar library is the only parser of it here


@functools.lru_cache(maxsize=64)
def _validator(schema_text: str):
    """A checked validator per distinct schema (a batch usually has one): the schema's own
    check runs once, not per job. Returns the validator or the schema's error message."""
    import jsonschema

    schema = json.loads(schema_text)
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        cls.check_schema(schema)
    except jsonschema.SchemaError as exc:
        return f"the schema itself is invalid: {exc.message}"
    return cls(schema)


def _schema_error(schema: dict[str, Any], value: Any) -> str | None:
    import jsonschema

    validator = _validator(json.dumps(schema, sort_keys=True))
    if isinstance(validator, str):
        return validator
    error = jsonschema.exceptions.best_match(validator.iter_errors(value))
    if error is None:
        return None
    return f"output does not match the schema at {error.json_path}: {error.message[:300]}"
