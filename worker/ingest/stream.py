"""Streaming ingest: a bulk file goes into the store a chunk at a time, and its first jobs are
published while the rest is still being read.

Each chunk is read, validated, checked against the context (token counts in one batched call
of the tokenizers library, chat templates by substitution: ``worker.request.chat_render``; all in
``worker.ingest.parse``, for a file's later chunks in a child process of its own:
``worker.ingest.parse_process``), deduplicated and written in one short transaction
(``Store.write_chunk``); then
the producer's pacer tops the queue up, so a worker starts on line 1 within moments however
large the file. Memory stays flat in the file's size: only the current chunk is held, plus
8 bytes a line to catch duplicate custom_ids (``SeenIds``) and the first ``KEEP_BAD`` bad
lines for the report. The batch is marked as being ingested until its last chunk is written
(``Store.open_batch`` / ``finish_ingest``), so it is never taken for finished between chunks;
a run killed half-way leaves a prefix of the chunks and rerunning it resumes (rows are
matched by custom_id, as any rerun).
"""

from __future__ import annotations

import gc
import logging
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np

from worker.request.formats import BadLine
from worker.ingest.parse import GOOD, INVALID, LEVELS, CountTokens, Entry, chunked, numbered_lines, parse_chunk
from worker.request.cache_key import prefix_key
from worker.ingest.parse_process import ParseProcess
from worker.ingest.tables import Table
from worker.request.table_rows import RowRecipe
from worker.store.rows import INSERT_CHUNK, job_row
from worker.store.store import Store
from worker.store.ingest_writes import Once
from worker.request.validate import TokenCounter

#: The first chunk is small, so the first jobs are published within moments of the command.
FIRST_CHUNK = 200
#: A file smaller than this is parsed here alone: the parsing process takes a few seconds to
#: start (imports, the tokenizer), about what parsing 8 MB of lines here takes.
CHILD_MIN_BYTES = 8 << 20
#: The same for a table whose row count its metadata tells (Parquet, datasets): about the rows
#: of an 8 MB Batch file (a Parquet file is many times smaller than its rows as JSON lines).
CHILD_MIN_ROWS = 40_000
#: Bad lines kept in memory to report (every one of them is stored as a failed job anyway).
KEEP_BAD = 1000
#: Seconds between two of the producer's pacer ticks: the first chunk is paced at once (the
#: first jobs start within moments); after that the workers' own pacers keep the queue topped
#: up, and a tick here (a Redis connection and a few queries, about 15 ms) is mostly a repeat:
#: at 0.2 s they were a third of the writer thread's time.
PACE_SECONDS = 1.0

log = logging.getLogger(__name__)


@dataclass(slots=True)
class IngestResult:
    """What reading a file into a batch did, in counts (the rows themselves are in the store)."""

    batch_id: str
    num_good: int = 0
    num_bad: int = 0
    bad_lines: list[BadLine] = field(default_factory=list)  # the first KEEP_BAD of them
    enqueued: int = 0  # rows to run: new ones, and queued/retried ones of a reopened batch
    skipped_succeeded: int = 0
    skipped_failed: int = 0
    published: int = 0  # by this producer's pacer ticks (workers' pacers publish the rest)
    seconds: float = 0.0
    first_chunk_s: float | None = None  # from the start until the first chunk was written and paced
    parsed_in_child: int = 0  # lines parsed by the child process (``worker.ingest.parse_process``)
    cached: int = 0  # rows answered from the result cache (never queued)
    duplicates: int = 0  # rows that asked what an earlier row of the batch asks (run once, copied)

    @property
    def num_lines(self) -> int:
        return self.num_good + self.num_bad


class SeenIds:
    """The custom_ids seen so far, as 64-bit hashes in bounded memory.

    Eight bytes a line, in sorted numpy runs merged as they grow (as in a log-structured merge),
    instead of a dict of every id. Hashes can collide, so a hit is only a candidate: ``Ingest``
    looks the id up in the store (where every earlier chunk is, with its line) before calling a
    line a duplicate; duplicates are rare, so are look-ups. A merge concatenates two runs and
    sorts the copy in place, so its transient peak is the two runs once more: at a million lines
    8 MB, where keys, lines and an argsort's order array (16 bytes a line kept) peaked at ~56 MB.
    """

    def __init__(self) -> None:
        self._runs: list[np.ndarray] = []

    def lookup(self, hashes: np.ndarray) -> np.ndarray:
        """For each hash: True when it was added before."""
        found = np.zeros(len(hashes), dtype=bool)
        for keys in self._runs:
            idx = np.minimum(np.searchsorted(keys, hashes), len(keys) - 1)
            found |= keys[idx] == hashes
        return found

    def add(self, hashes: np.ndarray) -> None:
        if not len(hashes):
            return
        self._runs.append(np.sort(hashes))
        while len(self._runs) > 1 and len(self._runs[-2]) <= 2 * len(self._runs[-1]):
            last = self._runs.pop()
            merged = np.concatenate([self._runs[-1], last])
            del last
            self._runs[-1] = merged  # the older run is freed here, before the sort
            merged.sort()

    @property
    def nbytes(self) -> int:
        return sum(keys.nbytes for keys in self._runs)


def _hash(custom_id: str) -> int:
    return hash(custom_id)  # 64-bit, stable within this process, which is all a run needs


class Ingest:
    """Read one source into one batch, chunk by chunk (see the module's docstring)."""

    def __init__(
        self,
        store: Store,
        *,
        model: str,
        queue_for: Callable[[str, int | None], str],
        priority: int,
        retry_failed: bool = False,
        count_tokens: CountTokens | None = None,
        max_model_len: int | None = None,
        pace: Callable[[], int] | None = None,
        chunk: int = INSERT_CHUNK,
        first_chunk: int = FIRST_CHUNK,
        parse_in_child: bool = True,
        child_min_bytes: int = CHILD_MIN_BYTES,
        on_chunk: Callable[[IngestResult], None] | None = None,
        served: Sequence[str] = (),
        recipe: RowRecipe | None = None,
        cache: bool = True,
        cache_model: str | None = None,
        prefix_order: bool = True,
    ) -> None:
        self.store = store
        self.model = model
        self.served = tuple(served)  # other names lines may give ``model`` (``--served-model-name``)
        self.recipe = recipe  # a table source's rows -> requests (``worker.request.table_rows``)
        self.unit = "row" if recipe is not None else "line"
        self.queue_for = queue_for
        self.priority = priority
        self.retry_failed = retry_failed
        self.count_tokens = count_tokens if max_model_len is not None else None
        self.max_model_len = max_model_len
        self.pace = pace
        self.chunk = chunk
        self.first_chunk = first_chunk
        self.parse_in_child = parse_in_child
        self.child_min_bytes = child_min_bytes
        self.on_chunk = on_chunk
        self.seen = SeenIds()
        # Bulk once (``worker.store.results_cache``): greedy and seeded rows get a request
        # digest (``cache``), are answered from the result cache under ``cache_model`` (the
        # model key; None: not looked up) and run once however often a batch asks them.
        self.cache = cache
        self.cache_model = cache_model if cache else None
        self.seen_digests = SeenIds()  # request digests of earlier chunks (64-bit), as custom_ids
        self.seen_levels = SeenIds()  # prompt-prefix hashes of earlier chunks (``_prefix_keys``)
        self.prefix_order = prefix_order  # off: every row's prefix_key is NULL (line order)
        self._pending: Future | None = None  # the chunk the writer thread holds
        self.parser: ParseProcess | None = None  # the child parsing the rest of a file, while it runs

    def run(self, source: str | Path | Iterable[Any], *, name: str | None, input_file: str | None,
            params: dict[str, Any] | None = None, max_in_flight: int | None = None) -> IngestResult:
        """Read ``source`` into a batch. Stages overlap: the first chunk is parsed here (its jobs
        are published within moments) while, for a file, a child process (``worker.ingest.parse_process``)
        parses the rest on another core; this thread deduplicates chunk k+1 while one writer
        thread stores (and paces) chunk k, mostly waiting on the database with the GIL released.
        At most one chunk is in the writer's hands and the child is at most a chunk ahead, so
        memory stays at a few chunks, and chunks are written in file order."""
        t0 = time.perf_counter()
        # Objects alive now (modules, torch, the tokenizer: millions of them) move to the
        # collector's permanent generation, so its collections walk only this ingest's chunks
        # (parsing a line took 23 us with them walked, 15 without).
        gc.freeze()
        batch_id, reopened = self.store.open_batch(name=name, input_file=input_file, model=self.model,
                                                   params=params, priority=self.priority,
                                                   max_in_flight=max_in_flight)
        result = IngestResult(batch_id)
        last_pace = 0.0

        def write(rows: list[dict[str, Any]], invalid: list[dict[str, Any]], bad: list[BadLine]) -> None:
            nonlocal last_pace
            written = self.store.write_chunk(batch_id, rows, invalid, reopened=reopened,
                                             retry_failed=self.retry_failed, once=self._once(batch_id, rows))
            result.cached += written.cached
            result.duplicates += written.duplicates
            result.num_good += len(rows)  # counted once stored, so ``on_chunk`` sees what is written
            result.num_bad += len(bad)
            result.bad_lines += bad[: max(0, KEEP_BAD - len(result.bad_lines))]
            result.enqueued += len(written.to_enqueue)
            result.skipped_succeeded += written.skipped_succeeded
            result.skipped_failed += written.skipped_failed
            now = time.perf_counter()
            if self.pace is not None and written.to_enqueue and now - last_pace >= PACE_SECONDS:
                result.published += self.pace()
                last_pace = now
            if result.first_chunk_s is None:
                result.first_chunk_s = time.perf_counter() - t0
            if self.on_chunk is not None:
                self.on_chunk(result)

        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="specbatch-ingest-writer") as writer:
            try:
                for entries in self._entries(source, result):
                    rows, bad = self._accept(entries, batch_id)
                    invalid = [self._invalid_row(b) for b in bad]
                    self._wait_for_writer()  # the previous chunk is stored (or its error raised here)
                    self._pending = writer.submit(write, rows, invalid, bad)
                self._wait_for_writer()
            finally:
                if self._pending is not None:  # an error above: let the write in flight end
                    self._pending.exception()
                self._pending = None
                if self.parser is not None:
                    self.parser.close()
                    self.parser = None
        self.store.finish_ingest(batch_id)
        if self.pace is not None:
            result.published += self.pace()
        result.bad_lines.sort(key=lambda b: b.line_no)
        result.seconds = time.perf_counter() - t0
        return result

    def _entries(self, source: str | Path | Iterable[Any] | Table, result: IngestResult) -> Iterator[list[Entry]]:
        """Each chunk's parsed entries, in file order: parsed here until the child (started
        at once for a large enough file) is ready, then by the child. A ``Table``'s rows are
        read a record batch at a time and built by the recipe, here and in the child alike."""
        table = source if isinstance(source, Table) else None
        if self._child_can_parse(source):
            counter_model = self.count_tokens.model if self.count_tokens is not None else None  # type: ignore[attr-defined]
            self.parser = ParseProcess(table.path if table is not None else source, model=self.model,
                                       priority=self.priority, chunk=self.chunk, counter_model=counter_model,
                                       max_model_len=self.max_model_len, served=self.served,
                                       table_format=table.format if table is not None else None,
                                       recipe=self.recipe.to_dict() if table is not None else None,
                                       cache=self.cache, prefix_order=self.prefix_order)
        if table is not None:
            assert self.recipe is not None
            lines = table.records(self.recipe.columns_used(table.column_names))
        else:
            lines = numbered_lines(source)
        chunks = chunked(lines, min(self.first_chunk, self.chunk), self.chunk)
        for chunk in chunks:
            yield self._parse(chunk)
            if self.parser is None:
                continue
            if self.parser.ready():
                chunks.close()
                lines.close()  # type: ignore[attr-defined]  # the child reads the file itself
                for entries in self.parser.chunks(after=chunk[-1][0]):
                    result.parsed_in_child += len(entries)
                    yield entries
                return
            if self.parser.failed is not None:
                log.warning("parsing %s on this core alone: the parsing process died (%s)",
                            table.path if table is not None else source, self.parser.failed)
                self.parser.close()
                self.parser = None

    def _child_can_parse(self, source: Any) -> bool:
        if not (self.parse_in_child and (self.count_tokens is None or isinstance(self.count_tokens, TokenCounter))):
            return False
        if isinstance(source, Table):
            rows = source.num_rows_hint
            return (source.nbytes >= self.child_min_bytes if rows is None
                    else rows >= CHILD_MIN_ROWS * self.child_min_bytes / CHILD_MIN_BYTES)
        return isinstance(source, (str, Path)) and os.path.getsize(source) >= self.child_min_bytes

    def _parse(self, lines: Sequence[tuple[int, Any]]) -> list[Entry]:
        return parse_chunk(lines, model=self.model, priority=self.priority, count_tokens=self.count_tokens,
                           max_model_len=self.max_model_len, served=self.served, recipe=self.recipe,
                           cache=self.cache, prefix_order=self.prefix_order)

    def _wait_for_writer(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def _once(self, batch_id: str, rows: list[dict[str, Any]]) -> "Once | None":
        """What bulk once does to a chunk's rows (in the writer thread, after every earlier
        chunk is stored): cache hits to answer, duplicates of earlier rows to hold."""
        keyed = [r for r in rows if r.get("request_digest") is not None]
        if not keyed:
            return None
        once = Once()
        if self.cache_model is not None:
            from worker.request.cache_key import cache_key

            keys = {r["id"]: cache_key(self.cache_model, r["request_digest"]) for r in keyed}
            found = self.store.cached_results(list(keys.values()))
            once.hits = {job_id: found[key] for job_id, key in keys.items() if key in found}
        rest = [r for r in keyed if r["id"] not in once.hits]
        hashes = np.fromiter((_hash(r["request_digest"]) for r in rest), dtype=np.int64, count=len(rest))
        earlier = self.seen_digests.lookup(hashes)
        maybe = [r["request_digest"] for r, hit in zip(rest, earlier.tolist()) if hit]
        firsts = self.store.first_of_digest(batch_id, maybe) if maybe else {}
        new_h: list[int] = []
        for r, h in zip(rest, hashes.tolist()):
            digest = r["request_digest"]
            first = firsts.get(digest)
            if first is None:
                firsts[digest] = r["id"]  # the first of its digest in this batch: it runs
                new_h.append(h)
                once.misses += 1
            else:
                once.duplicate_of[r["id"]] = first
        self.seen_digests.add(np.array(new_h, dtype=np.int64))
        return once

    def _invalid_row(self, b: BadLine) -> dict[str, Any]:
        return job_row(model=self.model, custom_id=b.custom_id, line_no=b.line_no, error=b.message)

    def _accept(self, entries: list[Entry], batch_id: str) -> tuple[list[dict[str, Any]], list[BadLine]]:
        """A chunk's rows to store and its bad lines: invalid, over the context, or a duplicate
        custom_id (naming the first line; a bad line whose id was taken loses it, so
        (batch_id, custom_id) stays unique in the store)."""
        firsts = self._dedup(entries, batch_id)
        rows: list[dict[str, Any]] = []
        bad: list[BadLine] = []
        queues: dict[int, str] = {}
        for (line_no, cid, kind, value), first in zip(entries, firsts):
            if first and kind != INVALID:
                bad.append(BadLine(line_no, f"duplicate custom_id {cid!r} (first on {self.unit} {first})",
                                   unit=self.unit))
            elif kind == GOOD:
                prio = value["priority"]
                queue = queues.get(prio)
                if queue is None:
                    queue = queues[prio] = self.queue_for(self.model, prio)
                value["queue"] = queue
                rows.append(value)
            else:
                bad.append(BadLine(line_no, value, None if first else cid, unit=self.unit))
        self._prefix_keys(rows)
        return rows, bad

    def _prefix_keys(self, rows: list[dict[str, Any]]) -> None:
        """Each row's ``prefix_key`` from its prefix hashes (``parse.LEVELS``, taken out of the
        row): a level counts where another row of the batch has it too, earlier or in this chunk
        (64-bit hashes in bounded memory, as custom_ids), so rows behind a shared head are
        published together and the rest keep line order."""
        levels = [r.pop(LEVELS, None) or [] for r in rows]
        flat = np.fromiter((h for lv in levels for h in lv), dtype=np.int64)
        if not len(flat):
            for r in rows:
                r["prefix_key"] = None
            return
        before = self.seen_levels.lookup(flat)
        uniq, counts = np.unique(flat, return_counts=True)
        twice = set(uniq[counts > 1].tolist())
        shared = [bool(b) or h in twice for h, b in zip(flat.tolist(), before.tolist())]
        at = 0
        for r, lv in zip(rows, levels):
            r["prefix_key"] = prefix_key(lv, shared[at:at + len(lv)])
            at += len(lv)
        self.seen_levels.add(uniq)

    def _dedup(self, entries: list[Entry], batch_id: str) -> list[int]:
        """For each entry, the earlier line holding its custom_id, or 0 (the first of its id)."""
        firsts = [0] * len(entries)
        keyed = [i for i, e in enumerate(entries) if e[1] is not None]
        if not keyed:
            return firsts
        hashes = np.fromiter((_hash(entries[i][1]) for i in keyed), dtype=np.int64, count=len(keyed))
        earlier = self.seen.lookup(hashes)
        local: dict[str, int] = {}
        new_h: list[int] = []
        for i, h, hit in zip(keyed, hashes.tolist(), earlier.tolist()):
            line_no, cid = entries[i][0], entries[i][1]
            first = local.get(cid, 0)
            if not first and hit:  # seen in an earlier chunk, or a hash collision: the store knows
                first = self._first_line(batch_id, cid, line_no)
            if first:
                firsts[i] = first
                continue
            local[cid] = line_no
            new_h.append(h)
        self.seen.add(np.array(new_h, dtype=np.int64))
        return firsts

    def _first_line(self, batch_id: str, custom_id: str, line_no: int) -> int:
        """The earlier line holding ``custom_id`` (every earlier chunk is in the store once the
        writer is done with the one it holds), or 0."""
        self._wait_for_writer()
        first = self.store.custom_id_line(batch_id, custom_id)
        return first if first is not None and first < line_no else 0
