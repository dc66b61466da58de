"""``specbatch run``'s table flags -> what a table batch needs: the table, the row recipe and
the output writer, all checked before anything starts (a recipe or output that can never work
fails at once with its cause, never after a worker is up)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from worker.ingest.result_columns import ResultColumns
from worker.ingest.table_output import TableOutput, default_output, kept_columns, output_format
from worker.ingest.tables import Table, TableError, default_recipe, table_source
from worker.request.table_rows import RecipeError, RowRecipe


def _text(value: str | None, flag: str) -> str | None:
    """A flag's text, or the file it names with ``@FILE``."""
    if value is None or not value.startswith("@"):
        return value
    try:
        return Path(value[1:]).read_text(encoding="utf-8")
    except OSError as exc:
        raise RecipeError(f"{flag} {value}: {exc.strerror}") from None


@dataclass(frozen=True)
class TablePlan:
    """A table batch as the run needs it."""

    table: Table
    recipe: RowRecipe
    results: ResultColumns
    keep: list[str] | None
    output: Path

    def writer(self, store: Any, batch_id: str, *, fresh: bool, flush_rows: int, flush_seconds: float) -> TableOutput:
        return TableOutput(self.output, store, batch_id, self.table, self.results, keep=self.keep, fresh=fresh,
                           flush_rows=flush_rows, flush_seconds=flush_seconds)


@dataclass(frozen=True)
class TableOptions:
    """The flags as given (None: not given)."""

    fmt: str | None = None
    prompt_column: str | None = None
    template: str | None = None
    system: str | None = None
    id_column: str | None = None
    keep: str | None = None
    n: int | None = None
    json_schema: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None

    @property
    def _recipe_given(self) -> bool:
        return self.prompt_column is not None or self.template is not None

    @property
    def _table_only(self) -> list[str]:
        flags = {"--system": self.system, "--id-column": self.id_column, "--keep": self.keep, "--n": self.n,
                 "--json-schema": self.json_schema, "--max-tokens": self.max_tokens,
                 "--temperature": self.temperature}
        return [flag for flag, value in flags.items() if value is not None]

    def recipe(self) -> RowRecipe | None:
        """The row recipe the flags describe (None: no prompt named)."""
        if not self._recipe_given:
            return None
        return RowRecipe(prompt_column=self.prompt_column, template=_text(self.template, "--template"),
                         system=_text(self.system, "--system"), id_column=self.id_column, params=self._params())

    def _params(self) -> dict[str, Any]:
        params: dict[str, Any] = {}
        if self.max_tokens is not None:
            params["max_tokens"] = self.max_tokens
        if self.temperature is not None:
            params["temperature"] = self.temperature
        if self.n is not None and self.n > 1:
            params["n"] = self.n
        schema = self._schema()
        if schema is not None:
            params["response_format"] = {"type": "json_schema", "json_schema": {"name": "row", "schema": schema}}
        return params

    def _schema(self) -> dict[str, Any] | None:
        if self.json_schema is None:
            return None
        try:
            schema = json.loads(Path(self.json_schema).read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise RecipeError(f"--json-schema {self.json_schema}: not a JSON file: {exc}") from None
        if not isinstance(schema, dict):
            raise RecipeError(f"--json-schema {self.json_schema}: a schema is a JSON object")
        return schema

    def open(self, path: Path, output: str | None) -> TablePlan | None:
        """The plan for ``path`` when it is a table (None: OpenAI Batch lines); raises
        ``ValueError`` (``TableError``, ``RecipeError``) for what can never work."""
        recipe = self.recipe()
        table = table_source(path, recipe, self.fmt)
        if table is None:
            if self._table_only:
                raise TableError(f"{', '.join(self._table_only)}: for a table's rows; {path.name} is read as OpenAI "
                                 "Batch lines (name the prompt with --prompt-column or --template to read it as records)")
            return None
        if recipe is None:
            recipe = default_recipe(table)
            if self._table_only:
                recipe = RowRecipe(prompt_column=recipe.prompt_column, system=_text(self.system, "--system"),
                                   id_column=self.id_column, params=self._params())
        recipe.check()
        recipe.columns_used(table.column_names)
        results = ResultColumns(n=self.n or 1, json_schema=self._schema())
        keep = [c.strip() for c in self.keep.split(",") if c.strip()] if self.keep is not None else None
        out = Path(output).resolve() if output else default_output(path, table.format)
        output_format(out, table.format)  # an extension we cannot write: now, not after the run
        kept_columns(table, keep, results)
        return TablePlan(table, recipe, results, keep, out)

