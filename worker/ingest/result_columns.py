"""The columns a table's results add beside its own: the completion, its finish reason and
seed (``completion_0..K-1``, ``seed_0..K-1`` for ``--n K``: each sample's own seed, which reruns
it alone), token counts, timings and the error, and with
``--json-schema`` the answer's top-level fields as typed columns (objects as structs, arrays as
lists; parts of a schema with no one type, such as ``anyOf``, as JSON text).

One place knows these names and types; the output writer only lays them out per format.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import pyarrow as pa

#: Columns every table output gets after the completion columns, with their types.
FIXED = (("prompt_tokens", pa.int64()), ("completion_tokens", pa.int64()), ("queue_wait_s", pa.float64()), ("ttft_s", pa.float64()), ("tpot_s", pa.float64()),
         ("error", pa.string()))
_SCALARS = {"string": pa.string(), "integer": pa.int64(), "number": pa.float64(), "boolean": pa.bool_()}


@dataclass(frozen=True, slots=True)
class FieldType:
    """A schema node as an arrow type, and how a parsed JSON value becomes a cell of it."""

    arrow: pa.DataType
    convert: Callable[[Any], Any]
    nested: bool  # a struct or list: JSON text in a CSV


def field_type(schema: Any) -> FieldType:
    """The arrow type of one JSON schema node (see the module's docstring)."""
    if not isinstance(schema, dict):
        return _json_text()
    kind = schema.get("type")
    if isinstance(kind, list):
        kinds = [k for k in kind if k != "null"]
        kind = kinds[0] if len(kinds) == 1 else None
    if kind is None and "enum" in schema and all(isinstance(v, str) for v in schema["enum"]):
        kind = "string"
    if kind is None and "const" in schema and isinstance(schema["const"], str):
        kind = "string"
    if kind in _SCALARS:
        cast = {"number": lambda v: None if v is None else float(v)}.get(kind, lambda v: v)
        return FieldType(_SCALARS[kind], cast, False)
    if kind == "array" and isinstance(schema.get("items"), dict):
        item = field_type(schema["items"])
        return FieldType(pa.list_(item.arrow),
                         lambda v: None if v is None else [item.convert(x) for x in v], True)
    if kind == "object" and isinstance(schema.get("properties"), dict) and schema["properties"]:
        props = {name: field_type(sub) for name, sub in schema["properties"].items()}
        arrow = pa.struct([(name, t.arrow) for name, t in props.items()])
        return FieldType(arrow, lambda v: None if v is None else {n: t.convert(v.get(n)) for n, t in props.items()},
                         True)
    return _json_text()


def _json_text() -> FieldType:
    return FieldType(pa.string(), lambda v: None if v is None else json.dumps(v, ensure_ascii=False), False)


class ResultColumns:
    """The result columns of one table batch: their names, arrow types, and values per job."""

    def __init__(self, *, n: int = 1, json_schema: dict[str, Any] | None = None) -> None:
        self.n = n
        suffixes = [""] if n == 1 else [f"_{i}" for i in range(n)]
        self.samples = suffixes
        props = (json_schema or {}).get("properties") if isinstance(json_schema, dict) else None
        self.fields: dict[str, FieldType] = ({name: field_type(sub) for name, sub in props.items()}
                                             if isinstance(props, dict) else {})
        cols: list[tuple[str, pa.DataType]] = []
        for s in suffixes:
            cols += [(f"completion{s}", pa.string()), (f"finish_reason{s}", pa.string()), (f"seed{s}", pa.int64())]
        for s in suffixes:
            cols += [(f"{name}{s}", t.arrow) for name, t in self.fields.items()]
        cols += list(FIXED)
        self.schema = pa.schema(cols)
        self.names = list(self.schema.names)
        self._nested = {f"{name}{s}" for s in suffixes for name, t in self.fields.items() if t.nested}

    def is_nested(self, name: str) -> bool:
        return name in self._nested

    def values(self, jobs: Sequence[Any]) -> dict[str, list[Any]]:
        """Each column's values for ``jobs`` (finished ``Job`` rows), as Python values."""
        from engine.sampler import sample_seed  # the engine's own rule: one source of truth

        out: dict[str, list[Any]] = {name: [] for name in self.names}
        for job in jobs:
            seed = (job.params or {}).get("seed")
            ok = job.status == "succeeded"
            samples = (job.outputs or [{"text": job.output_text or "", "finish_reason": job.finish_reason}]) if ok else []
            for i, s in enumerate(self.samples):
                sample = samples[i] if i < len(samples) else None
                out[f"completion{s}"].append(sample["text"] if sample else None)
                out[f"finish_reason{s}"].append(sample.get("finish_reason") if sample else None)
                out[f"seed{s}"].append(sample_seed(seed, i) if isinstance(seed, int) else None)
                record = _record(sample["text"]) if sample and self.fields else None
                for name, t in self.fields.items():
                    out[f"{name}{s}"].append(t.convert(record.get(name)) if isinstance(record, dict) else None)
            out["prompt_tokens"].append(job.num_prompt_tokens if ok else None)
            out["completion_tokens"].append(job.num_output_tokens if ok else None)
            out["queue_wait_s"].append(job.queue_wait_s)
            out["ttft_s"].append(job.ttft_s)
            out["tpot_s"].append(job.tpot_s)
            out["error"].append(None if ok else (job.error or job.status))
        return out


def _record(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None
