"""Rows of a table (Parquet, CSV, a Hugging Face dataset, JSONL records) -> the engine's request
model, by a ``RowRecipe``: the user message from a column or a Jinja2 template over the
columns, an optional system text or template, the row key, per-row sampling columns and the
batch's own defaults. A bad row (a missing or null column, a template that fails, a negative
``max_tokens``) becomes a ``BadLine`` naming the row and the cause, never a failed run; the
sampling fields go through the same conversion as a Batch line's (``line_sampling_params``).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from functools import cached_property
from typing import Any, Sequence

import jinja2
import jinja2.meta
import jinja2.sandbox

from worker.request.convert import line_sampling_params
from worker.request.formats import MAX_CUSTOM_ID, BadLine, Request
from worker.store.sqltypes import stored_length

#: Columns a row may carry to set its own sampling (null: the batch's value). The same names,
#: rules and messages as a Batch line's body fields.
SAMPLING_COLUMNS = ("max_tokens", "max_completion_tokens", "temperature", "top_p", "seed")


class RecipeError(ValueError):
    """A recipe that can never build a request (a template that does not parse, a column the
    table lacks): the run fails at once with this message, before any row is stored."""


def _finalize(value: Any) -> Any:
    """Every ``{{ expression }}`` passes here: a null cell must fail its row, not print "None"."""
    if value is None:
        raise jinja2.UndefinedError("a column used by the template is null in this row")
    return value


@dataclass(frozen=True)
class RowRecipe:
    """How a table row becomes a chat request (JSON-serialisable: a parsing process gets it as is).

    Exactly one of ``prompt_column`` (the user message as is) and ``template`` (Jinja2, the
    row's columns as variables). ``id_column`` names the row key resume and dedup use (default:
    ``row-N``, N the 1-based row number). ``params`` holds the batch's sampling fields
    (OpenAI names: ``max_tokens``, ``temperature``, ``n``, ``response_format`` …); a row's own
    ``SAMPLING_COLUMNS`` override them.
    """

    prompt_column: str | None = None
    template: str | None = None
    system: str | None = None  # text or a Jinja2 template over the columns
    id_column: str | None = None
    params: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if (self.prompt_column is None) == (self.template is None):
            raise RecipeError("give exactly one of --prompt-column or --template")

    # ---- what the recipe reads ---------------------------------------------------------
    def columns_used(self, available: Sequence[str]) -> list[str]:
        """The table's columns a request is built from (templates' variables, the prompt and id
        columns, sampling columns present); raises ``RecipeError`` for a named column that the
        table does not have (a start that could never succeed)."""
        named = [c for c in (self.prompt_column, self.id_column) if c is not None]
        missing = [c for c in named if c not in available]
        if missing:
            raise RecipeError(f"column {missing[0]!r} is not in the table (its columns: {', '.join(available)})")
        wanted = set(named) | (self._variables & set(available))
        wanted |= {c for c in SAMPLING_COLUMNS if c in available}
        return [c for c in available if c in wanted]

    @cached_property
    def _templates(self) -> tuple[jinja2.Template | None, jinja2.Template | None]:
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(undefined=jinja2.StrictUndefined, finalize=_finalize,
                                                           keep_trailing_newline=True, autoescape=False)
        out = []
        for name, text in (("--template", self.template), ("--system", self.system)):
            if text is None:
                out.append(None)
                continue
            try:
                out.append(env.from_string(text))
            except jinja2.TemplateSyntaxError as exc:
                raise RecipeError(f"{name}: {exc.message} (template line {exc.lineno})") from None
        return out[0], out[1]

    @cached_property
    def _variables(self) -> set[str]:
        env = jinja2.Environment()
        names: set[str] = set()
        for text in (self.template, self.system):
            if text is not None:
                try:
                    names |= jinja2.meta.find_undeclared_variables(env.parse(text))
                except jinja2.TemplateSyntaxError as exc:
                    raise RecipeError(f"template: {exc.message} (line {exc.lineno})") from None
        return names

    def check(self) -> None:
        """Raise ``RecipeError`` now for templates that do not parse and params that are bad
        for every row (the batch's defaults)."""
        self._templates  # noqa: B018  (compiles both, raising RecipeError)
        try:
            line_sampling_params(dict(self.params), "chat")
        except ValueError as exc:
            raise RecipeError(f"sampling: {exc}") from None

    def digest(self) -> str:
        """A short digest of the recipe: a changed template or parameter is another batch."""
        text = json.dumps(asdict(self), sort_keys=True, ensure_ascii=False)
        return hashlib.sha256(text.encode("utf-8")).hexdigest()[:12]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    # ---- rows -> requests ----------------------------------------------------------------
    def request(self, row: dict[str, Any], row_no: int) -> Request | BadLine:
        """One row (its used columns, as Python values) -> a chat ``Request``, or a ``BadLine``
        naming the row and why; never raises."""
        custom_id = f"row-{row_no}"
        if self.id_column is not None:
            key = row.get(self.id_column)
            if key is None or (isinstance(key, str) and not key):
                return _bad(row_no, f"{self.id_column}: the id column is empty in this row", None)
            custom_id = str(key)
            if stored_length(custom_id) > MAX_CUSTOM_ID:
                return _bad(row_no, f"{self.id_column}: an id longer than {MAX_CUSTOM_ID} characters", None)
        template, system = self._templates
        # A null cell is no value: a template that uses it fails its row (StrictUndefined), as a
        # missing key does, rather than printing "None" (or "NONE" through a filter).
        values = {k: v for k, v in row.items() if v is not None}
        try:
            if template is not None:
                user = _render(template, values)
            else:
                user = row.get(self.prompt_column)
                if user is None:
                    return _bad(row_no, f"{self.prompt_column}: the prompt column is null in this row", custom_id)
                if not isinstance(user, str):
                    return _bad(row_no, f"{self.prompt_column}: the prompt must be text, got "
                                        f"{type(user).__name__}", custom_id)
            system_text = _render(system, values) if system is not None else None
        except jinja2.UndefinedError as exc:
            return _bad(row_no, f"template: {exc.message} (a column null or missing in this row)", custom_id)
        except Exception as exc:  # a template's own error (a filter on the wrong type, a division by zero)
            return _bad(row_no, f"template: {type(exc).__name__}: {exc}"[:300], custom_id)
        if not user:
            return _bad(row_no, "prompt: the user message is empty in this row", custom_id)
        fields = dict(self.params)
        for name in SAMPLING_COLUMNS:
            value = _number(row.get(name))
            if value is not None:
                fields[name] = value
        try:
            params = line_sampling_params(fields, "chat")
        except ValueError as exc:
            return _bad(row_no, str(exc), custom_id)
        messages = ([{"role": "system", "content": system_text}] if system_text else []) + \
            [{"role": "user", "content": user}]
        return Request(row_no, custom_id, "chat", params, messages=messages)


def _render(template: jinja2.Template, values: dict[str, Any]) -> str:
    """``template.render(values)`` at half its cost (a million rows: seconds of ingest): the
    context is the template's globals and the row in one dict (``shared``), not a chain of
    copies; errors are raised as they are (the caller turns them into error rows)."""
    context = template.new_context({**template.globals, **values}, shared=True)
    return template.environment.concat(template.root_render_func(context))  # type: ignore[attr-defined]


def _number(value: Any) -> Any:
    """A sampling cell as a number: CSV cells are read as text ("5", "0.7"); "" is no value."""
    if not isinstance(value, str):
        return value
    text = value.strip()
    if not text:
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return value  # the field's own check names it


def _bad(row_no: int, error: str, custom_id: str | None) -> BadLine:
    return BadLine(row_no, error, custom_id, unit="row")
