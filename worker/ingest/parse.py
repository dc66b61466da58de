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
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

from worker.ingest.tables import BadRecord
from worker.request.formats import BadLine, Request, length_error, parse_line
from worker.request.table_rows import RowRecipe
from worker.request.cache_key import is_cacheable, prefix_levels, request_digest
from worker.request.convert import fresh_seeds
from worker.request.validate import Measure, token_count
from worker.store.rows import job_row, new_ids

CountTokens = Callable[[Request], int]

#: A good row's prompt-prefix hashes (``worker.request.cache_key.prefix_levels``), until the
#: ingesting process, which sees the whole batch, makes them its ``prefix_key``.
LEVELS = "_prefix_levels"
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
                served: Sequence[str] = (), recipe: RowRecipe | None = None, cache: bool = True,
                prefix_order: bool = True) -> list[Entry]:
    """One entry per line, in order. Rows leave ``queue`` unset (the ingesting process names it).
    ``served``: other names lines may give the batch's model (``--served-model-name``). With a
    ``recipe``, the lines are a table's rows (``worker.ingest.tables``), built by it.
    With a tokenizer, a greedy or seeded row gets its request digest (``worker.request.cache_key``:
    its prompt is tokenized for it, not only bounded) unless ``cache`` is off (``--no-cache``: the
    rows are neither answered from the result cache nor merged with their duplicates); with
    ``prefix_order``, every row gets its prompt head's hashes (``LEVELS``) from its rendered text."""
    if recipe is None:
        items = [parse_line(raw, n, model=model, served=served) for n, raw in lines]
    else:
        items = [BadLine(n, row.error, unit="row") if isinstance(row, BadRecord) else recipe.request(row, n)
                 for n, row in lines]
    good = [x for x in items if isinstance(x, Request)]
    measures = (prompt_measures(count_tokens, good, max_model_len)
                if count_tokens is not None and max_model_len is not None and good else None)
    keyed = [cache and is_cacheable(r.params.temperature, r.params.seed is not None) for r in good]
    if measures is not None and any(keyed):
        tokenize_bounded(count_tokens, good, measures, keyed)
    texts = prompt_texts(count_tokens, good) if prefix_order else [None] * len(good)
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
            out.append((x.line_no, x.custom_id, GOOD, _row(x, ids[g], seeds[g], model, priority, tokens, keyed[g],
                                                          texts[g])))
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
         tokens: list[int] | None, keyed: bool, text: str | None) -> dict[str, Any]:
    if r.params.seed is None:  # as ``with_seed``, in place: these params are this line's own
        r.params.seed = seed
    params = r.params.to_dict(only_set=True)
    ids = tokens if tokens is not None else r.prompt_token_ids
    digest = request_digest(ids, params, r.cache_salt) if keyed and ids is not None else None
    levels = prefix_levels(text) if text is not None else []
    row = job_row(model=model, id=job_id, custom_id=r.custom_id, line_no=r.line_no, endpoint=r.endpoint,
                  prompt=r.prompt, prompt_token_ids_in=r.prompt_token_ids, messages=r.messages, prompt_tokens=tokens,
                  params=params, priority=priority if r.priority is None else r.priority,
                  user=r.user, cache_salt=r.cache_salt, request_digest=digest)
    row[LEVELS] = levels  # not a column: ``worker.ingest.stream`` turns it into ``prefix_key``
    return row


def tokenize_bounded(count_tokens: CountTokens, reqs: Sequence[Request], measures: list[Measure],
                     keyed: Sequence[bool]) -> None:
    """Replace, in place, the bounds ``TokenCounter.measure`` gave for the ``keyed`` prompts
    proven to fit by their token ids (one batched call): a cache key is over the tokens."""
    tokenize_many = getattr(count_tokens, "tokenize_many", None)
    todo = [g for g, m in enumerate(measures)
            if keyed[g] and isinstance(m, int) and reqs[g].prompt_token_ids is None]
    if tokenize_many is None or not todo:
        return
    for g, ids in zip(todo, tokenize_many([reqs[g] for g in todo])):
        if isinstance(ids, list):
            measures[g] = ids


def prompt_texts(count_tokens: CountTokens | None, reqs: Sequence[Request]) -> list[str | None]:
    """Each request's prompt as text: a conversation rendered by its chat template (the counter's
    renderer, by substitution where exact), a text prompt as it is; None for token ids, for a
    conversation the template refuses, or with no counter (no template here)."""
    out: list[str | None] = [r.prompt if r.messages is None and r.prompt_token_ids is None else None for r in reqs]
    renderer = getattr(count_tokens, "renderer", None)
    chats = [i for i, r in enumerate(reqs) if r.messages is not None]
    if renderer is None or not chats:
        return out
    try:
        with getattr(count_tokens, "_lock", None) or nullcontext():  # the counter's renderer is not thread-safe
            rendered = renderer.render_many([reqs[i].messages for i in chats])
        for i, text in zip(chats, rendered):
            out[i] = text
    except Exception:  # one conversation the template refuses: its length check names it; no grouping
        pass
    return out


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
