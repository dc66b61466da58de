"""The parsing half of a bulk ingest: raw lines → entries, ready to deduplicate and store.

One function, ``parse_chunk``, used in the ingesting process for the first chunk (and for
sources that are not files) and in the parsing process (``worker.ingest.parse_process``) for the
rest, so both paths give the same rows and the same errors. A chunk's lines are parsed and
validated, their prompts checked against the context, and each good line's job row built (id
and seed drawn here); what needs the store, duplicate custom_ids and the queue name, is left
to ``worker.ingest.stream``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

from worker.ingest.tables import BadRecord
from worker.request.formats import BadLine, Request, length_error, parse_line
from worker.request.table_rows import RowRecipe
from worker.request.convert import fresh_seeds
from worker.request.validate import Measure, token_count
from worker.store.rows import job_row, new_ids

CountTokens = Callable[[Request], int]

#: Kinds of entry: a job row to run, a request whose prompt does not fit the context, a bad line.
GOOD, TOO_LONG, INVALID = 0, 1, 2
#: (line number, custom_id or None, kind, the job row for GOOD else the error text).
Entry = tuple[int, "str | None", int, Any]


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


def chunked(items: Iterator[Any], first: int, size: int) -> Iterator[list[Any]]:
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


def parse_chunk(lines: Sequence[tuple[int, Any]], *, model: str, priority: int,
                count_tokens: CountTokens | None = None, max_model_len: int | None = None,
                served: Sequence[str] = (), recipe: RowRecipe | None = None) -> list[Entry]:
    """One entry per line, in order. Rows leave ``queue`` unset (the ingesting process names it).
    ``served``: other names lines may give the batch's model (``--served-model-name``). With a
    ``recipe``, the lines are a table's rows (``worker.ingest.tables``), built by it."""
    if recipe is None:
        items = [parse_line(raw, n, model=model, served=served) for n, raw in lines]
    else:
        items = [BadLine(n, row.error, unit="row") if isinstance(row, BadRecord) else recipe.request(row, n)
                 for n, row in lines]
    good = [x for x in items if isinstance(x, Request)]
    measures = (prompt_measures(count_tokens, good, max_model_len)
                if count_tokens is not None and max_model_len is not None and good else None)
    ids, seeds = new_ids(len(good)), fresh_seeds(len(good))
    out: list[Entry] = []
    g = 0
    for x in items:
        if isinstance(x, BadLine):
            out.append((x.line_no, x.custom_id, INVALID, x.error))
            continue
        measure = None if measures is None else measures[g]
        error = None if measure is None else length_error(token_count(measure), max_model_len)
        problem = vocabulary_error(x, getattr(count_tokens, "vocab_size", None))
        if error is not None:
            out.append((x.line_no, x.custom_id, TOO_LONG, error))
        elif problem is not None:
            out.append((x.line_no, x.custom_id, INVALID, problem))
        else:
            tokens = measure if isinstance(measure, list) and x.prompt_token_ids is None else None
            out.append((x.line_no, x.custom_id, GOOD, _row(x, ids[g], seeds[g], model, priority, tokens)))
        g += 1
    return out


def vocabulary_error(req: Request, vocab_size: int | None) -> str | None:
    """``SamplingParams.check_vocabulary`` where the model's vocabulary is known here (a token
    counter loaded its config), as the line's error; else the engine checks it at submission."""
    if vocab_size is None or not req.params.logit_bias:
        return None
    try:
        req.params.check_vocabulary(vocab_size)
    except ValueError as exc:
        return str(exc)
    return None


def _row(r: Request, job_id: str, seed: int, model: str, priority: int,
         tokens: list[int] | None) -> dict[str, Any]:
    if r.params.seed is None:  # as ``with_seed``, in place: these params are this line's own
        r.params.seed = seed
    return job_row(model=model, id=job_id, custom_id=r.custom_id, line_no=r.line_no, endpoint=r.endpoint,
                   prompt=r.prompt, prompt_token_ids_in=r.prompt_token_ids, messages=r.messages, prompt_tokens=tokens,
                   params=r.params.to_dict(only_set=True), priority=priority if r.priority is None else r.priority,
                   user=r.user)


def prompt_measures(count_tokens: CountTokens, reqs: Sequence[Request], limit: int) -> list[Measure]:
    """What checking prompts against a context of ``limit`` needs: each prompt's token ids where
    the counter tokenized it (``TokenCounter.measure``: they travel with the job), a bound under
    ``limit`` for one proven to fit, or a plain count from a counter that only counts."""
    measure = getattr(count_tokens, "measure", None)
    return measure(reqs, limit) if measure is not None else count_many(count_tokens, reqs)


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
