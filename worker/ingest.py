"""Streaming ingest: a bulk file goes into the store a chunk at a time, and its first jobs are
published while the rest is still being read.

Each chunk is read, validated, checked against the context (token counts in one batched call
of the tokenizers library, chat templates by substitution: ``worker.chat_render``) and
written in one short transaction (``Store.write_chunk``); then
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
import json
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np

from .formats import BadLine, Request, length_error, parse_line
from .request import fresh_seeds
from .store import INSERT_CHUNK, Store, job_row, new_ids

#: The first chunk is small, so the first jobs are published within moments of the command.
FIRST_CHUNK = 200
#: Bad lines kept in memory to report (every one of them is stored as a failed job anyway).
KEEP_BAD = 1000
#: Seconds between two of the producer's pacer ticks: the first chunk is paced at once (the
#: first jobs start within moments); after that the workers' own pacers keep the queue topped
#: up, and a tick here (a Redis connection and a few queries, about 15 ms) is mostly a repeat:
#: at 0.2 s they were a third of the writer thread's time.
PACE_SECONDS = 1.0

CountTokens = Callable[[Request], int]


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


def numbered_lines(source: str | Path | Iterable[dict[str, Any] | str | bytes]) -> Iterator[tuple[int, Any]]:
    """(line number, raw line) of every non-blank line; a path is read as bytes, so a line that
    is not UTF-8 is one bad line, not a failed file."""
    if isinstance(source, (str, Path)):
        with open(source, "rb") as fh:
            for n, raw in enumerate(fh, start=1):
                if raw.strip():
                    yield n, raw
        return
    for n, item in enumerate(source, start=1):
        raw = item if isinstance(item, (str, bytes)) else json.dumps(item)
        if raw.strip():
            yield n, raw


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
        on_chunk: Callable[[IngestResult], None] | None = None,
    ) -> None:
        self.store = store
        self.model = model
        self.queue_for = queue_for
        self.priority = priority
        self.retry_failed = retry_failed
        self.count_tokens = count_tokens if max_model_len is not None else None
        self.max_model_len = max_model_len
        self.pace = pace
        self.chunk = chunk
        self.on_chunk = on_chunk
        self.seen = SeenIds()
        self._pending: Future | None = None  # the chunk the writer thread holds

    def run(self, source: str | Path | Iterable[Any], *, name: str | None, input_file: str | None,
            params: dict[str, Any] | None = None, max_in_flight: int | None = None) -> IngestResult:
        """Read ``source`` into a batch. Two stages overlap: this thread parses chunk k+1 while
        one writer thread counts the tokens of chunk k and stores (and paces) it; token counting
        runs in the tokenizers library's Rust and a database write mostly waits on the server or
        on SQLite's C code, both with the GIL released. At most one chunk is in the writer's
        hands, so memory stays at two chunks, and chunks are written in file order."""
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

        def write(good: list[Request], rows: list[dict[str, Any]], invalid: list[dict[str, Any]],
                  bad: list[BadLine]) -> None:
            nonlocal last_pace
            if self.count_tokens is not None and good:
                rows, too_long = self._check_lengths(good, rows)
                bad = bad + too_long
                invalid = invalid + [self._invalid_row(b) for b in too_long]
            written = self.store.write_chunk(batch_id, rows, invalid, reopened=reopened,
                                             retry_failed=self.retry_failed)
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
                for lines in _chunked(numbered_lines(source), FIRST_CHUNK, self.chunk):
                    good, bad = self._parse(lines, batch_id)
                    rows = self._rows(good)
                    invalid = [self._invalid_row(b) for b in bad]
                    self._wait_for_writer()  # the previous chunk is stored (or its error raised here)
                    self._pending = writer.submit(write, good, rows, invalid, bad)
                self._wait_for_writer()
            finally:
                if self._pending is not None:  # an error above: let the write in flight end
                    self._pending.exception()
                self._pending = None
        self.store.finish_ingest(batch_id)
        if self.pace is not None:
            result.published += self.pace()
        result.bad_lines.sort(key=lambda b: b.line_no)
        result.seconds = time.perf_counter() - t0
        return result

    def _wait_for_writer(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def _invalid_row(self, b: BadLine) -> dict[str, Any]:
        return job_row(model=self.model, custom_id=b.custom_id, line_no=b.line_no, error=b.message)

    def _rows(self, good: list[Request]) -> list[dict[str, Any]]:
        """The job rows of a chunk's good requests (ids and seeds drawn for the chunk at once)."""
        n = len(good)
        return [self._row(r, job_id, seed) for r, job_id, seed in zip(good, new_ids(n), fresh_seeds(n))]

    def _row(self, r: Request, job_id: str, seed: int) -> dict[str, Any]:
        prio = self.priority if r.priority is None else r.priority
        if r.params.seed is None:  # as ``with_seed``, in place: these params are this line's own
            r.params.seed = seed
        return job_row(model=self.model, id=job_id, custom_id=r.custom_id, line_no=r.line_no, endpoint=r.endpoint,
                       prompt=r.prompt, prompt_token_ids_in=r.prompt_token_ids, messages=r.messages,
                       params=r.params.to_dict(only_set=True), queue=self.queue_for(self.model, prio),
                       priority=prio, user=r.user)

    def _parse(self, lines: Sequence[tuple[int, Any]], batch_id: str) -> tuple[list[Request], list[BadLine]]:
        """One chunk's good requests and bad lines (bad: invalid or duplicate; the writer finds
        those over the context)."""
        items = [parse_line(raw, n, model=self.model) for n, raw in lines]
        self._dedup(items, batch_id)
        good = [x for x in items if isinstance(x, Request)]
        bad = [x for x in items if isinstance(x, BadLine)]
        return good, bad

    def _dedup(self, items: list[Request | BadLine], batch_id: str) -> None:
        """Duplicate custom_ids become bad lines naming the first one (in place); a bad line
        whose id was taken loses it, so (batch_id, custom_id) stays unique in the store."""
        keyed = [(i, x) for i, x in enumerate(items) if x.custom_id is not None]
        if not keyed:
            return
        hashes = np.fromiter((_hash(x.custom_id) for _, x in keyed), dtype=np.int64, count=len(keyed))
        earlier = self.seen.lookup(hashes)
        local: dict[str, int] = {}
        new_h: list[int] = []
        for (i, x), h, hit in zip(keyed, hashes.tolist(), earlier.tolist()):
            cid = x.custom_id
            first = local.get(cid, 0)
            if not first and hit:  # seen in an earlier chunk, or a hash collision: the store knows
                first = self._first_line(batch_id, cid, x.line_no)
            if first:
                if isinstance(x, Request):
                    items[i] = BadLine(x.line_no, f"duplicate custom_id {cid!r} (first on line {first})")
                else:
                    x.custom_id = None
                continue
            local[cid] = x.line_no
            new_h.append(h)
        self.seen.add(np.array(new_h, dtype=np.int64))

    def _first_line(self, batch_id: str, custom_id: str, line_no: int) -> int:
        """The earlier line holding ``custom_id`` (every earlier chunk is in the store once the
        writer is done with the one it holds), or 0."""
        self._wait_for_writer()
        first = self.store.custom_id_line(batch_id, custom_id)
        return first if first is not None and first < line_no else 0

    def _check_lengths(self, good: list[Request], rows: list[dict[str, Any]]
                       ) -> tuple[list[dict[str, Any]], list[BadLine]]:
        """The rows of the requests that fit the context, and a bad line for each that does not."""
        counts = prompt_lengths(self.count_tokens, good, self.max_model_len)
        keep: list[dict[str, Any]] = []
        bad: list[BadLine] = []
        for req, row, n in zip(good, rows, counts):
            error = length_error(n, self.max_model_len)
            if error is None:
                keep.append(row)
            else:
                bad.append(BadLine(req.line_no, error, req.custom_id))
        return keep, bad


def prompt_lengths(count_tokens: CountTokens, reqs: Sequence[Request], limit: int) -> list[int | Exception]:
    """Token counts good enough to check prompts against a context of ``limit``: exact, or for a
    prompt proven to fit, a bound under ``limit`` (the counter's ``lengths`` where it has one)."""
    lengths = getattr(count_tokens, "lengths", None)
    return lengths(reqs, limit) if lengths is not None else count_many(count_tokens, reqs)


def count_many(count_tokens: CountTokens, reqs: Sequence[Request]) -> list[int | Exception]:
    """Token counts of many requests: the counter's batched form where it has one."""
    many = getattr(count_tokens, "count_many", None)
    if many is not None:
        return many(reqs)
    out: list[int | Exception] = []
    for req in reqs:
        try:
            out.append(count_tokens(req))
        except Exception as exc:  # e.g. a token id outside the vocabulary
            out.append(exc)
    return out


def _chunked(items: Iterator[Any], first: int, size: int) -> Iterator[list[Any]]:
    """Lists of ``first`` items, then of ``size``."""
    chunk: list[Any] = []
    limit = min(first, size)
    for item in items:
        chunk.append(item)
        if len(chunk) >= limit:
            yield chunk
            chunk = []
            limit = size
    if chunk:
        yield chunk
