"""Every setting of specbatch's queue side in one object, ``Settings``: flags, then the
environment (``SPECBATCH_*``, ``REDIS_URL``, ``DATABASE_URL``), then defaults, read once when a
process makes its settings. Each field names its variable and says what it does, and README's
settings table is generated from these fields (``python -m worker.common.config --table``), so the two
cannot drift. A process's settings are made once (``settings()``) or handed in by the command
that started it (``use_settings``); child processes get theirs as command-line flags."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable, Mapping, Sequence
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
DEFAULT_DATABASE_URL = "sqlite:///specbatch.db"
#: The longest a single job may run in a worker before it is aborted and failed. The Redis
#: visibility timeout is derived from it (see :func:`visibility_timeout`).
DEFAULT_MAX_JOB_SECONDS = 3 * 3600.0



_SECRET_QUERY_KEYS = frozenset({"password", "passwd", "pass", "secret", "token"})


def redact_url(url: str | None) -> str | None:
    """``url`` fit to print or log: the password (``user:pw@`` or a ``password=`` query value)
    becomes ``***``. Every URL the CLI or a worker shows goes through here."""
    if not url:
        return url
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparseable URL>"
    netloc = parts.netloc
    userinfo, at, host = netloc.rpartition("@")
    if at and ":" in userinfo:
        netloc = f"{userinfo.split(':', 1)[0]}:***@{host}"
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        if any(k.lower() in _SECRET_QUERY_KEYS for k, _ in pairs):
            query = urlencode([(k, "***" if k.lower() in _SECRET_QUERY_KEYS else v) for k, v in pairs], safe="/*")
    if (netloc, query) == (parts.netloc, parts.query):
        return url  # nothing secret (and ``scheme:///path`` keeps its form)
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def model_slug(model: str) -> str:
    """A queue-safe name for a model: the last path part, lower-cased, odd characters as '-'."""
    base = model.rstrip("/").split("/")[-1] or model
    slug = re.sub(r"[^a-z0-9._-]+", "-", base.lower()).strip("-")
    return slug or "model"


def serves(model: str, served: Sequence[str], asked: str) -> bool:
    """Whether a request naming ``asked`` runs on ``model``: its own name (by slug) or one of its
    served names (vLLM's ``--served-model-name``: the names a client may use for it)."""
    slug = model_slug(asked)
    return slug == model_slug(model) or any(slug == model_slug(name) for name in served)


def split_names(raw: str | None) -> tuple[str, ...]:
    """A comma-separated list of names (a setting), without blanks."""
    return tuple(name.strip() for name in (raw or "").split(",") if name.strip())


def queue_name(model: str) -> str:
    """One queue per model: ``gen.<model-slug>`` (``SPECBATCH_QUEUE`` names another: ``Settings.queue_name``)."""
    return f"gen.{model_slug(model)}"



def _parse_bool(raw: str) -> bool:
    return raw.strip().lower() not in ("0", "false", "no", "off")


_PARSERS: dict[Any, Callable[[str], Any]] = {int: int, float: float, str: str, bool: _parse_bool}


def _setting(name: str, default: Any, doc: str, kind: type = str, *, also: str | None = None,
             group: str = "worker") -> Any:
    """A field read from ``SPECBATCH_<name>`` (or the plain variable ``also``) when a
    ``Settings`` is made without it; ``default`` when neither is set (None: derived or off)."""

    def read(environ: Mapping[str, str] | None = None) -> Any:
        environ = os.environ if environ is None else environ
        raw = environ.get(f"SPECBATCH_{name}") or (environ.get(also) if also else None)
        if raw in (None, ""):
            return default
        try:
            return _PARSERS[kind](raw)
        except ValueError as exc:
            raise ValueError(f"SPECBATCH_{name}={raw!r}: expected {kind.__name__} ({exc})") from None

    return field(default_factory=read, metadata={"env": name, "also": also, "doc": doc, "default": default,
                                                  "kind": kind, "group": group, "read": read})


@dataclass(frozen=True, slots=True)
class Settings:
    """One process's settings. ``Settings(model=...)`` takes what it is given and reads every
    other field from the environment at that moment; ``resolve`` does the same for CLI flags
    (None: not given)."""

    # ---- where things are
    broker_url: str | None = _setting("BROKER_URL", None, "Redis URL of the broker; unset: `specbatch run` embeds "
                                      "a Redis of its own.", also="REDIS_URL", group="where")
    database_url: str = _setting("DATABASE_URL", DEFAULT_DATABASE_URL, "SQLAlchemy URL of the store "
                                 "(SQLite or PostgreSQL).", also="DATABASE_URL", group="where")
    model: str = _setting("MODEL", DEFAULT_MODEL, "Model name or path a worker serves and jobs default to.",
                          group="where")
    served_model_name: str | None = _setting("SERVED_MODEL_NAME", None, "Other names requests may give this model "
                                             "(comma-separated; vLLM's `--served-model-name`): an OpenAI file naming "
                                             "`gpt-4o-mini` runs on it.", group="where")
    device: str = _setting("DEVICE", "cpu", "`cpu`, `cpu:N` (a CPU slot) or `cuda:N`.", group="where")
    queue: str | None = _setting("QUEUE", None, "Queue to use; unset: `gen.<model-slug>`.", group="where")
    # ---- the engine a worker builds
    max_num_seqs: int = _setting("MAX_NUM_SEQS", 64, "Sequences the engine batches at once.", int, group="engine")
    reserved_seqs: int | None = _setting("RESERVED_SEQS", None, "Engine slots bulk work never fills while urgent "
                                         "work is about; unset: 1/16 of max-num-seqs.", int, group="engine")
    urgent_only_steps: int | None = _setting("URGENT_ONLY_STEPS", None, "Of every k+1 steps, k leave bulk requests "
                                             "out while urgent ones run; unset: 16 on a CPU, 0 on CUDA.", int,
                                             group="engine")
    max_num_batched_tokens: int | None = _setting("MAX_NUM_BATCHED_TOKENS", None, "Token budget of one engine step; "
                                                  "unset: the engine's default.", int, group="engine")
    kv_cache_bytes: int | None = _setting("KV_CACHE_BYTES", None, "Bytes of paged KV cache; unset: the engine's "
                                          "default.", int, group="engine")
    dtype: str | None = _setting(
        "DTYPE", None,
        "Weights dtype; unset: auto (bfloat16 on CUDA and on CPUs with native bf16, AVX512_BF16 or AMX; float32 "
        "elsewhere and with int8). Set `float32` to match a float32 reference (HF `generate` on the CPU).",
        group="engine")
    quantization: str | None = _setting("QUANTIZATION", None, "`int8`: opt-in int8 linears on the CPU.",
                                        group="engine")
    speculative: str | None = _setting("SPECULATIVE", None, "Speculative decoding `METHOD[:K]` (ngram, suffix, "
                                       "draft; K an integer or auto).", group="engine")
    draft_model: str | None = _setting("DRAFT_MODEL", None, "Draft model for `--speculative draft`.",
                                       group="engine")
    grammar_timeout: float | None = _setting("GRAMMAR_TIMEOUT", None, "Seconds a structured-output grammar may "
                                             "take to compile; unset: the engine's 10 s.", float, group="engine")
    engine_kwargs: str | None = _setting("ENGINE_KWARGS", None, "A JSON object of extra `LLM(...)` keyword "
                                         "arguments (escape hatch).", group="engine")
    engine_process: bool = _setting("ENGINE_PROCESS", True, "`0`: the engine steps in a thread of the worker "
                                    "process instead of a process of its own.", bool, group="engine")
    engine_threads: int | None = _setting("ENGINE_THREADS", None, "torch threads of the engine; unset: one per "
                                          "core it may use.", int, group="engine")
    cpu_threads: int = _setting("CPU_THREADS", 1, "torch threads of a `cpu:N` slot.", int, group="engine")
    gil_switch_interval: float = _setting("GIL_SWITCH_INTERVAL", 0.001, "Seconds a thread holds the GIL before "
                                          "handing it over (Python's default 0.005).", float, group="engine")
    # ---- the worker process
    group_held_jobs: int | None = _setting("GROUP_HELD_JOBS", None, "Jobs of group messages a worker holds "
                                           "claimed at once; unset: 4 x max-num-seqs.", int)
    max_job_seconds: float = _setting("MAX_JOB_SECONDS", DEFAULT_MAX_JOB_SECONDS, "The longest one job may run "
                                      "before it is aborted and failed.", float)
    lease_seconds: float = _setting("LEASE_SECONDS", 60.0, "A running attempt (or worker) whose heartbeat is "
                                    "older than this is presumed dead.", float)
    heartbeat_seconds: float = _setting("HEARTBEAT_SECONDS", 2.0, "How often a worker refreshes its running "
                                        "jobs' leases.", float)
    max_attempts: int = _setting("MAX_ATTEMPTS", 3, "Attempts a job may spend before it ends failed.", int)
    drain_timeout: float = _setting("DRAIN_TIMEOUT", 30.0, "On SIGTERM, seconds running jobs get to finish before "
                                    "they go back to the queue.", float)
    soft_shutdown_timeout: float = _setting("SOFT_SHUTDOWN_TIMEOUT", 0.0, "Celery's soft shutdown timeout.", float)
    load_at_start: bool = _setting("LOAD_AT_START", True, "`0`: load the engine at the first job, not at start.",
                                   bool)
    db_retry_seconds: float = _setting("DB_RETRY_SECONDS", 300.0, "How long a worker's start and a producer's "
                                       "writes are retried while the database is unreachable (a running worker's "
                                       "claims and results wait it out).", float)
    ready_file: str | None = _setting("READY_FILE", None, "A file that exists exactly while the worker can take "
                                      "jobs (a readiness probe).")
    interactive_reserve: int | None = _setting("INTERACTIVE_RESERVE", None, "Task threads bulk messages may never "
                                               "hold; unset: 1/8 of the concurrency.", int)
    metrics_port: int | None = _setting("METRICS_PORT", None, "Serve Prometheus `/metrics` on this port.", int)
    metrics_address: str = _setting("METRICS_ADDRESS", "0.0.0.0", "Address `/metrics` binds.")
    worker_log: str | None = _setting("WORKER_LOG", None, "Log file of the local worker `specbatch run` starts; "
                                      "unset: one in $TMPDIR.")
    worker_loglevel: str = _setting("WORKER_LOGLEVEL", "warning", "Log level of that local worker.")
    # ---- the queue
    pacing_window: int = _setting("PACING_WINDOW", 256, "Messages each queue is kept topped up to.", int,
                                  group="queue")
    pacing_seconds: float = _setting("PACING_SECONDS", 0.5, "How often the pacer tops the queues up.", float,
                                     group="queue")
    group_jobs: int = _setting("GROUP_JOBS", 64, "Short jobs of one batch a message may carry (64: one engine batch at the default max-num-seqs).", int, group="queue")
    group_tokens: int = _setting("GROUP_TOKENS", 256, "Tokens to generate a group message may carry in all.", int,
                                 group="queue")
    sweep_seconds: float = _setting("SWEEP_SECONDS", 10.0, "How often the reaper looks for expired leases and "
                                    "lost messages.", float, group="queue")
    orphan_grace_seconds: float = _setting("ORPHAN_GRACE_SECONDS", 60.0, "A queued job published longer ago than "
                                           "this and missing from Redis is published again.", float, group="queue")
    table_flush_rows: int = _setting("TABLE_FLUSH_ROWS", 10_000, "A table output (Parquet, CSV, a dataset) writes "
                                     "a row group once this many finished rows wait.", int, group="queue")
    table_flush_seconds: float = _setting("TABLE_FLUSH_SECONDS", 5.0, "… or this many seconds after its last one: "
                                          "what a killed run has already written.", float, group="queue")
    cache: bool = _setting("CACHE", True, "`0`: no result cache nor duplicate merging (greedy and seeded jobs "
                           "are answered from earlier runs and computed once a batch by default).", bool, group="queue")
    prefix_order: bool = _setting("PREFIX_ORDER", True, "`0`: publish a bulk batch's rows in line order, not "
                                  "grouped by the prompt prefix (system prompt, template head) they share.", bool,
                                  group="queue")
    cache_max_bytes: int = _setting("CACHE_MAX_BYTES", 1 << 30, "The result cache's bound: the least recently "
                                    "used entries go beyond it.", int, group="queue")
    auto_migrate: bool = _setting("AUTO_MIGRATE", False, "`1`: PostgreSQL stores upgrade their schema on open "
                                  "(SQLite always does).", bool, group="queue")

    @property
    def queue_name(self) -> str:
        return self.queue or queue_name(self.model)

    @property
    def served_names(self) -> tuple[str, ...]:
        """``served_model_name`` as a tuple of names."""
        return split_names(self.served_model_name)

    @classmethod
    def resolve(cls, **given: Any) -> Settings:
        """Settings from CLI flags (a None flag was not given: the environment's value stands)."""
        return cls(**{k: v for k, v in given.items() if v is not None})

    def but(self, **changes: Any) -> Settings:
        """A copy with ``changes`` (None values ignored, as in ``resolve``)."""
        return replace(self, **{k: v for k, v in changes.items() if v is not None})

    def visibility_timeout(self) -> float:
        """Redis redelivers an unacked message this long after a worker *reserved* it.

        A reserved message may wait for a free thread and then run for up to
        ``max_job_seconds``, so twice that (plus a margin) keeps a live job from ever being
        handed to a second worker."""
        return 2.0 * self.max_job_seconds + 300.0


_process_settings: Settings | None = None


def settings() -> Settings:
    """This process's settings: handed in by its command (``use_settings``), else read from
    the environment once."""
    global _process_settings
    if _process_settings is None:
        _process_settings = Settings()
    return _process_settings


def use_settings(new: Settings) -> Settings:
    """Make ``new`` this process's settings (a command resolves its flags, then calls this)."""
    global _process_settings
    _process_settings = new
    return new


def forget_settings() -> None:
    """Read the environment again at the next ``settings()`` (tests that change it)."""
    global _process_settings
    _process_settings = None


#: Variables the engine reads itself (it knows nothing of this module), listed for the table.
ENGINE_VARIABLES: tuple[tuple[str, str, str], ...] = (
    ("CACHE_DIR", "~/.cache/specbatch", "Where converted models (GGUF to safetensors) and compile caches live."),
    ("ENGINE_SPINCOUNT", "1000", "`GOMP_SPINCOUNT` of the engine process (its OpenMP threads spin this long before sleeping)."),
    ("ENGINE_LOG_LEVEL", "INFO", "Log level of the engine process."),
    ("KERNEL_BACKEND", "", "`torch` or `triton`: the kernels' backend (unset: `triton` on CUDA, `torch` elsewhere)."),
    ("COMPILE_WEIGHTS", "packed", "With `compile_step`: `packed` (our prepacked linears, called by handle; cached on "
     "disk) or `frozen` (inductor's freezing, recompiled every start), to measure one against the other."),
    ("COMPILE_SAVE", "1", "With `compile_step`: `1` compiles the decode graph ahead of time and saves it in "
     "`SPECBATCH_CACHE_DIR/compiled_step` (later starts load it without tracing); `0` traces it at every start."),
    ("FAULTS", "", "Test-only fault switches (a JSON object); inert unless set."),
)

_GROUP_TITLES = {"where": "Where things are", "engine": "The engine a worker builds",
                 "worker": "The worker process", "queue": "The queue and the store"}


def settings_table() -> str:
    """README's settings table, from the fields above (``tests/worker/test_settings.py`` fails
    when README's copy drifts)."""
    rows = ["| variable | default | what it does |", "| --- | --- | --- |"]
    for group, title in _GROUP_TITLES.items():
        rows.append(f"| **{title}** | | |")
        for f in fields(Settings):
            meta = f.metadata
            if meta.get("group") != group:
                continue
            name = f"`SPECBATCH_{meta['env']}`" + (f" or `{meta['also']}`" if meta["also"] else "")
            default = meta["default"]
            shown = "unset" if default is None else f"`{_shown(default)}`"
            rows.append(f"| {name} | {shown} | {meta['doc']} |")
    rows.append("| **Read by the engine itself** | | |")
    rows.extend(f"| `SPECBATCH_{name}` | {default or 'unset'} | {doc} |" for name, default, doc in ENGINE_VARIABLES)
    return "\n".join(rows) + "\n"


def _shown(value: Any) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


if __name__ == "__main__":
    import sys

    if sys.argv[1:] != ["--table"]:
        raise SystemExit("usage: python -m worker.common.config --table")
    sys.stdout.write(settings_table())
