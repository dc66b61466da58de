"""Tables on disk, read in row order a record batch at a time, never whole: Parquet and CSV/TSV
through pyarrow, JSONL records, and Hugging Face ``datasets`` (a ``save_to_disk`` folder or
files ``load_dataset`` reads, memory-mapped). The format comes from ``--format`` or the path.

A row is numbered from 1 (a CSV's header and a JSONL file's blank lines are not rows), the
same way when the ingest reads the table and when the output writer reads it again to keep
its columns beside the results. CSV cells are read as text, so a CSV comes back exactly as it
was written (leading zeros, number formats); Parquet and datasets columns keep their types.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Iterator, Sequence

import pyarrow as pa

#: Formats a table source may have; "jsonl" here means records that are not Batch requests.
TABLE_FORMATS = ("parquet", "csv", "tsv", "jsonl", "datasets")
_SUFFIXES = {".parquet": "parquet", ".pq": "parquet", ".csv": "csv", ".tsv": "tsv", ".tab": "tsv",
             ".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl"}
#: Rows per record batch read: big enough that per-batch costs vanish, small enough that memory
#: stays a few MB whatever the table's size.
BATCH_ROWS = 4096


class TableError(ValueError):
    """A table that cannot be read at all (the run fails at once with this message)."""


def table_format(path: str | Path, given: str | None = None) -> str:
    """The format of ``path``: ``given`` (``--format``), else its extension; a folder is a
    Hugging Face dataset."""
    if given is not None:
        if given not in TABLE_FORMATS:
            raise TableError(f"--format must be one of {', '.join(TABLE_FORMATS)}, not {given!r}")
        return given
    p = Path(path)
    if p.is_dir():
        return "datasets"
    fmt = _SUFFIXES.get(p.suffix.lower())
    if fmt is None:
        raise TableError(f"{p.name}: no table format for the extension {p.suffix or '(none)'!r}; "
                         f"pass --format ({', '.join(TABLE_FORMATS)})")
    return fmt


@dataclass(frozen=True, slots=True)
class BadRecord:
    """A JSONL line that is no record (malformed JSON, not an object): its row's error."""

    error: str


class Table:
    """One table source: its columns, and its rows from any row on, in order."""

    def __init__(self, path: str | Path, fmt: str | None = None, *, batch_rows: int = BATCH_ROWS) -> None:
        self.path = Path(path)
        self.format = table_format(self.path, fmt)
        self.batch_rows = batch_rows
        if not self.path.exists():
            raise TableError(f"{self.path}: no such file or folder")

    # ---- what it holds -------------------------------------------------------------------
    @cached_property
    def schema(self) -> pa.Schema | None:
        """The arrow schema (None for JSONL records, whose keys can differ from line to line)."""
        if self.format == "parquet":
            import pyarrow.parquet as pq

            return pq.ParquetFile(self.path).schema_arrow
        if self.format in ("csv", "tsv"):
            return pa.schema([(name, pa.string()) for name in self._csv_names])
        if self.format == "datasets":
            return self._dataset.features.arrow_schema
        return None

    @cached_property
    def column_names(self) -> list[str]:
        if self.schema is not None:
            return list(self.schema.names)
        names: dict[str, None] = {}
        for _, record in self._json_records(0, limit=1000):  # JSONL: the keys of its first records
            if isinstance(record, dict):
                names.update(dict.fromkeys(record))
        return list(names)

    @cached_property
    def nbytes(self) -> int:
        """Bytes on disk (a dataset folder's files together): whether a parsing process pays."""
        if self.path.is_dir():
            return sum(p.stat().st_size for p in self.path.rglob("*") if p.is_file())
        return self.path.stat().st_size

    @cached_property
    def num_rows_hint(self) -> int | None:
        """The row count where the format's metadata holds it (Parquet, datasets), else None."""
        if self.format == "parquet":
            import pyarrow.parquet as pq

            return pq.ParquetFile(self.path).metadata.num_rows
        if self.format == "datasets":
            return len(self._dataset)
        return None

    @cached_property
    def features(self) -> Any:
        """A Hugging Face dataset's ``Features`` (class labels and all), else None."""
        return self._dataset.features if self.format == "datasets" else None

    # ---- rows ----------------------------------------------------------------------------
    def batches(self, columns: Sequence[str] | None = None, *, skip: int = 0) -> Iterator[pa.RecordBatch]:
        """Record batches of ``columns`` (all: None) from row ``skip + 1`` on (arrow formats)."""
        cols = list(columns) if columns is not None else None
        if self.format == "parquet":
            yield from self._parquet_batches(cols, skip)
        elif self.format in ("csv", "tsv"):
            yield from self._csv_batches(cols, skip)
        elif self.format == "datasets":
            ds = self._dataset.with_format("arrow")
            for start in range(skip, len(ds), self.batch_rows):
                table = ds[start:start + self.batch_rows]
                yield from (table.select(cols) if cols is not None else table).to_batches()
        else:
            raise TableError("JSONL records are read as records, not record batches")

    def records(self, columns: Sequence[str] | None = None, *, skip: int = 0
                ) -> Iterator[tuple[int, dict[str, Any] | BadRecord]]:
        """(row number, the row's ``columns`` as Python values, or a ``BadRecord``) from row
        ``skip + 1`` on."""
        if self.format == "jsonl":
            wanted = set(columns) if columns is not None else None
            for n, record in self._json_records(skip):
                if wanted is not None and isinstance(record, dict):
                    record = {k: v for k, v in record.items() if k in wanted}
                yield n, record
            return
        n = skip
        for batch in self.batches(columns, skip=skip):
            for row in batch.to_pylist():
                n += 1
                yield n, row

    # ---- the formats -------------------------------------------------------------------
    def _parquet_batches(self, cols: list[str] | None, skip: int) -> Iterator[pa.RecordBatch]:
        import pyarrow.parquet as pq

        pf = pq.ParquetFile(self.path)
        first, before = 0, 0
        meta = pf.metadata
        while first < meta.num_row_groups and before + meta.row_group(first).num_rows <= skip:
            before += meta.row_group(first).num_rows
            first += 1
        if first >= meta.num_row_groups:
            return
        drop = skip - before
        groups = list(range(first, meta.num_row_groups))
        for batch in pf.iter_batches(batch_size=self.batch_rows, row_groups=groups, columns=cols):
            if drop:
                cut = min(drop, batch.num_rows)
                batch, drop = batch.slice(cut), drop - cut
                if not batch.num_rows:
                    continue
            yield batch

    @cached_property
    def _csv_names(self) -> list[str]:
        import pyarrow.csv as pacsv

        try:
            reader = pacsv.open_csv(self.path, parse_options=self._csv_parse)
        except pa.ArrowInvalid as exc:
            raise TableError(f"{self.path.name}: not a readable {self.format.upper()} file: {exc}") from None
        return list(reader.schema.names)

    @property
    def _csv_parse(self):
        import pyarrow.csv as pacsv

        return pacsv.ParseOptions(delimiter="\t" if self.format == "tsv" else ",", newlines_in_values=True)

    def _csv_batches(self, cols: list[str] | None, skip: int) -> Iterator[pa.RecordBatch]:
        import pyarrow.csv as pacsv

        names = self._csv_names
        convert = pacsv.ConvertOptions(column_types={n: pa.string() for n in names}, strings_can_be_null=False,
                                       include_columns=cols)
        read = pacsv.ReadOptions(skip_rows_after_names=skip, block_size=1 << 20)
        reader = pacsv.open_csv(self.path, read_options=read, parse_options=self._csv_parse, convert_options=convert)
        while True:
            try:
                batch = reader.read_next_batch()
            except StopIteration:
                return
            except pa.ArrowInvalid as exc:
                raise TableError(f"{self.path.name}: {exc}") from None
            yield from _split(batch, self.batch_rows)

    def _json_records(self, skip: int, limit: int | None = None) -> Iterator[tuple[int, dict[str, Any] | BadRecord]]:
        n = 0
        with open(self.path, "rb") as fh:
            for raw in fh:
                if not raw.strip():
                    continue
                n += 1
                if n <= skip:
                    continue
                if limit is not None and n > skip + limit:
                    return
                try:
                    record = json.loads(raw)
                except ValueError as exc:
                    yield n, BadRecord(f"malformed JSON: {exc}"[:200])
                    continue
                yield n, record if isinstance(record, dict) else BadRecord(
                    f"expected a JSON object, got {type(record).__name__}")

    @cached_property
    def _dataset(self):
        try:
            import datasets
        except ImportError:
            raise TableError("reading a Hugging Face dataset needs the datasets package: "
                             "pip install 'specbatch[datasets]'") from None
        p = self.path
        try:
            if p.is_dir() and ((p / "dataset_info.json").exists() or (p / "dataset_dict.json").exists()):
                ds = datasets.load_from_disk(str(p))
            elif p.is_dir():
                ds = datasets.load_dataset(str(p))
            else:
                builder = {".parquet": "parquet", ".pq": "parquet", ".csv": "csv", ".tsv": "csv",
                           ".json": "json", ".jsonl": "json"}.get(p.suffix.lower())
                if builder is None:
                    raise TableError(f"{p.name}: datasets cannot load files ending {p.suffix!r}")
                kwargs = {"delimiter": "\t"} if p.suffix.lower() == ".tsv" else {}
                ds = datasets.load_dataset(builder, data_files=str(p), split="train", **kwargs)
        except (FileNotFoundError, ValueError) as exc:
            raise TableError(f"{p}: not a dataset datasets can load: {exc}") from None
        if isinstance(ds, datasets.DatasetDict):
            if "train" in ds or len(ds) == 1:
                ds = ds["train"] if "train" in ds else next(iter(ds.values()))
            else:
                raise TableError(f"{p}: a dataset of several splits ({', '.join(ds)}); save the one to run "
                                 "with save_to_disk")
        return ds


def _split(batch: pa.RecordBatch, rows: int) -> Iterator[pa.RecordBatch]:
    for start in range(0, batch.num_rows, rows):
        yield batch.slice(start, rows)


def table_source(source: Any, recipe: Any, fmt: str | None) -> Table | None:
    """The ``Table`` to read when ``source`` is one: a path with a table format (by ``fmt`` or
    its extension), or a JSONL path with a recipe (records, not Batch requests); else None (a
    Batch JSONL file or rows given in memory, read as lines)."""
    if not isinstance(source, (str, Path)):
        if recipe is not None or fmt is not None:
            raise TableError("a recipe or format needs a table on disk (a path), not rows in memory")
        return None
    kind = table_format(source, fmt) if (fmt is not None or Path(source).is_dir()
                                        or Path(source).suffix.lower() in _SUFFIXES) else None
    if kind is None or (kind == "jsonl" and recipe is None):
        if recipe is not None:
            kind = table_format(source, fmt)  # raises: a recipe needs a table it can read
        return None
    return Table(source, kind)


def default_recipe(table: Table):
    """A table given no recipe: its ``prompt`` column as the user message, if it has one."""
    from worker.request.table_rows import RecipeError, RowRecipe

    if "prompt" in table.column_names:
        return RowRecipe(prompt_column="prompt")
    raise RecipeError(f"{table.path.name}: name the prompt with --prompt-column COL or --template "
                      f"(its columns: {', '.join(table.column_names)})")
