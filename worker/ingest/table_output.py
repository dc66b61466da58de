"""The output of a table batch, in the input's family (Parquet, CSV/TSV, JSONL, a Hugging Face
dataset folder): the input's columns (or ``--keep`` a subset) beside the result columns
(``worker.ingest.result_columns``), in input order, written a row group at a time while results
arrive.

The input is read a second time, in step with the store's finished prefix (row k of the table
is the job on row k: every row, good or bad, is one job), so neither the store nor memory holds
the input's columns: memory is one record batch and one row group, whatever the table's size.

A killed run leaves what it wrote readable, and the same command again completes it, each row
once:
- JSONL: whole lines only (a torn last line is cut); the line count is where to go on.
- CSV/TSV: a header, then whole row groups; ``<out>.progress`` records the rows and bytes
  written after each one, and a rerun cuts the file back to it.
- Parquet and datasets: each row group is a complete Parquet file in ``<out>.parts/`` (written
  under a temporary name, then renamed), a directory any Parquet reader opens as one table;
  when the batch ends they are joined into ``<out>`` (a file, or a ``save_to_disk`` folder for
  datasets), a row group at a time, and the parts removed.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any, Iterator, Sequence

import pyarrow as pa

from worker.ingest.result_columns import ResultColumns
from worker.ingest.tables import Table, TableError
from worker.store.store import Store

OUTPUT_FORMATS = ("parquet", "csv", "tsv", "jsonl", "datasets")
_SUFFIX = {"parquet": ".parquet", "csv": ".csv", "tsv": ".tsv", "jsonl": ".jsonl", "datasets": ""}


def output_format(path: Path, input_format: str) -> str:
    """The output's format from its extension; none (a folder): a dataset."""
    suffix = path.suffix.lower()
    for fmt, ext in _SUFFIX.items():
        if ext and suffix == ext:
            return fmt
    if suffix in (".pq",):
        return "parquet"
    if suffix in (".json", ".ndjson"):
        return "jsonl"
    if not suffix or input_format == "datasets":  # a folder: a dataset's own name (``reviews.out``) included
        return "datasets"
    raise TableError(f"{path.name}: no output format for the extension {suffix!r} "
                     f"({', '.join(e for e in _SUFFIX.values() if e)}, or a folder for a dataset)")


def default_output(path: Path, input_format: str) -> Path:
    """``data.parquet`` -> ``data.out.parquet``; a dataset folder ``d`` -> ``d.out``."""
    if input_format == "datasets" and path.is_dir():
        return path.with_name(path.name + ".out")
    return path.with_name(f"{path.stem}.out{_SUFFIX[input_format] or path.suffix}")


def kept_columns(table: Table, keep: Sequence[str] | None, results: ResultColumns) -> list[str]:
    """The input columns the output keeps (``--keep``, default all); raises ``TableError`` for a
    column the table lacks or one a result column would overwrite."""
    kept = list(keep) if keep is not None else list(table.column_names)
    missing = [c for c in kept if c not in table.column_names]
    if missing:
        raise TableError(f"--keep: column {missing[0]!r} is not in the table (its columns: "
                         f"{', '.join(table.column_names)})")
    clash = [c for c in kept if c in results.names]
    if clash:
        raise TableError(f"the table's column {clash[0]!r} is also a result column; keep the others with "
                         f"--keep (result columns: {', '.join(results.names)})")
    return kept


class TableOutput:
    """Appends a table batch's finished rows to its output file, in order (see the module)."""

    def __init__(self, path: str | Path, store: Store, batch_id: str, table: Table, results: ResultColumns, *,
                 flush_rows: int, flush_seconds: float, keep: Sequence[str] | None = None,
                 fresh: bool = False) -> None:
        """A row group is written once ``flush_rows`` finished rows wait, or ``flush_seconds``
        after the last one (``SPECBATCH_TABLE_FLUSH_*``)."""
        self.path = Path(path)
        self.format = output_format(self.path, table.format)
        self.store, self.batch_id, self.table, self.results = store, batch_id, table, results
        self.keep = kept_columns(table, keep, results)
        self.flush_rows, self.flush_seconds = flush_rows, flush_seconds
        self.lines = 0  # rows written
        self.after: tuple[int, str] | None = None
        self._pending: list[tuple[Any, dict[str, list[Any]]]] = []  # (input rows, result values) per chunk
        self._pending_rows = 0
        self._last_flush = time.monotonic()
        self._input: Iterator[Any] | None = None
        self._held: Any = None  # input rows read ahead of the results
        self.peak_rss_kib = 0
        self.parts = self.path.with_name(self.path.name + ".parts")
        self.progress = self.path.with_name(self.path.name + ".progress")
        if fresh or not self._resume():
            self._start_afresh()

    # ---- resume ---------------------------------------------------------------------------
    def _resume(self) -> bool:
        """Go on after what an earlier run wrote (True), or say there is nothing to go on from."""
        if self.format in ("parquet", "datasets"):
            if not self.parts.is_dir():
                return False
            import pyarrow.parquet as pq

            for tmp in self.parts.glob("*.tmp"):
                tmp.unlink()
            self.lines = sum(pq.ParquetFile(p).metadata.num_rows for p in sorted(self.parts.glob("part-*.parquet")))
        elif self.format == "jsonl":
            if not self.path.exists():
                return False
            self.lines = _cut_to_whole_lines(self.path)
        else:
            if not (self.path.exists() and self.progress.exists()):
                return False
            mark = json.loads(self.progress.read_text())
            if self.path.stat().st_size < mark["bytes"]:
                return False
            os.truncate(self.path, mark["bytes"])
            self.lines = mark["rows"]
        if self.lines:
            # The finished job on the file's last row ((line, id) > (line, "") starts at that row).
            last = self.store.finished_prefix(self.batch_id, (self.lines, ""), limit=1)
            if not last or last[0].line_no != self.lines:
                return False  # no finished row of this batch where the file ends: start afresh
            self.after = (last[0].line_no, last[0].id)
        return True

    def _start_afresh(self) -> None:
        self.lines, self.after = 0, None
        shutil.rmtree(self.parts, ignore_errors=True)
        self.progress.unlink(missing_ok=True)
        if self.format in ("parquet", "datasets"):
            self.parts.mkdir(parents=True, exist_ok=True)
        elif self.format == "jsonl":
            self.path.write_bytes(b"")
        else:
            header = _csv_bytes(pa.table({c: pa.array([], pa.string()) for c in self._out_names}), self.format,
                                header=True)
            self.path.write_bytes(header)
            self._mark()

    @property
    def _out_names(self) -> list[str]:
        return self.keep + self.results.names

    # ---- appending ------------------------------------------------------------------------
    def pump(self, limit: int = 1000, *, final: bool = False) -> int:
        """Take every result now ready (in order after the last one taken); write a row group
        once enough wait (all of them with ``final``). Returns the rows taken."""
        taken = 0
        while True:
            jobs = self.store.finished_prefix(self.batch_id, self.after, limit)
            if not jobs:
                break
            expected = self.lines + self._pending_rows + 1
            if jobs[0].line_no != expected:
                raise TableError(f"the batch's row {jobs[0].line_no} follows row {expected - 1} of the output: "
                                 "the table changed since the batch was written; run with a new --batch-name")
            self._pending.append((self._take_input(len(jobs)), self.results.values(jobs)))
            self._pending_rows += len(jobs)
            self.after = (jobs[-1].line_no, jobs[-1].id)
            taken += len(jobs)
            if self._pending_rows >= self.flush_rows:
                self._flush()
        if self._pending_rows and (final or time.monotonic() - self._last_flush >= self.flush_seconds):
            self._flush()
        return taken

    def finish(self) -> int:
        """Write what is left; join Parquet parts into the output. Returns the rows written."""
        self.pump(final=True)
        if self.format == "parquet":
            self._join_parts()
        elif self.format == "datasets":
            self._save_dataset()
        elif self.format in ("csv", "tsv"):
            self.progress.unlink(missing_ok=True)
        return self.lines

    def rewrite(self) -> int:
        """Write the whole output again from the store."""
        self._input, self._held = None, None
        self._pending, self._pending_rows = [], 0
        self._start_afresh()
        return self.finish()

    def _take_input(self, n: int) -> Any:
        """The next ``n`` input rows (kept columns): a ``pa.Table``, or a list of dicts for JSONL."""
        if self._input is None:
            skip = self.lines + self._pending_rows
            if self.table.format == "jsonl":
                self._input = (r for _, r in self.table.records(skip=skip))
            else:
                self._input = iter(self.table.batches(self.keep, skip=skip))
        if self.table.format == "jsonl":
            rows = []
            for _ in range(n):
                record = next(self._input, None)
                rows.append({k: record[k] for k in self.keep if k in record} if isinstance(record, dict) else {})
            return rows
        pieces, need = [], n
        while need:
            if self._held is None or not self._held.num_rows:
                self._held = next(self._input, None)
                if self._held is None:
                    raise TableError(f"the table has fewer rows than the batch ({self.lines + n - need} read)")
                continue
            cut = min(need, self._held.num_rows)
            pieces.append(self._held.slice(0, cut))
            self._held = self._held.slice(cut)
            need -= cut
        return pa.Table.from_batches(pieces, schema=pieces[0].schema)

    # ---- writing, per format ---------------------------------------------------------------
    def _flush(self) -> None:
        pending, self._pending, rows = self._pending, [], self._pending_rows
        self._pending_rows = 0
        if self.format == "jsonl" or self.table.format == "jsonl":
            records = [dict(r) for inp, vals in pending for r in _records(inp, vals, self.keep)]
            if self.format == "jsonl":
                data = "".join(json.dumps(r, ensure_ascii=False, default=str) + "\n" for r in records)
                _append(self.path, data.encode("utf-8"))
            else:
                self._write_arrow(_table_from_records(records, self.keep, self.results))
        else:
            tables = [self._arrow(inp, vals) for inp, vals in pending]
            self._write_arrow(pa.concat_tables(tables))
        self.lines += rows
        if self.format in ("csv", "tsv"):
            self._mark()  # rows and bytes written, together: where a rerun goes on
        self._last_flush = time.monotonic()
        self.peak_rss_kib = max(self.peak_rss_kib, _rss_kib())

    def _arrow(self, inputs: pa.Table, values: dict[str, list[Any]]) -> pa.Table:
        for name, field in zip(self.results.names, self.results.schema):
            inputs = inputs.append_column(field, pa.array(values[name], type=field.type))
        return inputs

    def _write_arrow(self, table: pa.Table) -> None:
        if self.format in ("parquet", "datasets"):
            import pyarrow.parquet as pq

            n = len(list(self.parts.glob("part-*.parquet")))
            final = self.parts / f"part-{n:06d}.parquet"
            tmp = final.with_suffix(".tmp")
            pq.write_table(table, tmp)
            os.replace(tmp, final)
        elif self.format in ("csv", "tsv"):
            _append(self.path, _csv_bytes(_csv_ready(table, self.results), self.format, header=False))

    def _mark(self) -> None:
        tmp = self.progress.with_suffix(".tmp")
        tmp.write_text(json.dumps({"rows": self.lines, "bytes": self.path.stat().st_size}))
        os.replace(tmp, self.progress)

    def _join_parts(self) -> None:
        import pyarrow.parquet as pq

        parts = sorted(self.parts.glob("part-*.parquet"))
        if not parts:
            return
        tmp = self.path.with_name(self.path.name + ".tmp")
        writer = None
        for part in parts:
            pf = pq.ParquetFile(part)
            if writer is None:
                writer = pq.ParquetWriter(tmp, pf.schema_arrow)
            for i in range(pf.num_row_groups):
                writer.write_table(pf.read_row_group(i))
        writer.close()
        os.replace(tmp, self.path)
        shutil.rmtree(self.parts, ignore_errors=True)

    def _save_dataset(self) -> None:
        import datasets

        parts = sorted(str(p) for p in self.parts.glob("part-*.parquet"))
        if not parts:
            return
        features = None
        if self.table.features is not None:
            result_features = datasets.Features.from_arrow_schema(self.results.schema)
            features = datasets.Features({**{c: self.table.features[c] for c in self.keep}, **result_features})
        cache = self.parts / "cache"
        ds = datasets.Dataset.from_parquet(parts, features=features, cache_dir=str(cache))
        tmp = self.path.with_name(self.path.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        ds.save_to_disk(str(tmp))
        del ds
        shutil.rmtree(self.path, ignore_errors=True)
        os.replace(tmp, self.path)
        shutil.rmtree(self.parts, ignore_errors=True)


def _records(inputs: Any, values: dict[str, list[Any]], keep: Sequence[str]) -> Iterator[dict[str, Any]]:
    rows = inputs if isinstance(inputs, list) else inputs.to_pylist()
    names = list(values)
    for i, row in enumerate(rows):
        yield {**row, **{name: values[name][i] for name in names}}


def _table_from_records(records: list[dict[str, Any]], keep: Sequence[str], results: ResultColumns) -> pa.Table:
    """JSONL records into an arrow table (Parquet/CSV out of a JSONL input): the input's
    values as arrow infers them, as JSON text where a column's values have no one type."""
    columns = {}
    for name in keep:
        values = [r.get(name) for r in records]
        try:
            columns[name] = pa.array(values)
        except (pa.ArrowInvalid, pa.ArrowTypeError):
            columns[name] = pa.array([None if v is None else json.dumps(v, ensure_ascii=False) for v in values])
    for field in results.schema:
        columns[field.name] = pa.array([r.get(field.name) for r in records], type=field.type)
    return pa.table(columns)


def _csv_ready(table: pa.Table, results: ResultColumns) -> pa.Table:
    """Struct and list columns as JSON text: a CSV cell holds text."""
    for i, field in enumerate(table.schema):
        if pa.types.is_struct(field.type) or pa.types.is_list(field.type) or pa.types.is_large_list(field.type):
            text = pa.array([None if v is None else json.dumps(v, ensure_ascii=False) for v in table.column(i).to_pylist()],
                            pa.string())
            table = table.set_column(i, pa.field(field.name, pa.string()), text)
    return table


def _csv_bytes(table: pa.Table, fmt: str, *, header: bool) -> bytes:
    import pyarrow.csv as pacsv

    sink = pa.BufferOutputStream()
    options = pacsv.WriteOptions(include_header=header, delimiter="\t" if fmt == "tsv" else ",")
    pacsv.write_csv(table, sink, options)
    return sink.getvalue().to_pybytes()


def _append(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)


def _cut_to_whole_lines(path: Path) -> int:
    """Cut a torn last line off ``path``; the number of whole lines."""
    data_end = path.stat().st_size
    with open(path, "rb+") as fh:
        lines, last_end, pos = 0, 0, 0
        while block := fh.read(1 << 20):
            lines += block.count(b"\n")
            i = block.rfind(b"\n")
            if i >= 0:
                last_end = pos + i + 1
            pos += len(block)
        if last_end != data_end:
            fh.truncate(last_end)
    return lines


def _rss_kib() -> int:
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0
