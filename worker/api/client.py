"""The producer API: write jobs to the store first, then enqueue their messages.

Rows are committed *before* anything is published (commit-then-enqueue), so a worker never
sees a message whose job row is missing, and a crash between the two leaves queued rows that
rerunning the batch re-enqueues. A batch streams in a chunk at a time (``worker.ingest.stream``) and
its jobs are published by pacers, a bounded window at a time (``worker.dispatch.pacer``). Publishing
reuses one producer and connection and builds each Celery message directly.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

from sqlalchemy.exc import OperationalError

from engine.sampling_params import SamplingParams

from worker.dispatch.app import make_app
from worker.common.config import Settings, queue_name, serves
from worker.dispatch.lanes import lane_queue, lane_queues
from worker.request.priority import BULK, INTERACTIVE, parse_priority
from worker.store.dbretry import with_db_retry
from worker.dispatch.embedded import ensure_broker_url
from worker.request.formats import MAX_CUSTOM_ID, BadLine, Request, output_line
from worker.ingest.stream import Ingest, IngestResult
from worker.ingest.tables import Table, table_source, default_recipe
from worker.request.table_rows import RowRecipe
from worker.store.models import SUCCEEDED, TERMINAL
from worker.dispatch.pacer import Pacer
from worker.dispatch.publish import publish_jobs
from worker.request.cache_key import is_cacheable
from worker.request.convert import openai_sampling_params, with_seed
from worker.store.sqltypes import stored_length
from worker.store.rows import job_row
from worker.store.store import Store

log = logging.getLogger(__name__)

CountTokens = Callable[[Request], int]


@dataclass(slots=True)
class BatchSubmission:
    """A submitted batch: its id and what reading its input did, in counts."""

    batch_id: str
    ingest: IngestResult
    published: int
    seconds: float

    @property
    def bad_lines(self) -> list[BadLine]:
        """The first ``worker.ingest.stream.KEEP_BAD`` bad lines (all of them are stored as failed jobs)."""
        return self.ingest.bad_lines

    @property
    def num_good(self) -> int:
        return self.ingest.num_good

    @property
    def num_bad(self) -> int:
        return self.ingest.num_bad


class Client:
    def __init__(
        self,
        *,
        broker_url: str | None = None,
        database_url: str | None = None,
        model: str | None = None,
        queue: str | None = None,
        store: Store | None = None,
        settings: Settings | None = None,
        served_model_names: Sequence[str] | None = None,
    ) -> None:
        """Arguments override ``settings`` (default: the environment's). ``served_model_names``:
        other names a request or a batch line may give ``model`` (vLLM's ``--served-model-name``):
        an OpenAI file naming ``gpt-4o-mini`` runs on ``model`` when that name is one of them."""
        served = ",".join(served_model_names) if served_model_names is not None else None
        resolved = (settings or Settings()).but(broker_url=broker_url, database_url=database_url, model=model,
                                               queue=queue, served_model_name=served)
        self.settings = resolved.but(broker_url=ensure_broker_url(resolved.broker_url))
        self.app = make_app(self.settings.broker_url, include_tasks=False)
        self.store = store or Store(self.settings.database_url)

    @property
    def model(self) -> str:
        return self.settings.model

    def model_for(self, asked: str | None) -> str:
        """The model a request naming ``asked`` runs on: this client's model for one of its
        served names (or none given), else ``asked`` itself."""
        if asked is None or (asked != self.model and serves(self.model, self.settings.served_names, asked)):
            return self.model
        return asked

    def queue_for(self, model: str, priority: int | None = None) -> str:
        """The Redis queue of a job: the model's interactive or bulk lane (see ``worker.dispatch.lanes``)."""
        return lane_queue(self.settings.queue or queue_name(model), parse_priority(priority))

    # ---- submit ------------------------------------------------------------------------
    def submit(
        self,
        prompt: str | list[int] | None = None,
        *,
        messages: list[dict[str, Any]] | None = None,
        params: dict[str, Any] | SamplingParams | None = None,
        model: str | None = None,
        custom_id: str | None = None,
        job_id: str | None = None,
        priority: int | str = INTERACTIVE,
        user: str | None = None,
        cache: bool | None = None,
        cache_salt: str | None = None,
    ) -> str:
        """Store and enqueue one job; returns its id (reusing ``job_id`` is idempotent).

        ``params`` is a ``SamplingParams`` or a dict of its fields (OpenAI's
        ``max_completion_tokens`` too); a bad one raises ``ValueError`` naming the field. The
        stored params carry every default and a seed, so any worker runs the job the same way.
        ``priority``: ``"interactive"`` (the default: a service waiting for its answer),
        ``"bulk"``, or an integer (lower is more urgent; <= 0 rides the interactive lane).
        ``cache`` (default: the ``cache`` setting, on): a greedy or seeded job whose result is in
        the result cache is answered at once (stored succeeded, never queued); the prompt is
        tokenized here for its key. ``cache_salt``: vLLM's tenant salt (prefix cache and results).
        """
        priority = parse_priority(priority)
        if (prompt is None) == (messages is None):
            raise ValueError("give exactly one of prompt or messages")
        if custom_id is not None and not 0 < stored_length(custom_id) <= MAX_CUSTOM_ID:
            raise ValueError(f"custom_id must be 1 to {MAX_CUSTOM_ID} characters as stored")  # the column's limit
        if not isinstance(params, SamplingParams):
            params = openai_sampling_params(params or {})
        model = self.model_for(model)
        seed_given = params.seed is not None
        row = job_row(
            id=job_id, model=model, custom_id=custom_id, messages=messages,
            params=with_seed(params).to_dict(only_set=True), queue=self.queue_for(model, priority), priority=priority, user=user,
            prompt=prompt if isinstance(prompt, str) else None,
            prompt_token_ids_in=list(prompt) if isinstance(prompt, list) else None, cache_salt=cache_salt,
        )
        written = False
        if (self.settings.cache if cache is None else cache) and is_cacheable(params.temperature, seed_given):
            written = self._answer_from_cache(row, params)
            if row["status"] == SUCCEEDED:
                return row["id"]  # answered: nothing to run
        if not written:
            with_db_retry("submit", lambda: self.store.upsert_jobs([row]))
        self.publish([row])
        return row["id"]

    def _answer_from_cache(self, row: dict[str, Any], params: SamplingParams) -> bool:
        """Key a greedy or seeded job (its prompt tokenized as the engine would) and write it:
        answered (succeeded) when the result cache holds its answer, else to run. False: it
        could not be keyed, and nothing was written."""
        from worker.request.cache_key import cache_key, request_digest
        from worker.request.validate import token_counter

        try:
            counter = token_counter(row["model"])
            request = Request(0, row["custom_id"] or "", row["endpoint"], params, prompt=row["prompt"],
                              prompt_token_ids=row["prompt_token_ids_in"], messages=row["messages"])
            tokens = counter.tokenize(request)
        except Exception:  # no tokenizer here, or a prompt it refuses: the worker's engine says why
            log.debug("job %s not keyed for the result cache", row["id"], exc_info=True)
            return False
        row.update(prompt_tokens=tokens, request_digest=request_digest(tokens, row["params"], row["cache_salt"]))
        model_key = self._cache_model(row["model"])
        if model_key is None:
            return False
        entry = self.store.cached_results([cache_key(model_key, row["request_digest"])])
        hit = next(iter(entry.values()), None)
        if hit is not None:
            row.update(self.store.hit_values(hit, time.time()))
        with_db_retry("submit", lambda: self.store.write_single(row, hit_key=None if hit is None else hit.key))
        return True

    def submit_batch(
        self,
        source: str | Path | Iterable[dict[str, Any] | str],
        *,
        name: str | None = None,
        model: str | None = None,
        retry_failed: bool = False,
        count_tokens: CountTokens | None = None,
        max_model_len: int | None = None,
        priority: int | str = BULK,
        max_in_flight: int | None = None,
        on_chunk: Callable[[IngestResult], None] | None = None,
        recipe: RowRecipe | None = None,
        format: str | None = None,
        cache: bool | None = None,
    ) -> BatchSubmission:
        """Stream the lines into a batch, a chunk at a time, publishing its first jobs as the
        first chunks land (``worker.ingest.stream``); returns when every line is written.

        ``source`` is a JSONL path or rows (dicts or JSON strings), read lazily: memory does not
        grow with its length. Bad lines become failed jobs naming the line and cause; with
        ``count_tokens`` and ``max_model_len`` prompts that do not fit the context are caught
        here too. ``priority`` (default ``"bulk"``) is every line's unless the line's body names
        one; ``max_in_flight`` caps how many of the batch's jobs are published or running at
        once. The workers' pacers publish the rest, a window at a time, round-robin with the
        other open batches (``worker.dispatch.pacer``). ``on_chunk`` is called after each chunk is written.

        A table (Parquet, CSV/TSV, a Hugging Face dataset folder or file, or JSONL records, by
        ``format`` or the extension; ``worker.ingest.tables``) is read a record batch at a time,
        each row built into a request by ``recipe`` (``RowRecipe``: a prompt column or a template
        over the columns; default: the column ``prompt``). A recipe that can never work (a
        template that does not parse, a column the table lacks) raises ``ValueError`` at once.

        ``cache`` (default: the ``cache`` setting, on): greedy and seeded rows whose result is in
        the result cache are answered now, never queued; rows of the batch asking the same are
        run once (``worker.store.results_cache``). Needs ``count_tokens`` (the key is over the
        prompt's tokens).
        """
        t0 = time.perf_counter()
        priority = parse_priority(priority)
        if max_in_flight is not None and (not isinstance(max_in_flight, int) or max_in_flight < 1):
            raise ValueError(f"max_in_flight must be a positive integer, got {max_in_flight!r}")
        model = self.model_for(model)
        table = table_source(source, recipe, format)
        if table is not None:
            recipe = recipe or default_recipe(table)
            recipe.check()
            recipe.columns_used(table.column_names)
        cache = self.settings.cache if cache is None else cache
        ingest = Ingest(self.store, model=model, queue_for=self.queue_for, priority=priority,
                        retry_failed=retry_failed, count_tokens=count_tokens, max_model_len=max_model_len,
                        pace=lambda: self.pace(model), on_chunk=on_chunk, served=self.settings.served_names,
                        recipe=recipe if table is not None else None, cache=cache,
                        prefix_order=self.settings.prefix_order,
                        cache_model=self._cache_model(model) if cache and count_tokens is not None else None)
        params: dict[str, Any] = {"retry_failed": retry_failed}
        if table is not None:
            params["table"] = {"format": table.format, "recipe": recipe.to_dict()}
        result = ingest.run(table if table is not None else source, name=name,
                            input_file=str(source) if isinstance(source, (str, Path)) else None,
                            params=params, max_in_flight=max_in_flight)
        return BatchSubmission(result.batch_id, result, result.published, time.perf_counter() - t0)

    def _cache_model(self, model: str) -> str | None:
        """The model key results of ``model`` are cached under, as this process's settings run
        it (``worker.request.cache_key.model_key_of``); None: the cache is not looked up."""
        from worker.request.cache_key import model_key_of

        try:
            return model_key_of(self.store, self.settings, model)
        except Exception:  # the cache is an optimisation: the batch runs without it
            log.warning("the result cache is not looked up: the model's digest could not be worked out",
                        exc_info=True)
            return None

    def pace(self, model: str | None = None) -> int:
        """One pacer tick on the model's lanes: publish the first window of open batches now
        (workers' pacers publish the rest as the queue drains)."""
        queues = lane_queues(self.settings.queue or queue_name(model or self.model))
        return Pacer(self.store, self.app, queues).tick()

    def publish(self, rows: Sequence[dict[str, Any]]) -> int:
        """Publish one task message per job row through one producer and connection, retrying
        while Redis restarts; rows that never reach it stay queued in the store, and a worker's
        orphan sweep publishes them after its grace period."""
        return publish_jobs(self.app, rows,
                            lambda row: row.get("queue") or self.queue_for(row["model"], row.get("priority")))

    # ---- follow ------------------------------------------------------------------------
    def wait(self, job_or_batch: str, *, timeout: float | None = None, poll: float = 0.25) -> dict[str, int] | str:
        """Block until a job (returns its status) or a batch (returns its counts) is done."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                done = self._poll_done(job_or_batch)
            except OperationalError:  # the database is away for a while: keep waiting
                done = None
            if done is not None:
                return done
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"{job_or_batch} not finished after {timeout} s")
            time.sleep(poll)

    def _poll_done(self, job_or_batch: str) -> dict[str, int] | str | None:
        """The final status or counts of a job or batch, or None while it is not done (counts
        by status: one aggregate query, whatever the batch's size)."""
        batch = self.store.get_batch(job_or_batch)
        if batch is not None:
            counts, done = self.store.batch_done(batch.id)
            if done:
                self.store.refresh_batch(batch.id)
                return counts
            return None
        job = self.store.get_job(job_or_batch)
        if job is None:
            raise KeyError(f"no job or batch {job_or_batch!r}")
        return job.status if job.status in TERMINAL else None

    def iter_results(self, batch_id: str, *, poll: float = 0.25, timeout: float | None = None) -> Iterator[dict[str, Any]]:
        """Output lines, each once, in input-line order as soon as every line before it has
        finished, until the batch is done. A poll reads counts; rows are read only when more
        jobs finished, and only those (``Store.finished_prefix``)."""
        after: tuple[int, str] | None = None
        yielded = 0
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                counts, done = self.store.batch_done(batch_id)
                finished = sum(counts[s] for s in TERMINAL)
                while yielded < finished:
                    rows = self.store.finished_prefix(batch_id, after)
                    if not rows:
                        break
                    for job in rows:
                        yield output_line(job)
                    yielded += len(rows)
                    after = (rows[-1].line_no, rows[-1].id)
            except OperationalError:  # the database is away for a while: keep waiting
                time.sleep(poll)
                continue
            if done:  # every job is final, so the prefix above reached the end
                return
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"batch {batch_id} not finished after {timeout} s")
            time.sleep(poll)

    def results(self, batch_id: str) -> list[dict[str, Any]]:
        """Output lines of every finished job, in input-line order (``export`` streams instead)."""
        return [output_line(j) for j in self.store.iter_jobs(batch_id, statuses=TERMINAL)]

    def cancel(self, job_or_batch: str) -> list[str]:
        """Cooperative cancel: mark jobs cancelled, and ask workers to abort running ones."""
        batch = self.store.get_batch(job_or_batch)
        if batch is not None:
            cancelled, running = self.store.cancel(batch_id=batch.id)
        else:
            cancelled, running = self.store.cancel(job_ids=[job_or_batch])
        if running:
            self.app.control.broadcast("specbatch_cancel", arguments={"job_ids": running})
        return cancelled

    def workers_consuming(self, queue: str, timeout: float = 1.0) -> list[str]:
        """Names of live workers subscribed to ``queue``."""
        try:
            replies = self.app.control.inspect(timeout=timeout).active_queues() or {}
        except Exception:
            return []
        return [name for name, qs in replies.items() if any(q.get("name") == queue for q in qs or [])]
