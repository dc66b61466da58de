"""One engine per worker process, loaded once when the worker starts.

Under ``-P threads`` Celery never sends ``worker_process_init``, so the model is loaded on
``worker_init`` (before the consumer takes messages); every task thread then hands its
request to the process's single ``EngineLoop`` and waits, and each request joins the running
batch at the loop's next step.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from celery import signals

from worker.common.config import Settings, settings
from worker.run.exit_codes import (
    EXIT_ENGINE_BUILD_FAILED,
    EXIT_ENGINE_DIED,
    EXIT_METRICS_PORT,
    EXIT_STOP_HUNG,
    EXIT_STORE_UNREACHABLE,
)
from worker.dispatch.lanes import lane_queues

log = logging.getLogger(__name__)


_pinned_slot: str | None = None  # the CPU slot this process is bound to, once pinned


def pin_device(device: str) -> tuple[str, str]:
    """Pin this process to ``device`` *before* torch initialises CUDA or its thread pool.

    ``cuda:1`` sets ``CUDA_VISIBLE_DEVICES=1`` so the engine sees that GPU as ``cuda:0``;
    ``cpu:N`` is a CPU slot: the process is bound to core N (``sched_setaffinity``) with
    ``CPU_THREADS`` torch threads (default 1), so several workers share a host without their
    thread pools fighting over the same cores. Returns (the device the engine should use, the
    worker-name prefix, e.g. ``cuda1``).
    """
    device = (device or "cpu").strip().lower()
    if device == "cpu":
        return "cpu", "cpu"
    if device == "cuda":
        device = "cuda:0"
    kind, _, index = device.partition(":")
    if kind == "cuda" and index.isdigit():
        os.environ["CUDA_VISIBLE_DEVICES"] = index
        return "cuda:0", f"cuda{index}"
    if kind == "cpu" and index.isdigit():
        global _pinned_slot
        if _pinned_slot not in (None, device):
            raise ValueError(f"this process is pinned to {_pinned_slot!r} already, not {device!r}")
        if _pinned_slot is None:  # idempotent: `specbatch worker` pins, then the runtime again
            cores = sorted(os.sched_getaffinity(0))
            if int(index) >= len(cores):
                raise ValueError(f"device {device!r}: this host has CPU slots cpu:0..cpu:{len(cores) - 1}")
            os.sched_setaffinity(0, {cores[int(index)]})
            _pinned_slot = device
        threads = str(settings().cpu_threads)
        for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ[var] = threads
        if "torch" in sys.modules:  # already imported (tests): its pool is sized already; resize it
            sys.modules["torch"].set_num_threads(int(threads))
        return "cpu", f"cpu{index}"
    raise ValueError(f"device must be 'cpu', 'cpu:N' (a CPU slot) or 'cuda:N', got {device!r}")


def is_cpu(device: str | None) -> bool:
    return (device or "cpu").strip().lower().split(":")[0] == "cpu"


def worker_name(device: str, host: str | None = None) -> str:
    prefix = "cpu" if device == "cpu" else device.replace(":", "")
    return f"{prefix}@{host or socket.gethostname()}"


def engine_kwargs(s: Settings) -> dict[str, Any]:
    """The engine's keyword arguments from a worker's settings.

    A worker schedules by priority (lanes): urgent requests first, bulk ones preempted for
    them, and ``RESERVED_SEQS`` engine slots (default 1/16 of the batch) bulk work never fills.
    """
    seqs = s.max_num_seqs
    reserved = s.reserved_seqs if s.reserved_seqs is not None else max(1, seqs // 16)
    urgent_only = s.urgent_only_steps if s.urgent_only_steps is not None else (16 if is_cpu(s.device) else 0)
    kwargs: dict[str, Any] = {
        "max_num_seqs": seqs,
        "scheduling_policy": "priority",
        "reserved_seqs": min(reserved, seqs - 1),
        # On a CPU a step's cost grows with its batch: urgent requests get 16 steps of every 17
        # to themselves while they run (measured: bench/results/priority-cpu.txt); on a GPU a
        # bigger decode batch costs almost nothing more, so they share every step.
        "urgent_only_steps": urgent_only,
    }
    optional = {"max_num_batched_tokens": s.max_num_batched_tokens, "kv_cache_memory_bytes": s.kv_cache_bytes,
                "dtype": s.dtype, "quantization": s.quantization,
                "structured_outputs_timeout_s": s.grammar_timeout}
    kwargs.update({k: v for k, v in optional.items() if v is not None})
    if s.speculative:
        kwargs["speculative_config"] = speculative_config(s.speculative, s.draft_model)
    if s.engine_kwargs:  # escape hatch: a JSON object of extra LLM(...) keyword arguments
        kwargs.update(json.loads(s.engine_kwargs))
    return kwargs


def speculative_config(spec: str, draft_model: str | None = None) -> dict[str, Any]:
    """``METHOD[:K]`` (``ngram``, ``suffix``, ``draft``; K an integer or ``auto``) as engine settings."""
    method, _, k = spec.partition(":")
    config: dict[str, Any] = {"method": method.strip(), "num_speculative_tokens": "auto"}
    if k and k != "auto":
        if not k.isdigit():
            raise ValueError(f"speculative: K must be an integer or 'auto', got {k!r}")
        config["num_speculative_tokens"] = int(k)
    if draft_model:
        config["draft_model"] = draft_model
    return config


def group_slot_count() -> int:
    """Jobs of group messages (short bulk jobs, ``worker.dispatch.publish.job_groups``) a worker process
    holds claimed at once: ``GROUP_HELD_JOBS``, default 4 x max-num-seqs. Enough for the engine
    to fill every step; without a bound, 128 task threads holding 32 jobs each claimed a whole
    5,000-job batch at once, leaving other workers nothing and the engine a queue of thousands."""
    s = settings()
    return max(1, s.group_held_jobs if s.group_held_jobs is not None else 4 * s.max_num_seqs)


class JobSlots:
    """A count of jobs a process may hold, taken a group at a time: all of a group's slots at
    once or none (threads each holding part of what they need would wait on one another).
    A release wakes only as many waiters as the free slots can serve (groups are mostly of one
    size): waking every waiting task thread at each finished job cost the worker half a
    millisecond of CPU a job. A waiter also wakes on its own timeout and looks again."""

    def __init__(self, total: int) -> None:
        self.total = total
        self._free = total
        self._typical = 1  # the size of the last group taken
        self._cond = threading.Condition()

    def take(self, n: int, timeout: float) -> bool:
        with self._cond:
            if not self._cond.wait_for(lambda: self._free >= n, timeout):
                return False
            self._free -= n
            self._typical = n
            return True

    def give(self, n: int) -> None:
        with self._cond:
            self._free += n
            servable = self._free // self._typical
            if servable:
                self._cond.notify(servable)


@dataclass
class Runtime:
    """The process's loaded model and running loop, plus the jobs it is generating."""

    model: str
    device: str  # what the engine uses ("cpu", "cuda:0")
    label: str  # what the store records ("cpu", "cpu:1", "cuda:1")
    loop: Any  # an EngineProcess (default) or an EngineLoop: submit / abort / stats / shutdown
    queue: str = ""  # the model's (bulk) queue; its interactive lane is ``<queue>.interactive``
    inflight: dict[str, str] = field(default_factory=dict)  # job id -> engine request id
    lock: threading.Lock = field(default_factory=threading.Lock)
    heartbeat: Any = None  # the process's Heartbeat, started with the first job
    reaper: Any = None  # the process's Reaper (worker processes only)
    pacer: Any = None  # the process's Pacer (worker processes only)
    metrics: Any = None  # the process's WorkerMetrics when SPECBATCH_METRICS_PORT is set
    draining: bool = False  # warm shutdown began: hand new messages back, give back what is left
    drain_expired: bool = False  # the drain timeout passed: in-flight requests aborted, late ones too
    inflight_lock: threading.Lock = field(default_factory=threading.Lock)
    dead: bool = False  # the engine loop died: take nothing more, give everything back, exit
    group_slots: "JobSlots" = field(default_factory=lambda: JobSlots(group_slot_count()))
    settings: Settings = field(default_factory=settings)  # the process's, read once; its tasks read them here
    tokenizer: Any = None  # a TokenCounter once loaded: prompts tokenized here, not in the engine (``prompt_tokenizer``)
    tokenizer_asked: bool = False  # its load has begun (at the first message of several jobs)
    _cache_model: Any = field(default=None, repr=False)  # ``cache_model()``'s answer once known ((key,) or (None,))

    def cache_model(self, store: Any) -> str | None:
        """The model key this worker's results are cached under (``worker.request.cache_key``),
        worked out at the first result that may be cached; None: nothing is cached (the cache
        is off, or the model is not a local file whose digest says what it is)."""
        if self._cache_model is None:
            key = None
            if self.settings.cache:
                from worker.request.cache_key import model_key_of

                try:
                    key = model_key_of(store, self.settings, self.model)
                except Exception:  # the cache is an optimisation: a result is stored without it
                    log.warning("no result cache: the model's digest could not be worked out", exc_info=True)
            self._cache_model = (key,)
        return self._cache_model[0]

    def heartbeats(self, store: Any, interval: float) -> Any:
        """The process's one ``Heartbeat`` (refreshing every running job's lease), started once."""
        with self.lock:
            if self.heartbeat is None:
                from worker.run.heartbeat import Heartbeat

                self.heartbeat = Heartbeat(store, self.loop.abort, interval)
            return self.heartbeat

    def batch_tokenizer(self) -> Any:
        """The worker's tokenizer for a message of several jobs: None until loaded (the engine
        tokenizes meanwhile). The first call starts loading it beside the jobs (~0.7 s, most of
        it importing transformers): a worker that only ever runs single jobs, whose prompts the
        engine tokenizes at no cost that matters, never pays it."""
        if self.tokenizer is None and not self.tokenizer_asked:
            with self.lock:
                if not self.tokenizer_asked:
                    self.tokenizer_asked = True
                    threading.Thread(target=self._load_tokenizer, name="specbatch-tokenizer", daemon=True).start()
        return self.tokenizer

    def _load_tokenizer(self) -> None:
        self.tokenizer = prompt_tokenizer(self.model)

    def add_inflight(self, job_id: str, request_id: str) -> None:
        """Record a request submitted for ``job_id``. One that reaches here after the drain
        timeout's sweep (its task passed the draining check just before a SIGTERM, and the
        sweep found nothing in flight) is aborted at once, as the sweep would have: otherwise it
        ran to the end while the worker waited, instead of being given back."""
        with self.inflight_lock:
            self.inflight[job_id] = request_id
            late = self.drain_expired
        if late:
            self.loop.abort(request_id)

    def forget_inflight(self, job_id: str, request_id: str) -> None:
        """This attempt is stored or given back; a newer attempt of its job (claimed again by this
        process after a reaper re-queued it) stays recorded."""
        with self.inflight_lock:
            if self.inflight.get(job_id) == request_id:
                del self.inflight[job_id]

    def abort_inflight(self) -> list[str]:
        """The drain timeout passed: abort every request in flight, and any submitted later."""
        with self.inflight_lock:
            self.drain_expired = True
            items = list(self.inflight.items())
        for _job_id, request_id in items:
            self.loop.abort(request_id)
        return [job_id for job_id, _ in items]

    def give_back_inflight(self, store: Any, why: str) -> list[str]:
        """This worker must restart and its jobs cannot finish here: abort every request in
        flight and put its job back in the queue, forgiven (the restart is not the job's
        fault). Returns the jobs given back (an attempt superseded meanwhile is not)."""
        with self.inflight_lock:
            self.drain_expired = True  # anything submitted from now on is aborted at once
            items = list(self.inflight.items())
        given: list[str] = []
        for job_id, request_id in items:
            try:
                self.loop.abort(request_id)
            except Exception:  # a dead engine: nothing to abort
                pass
            attempt = int(request_id.rpartition("#")[2])
            try:
                if store.give_back(job_id, attempt, f"worker restarting: {why}", forgive=True):
                    given.append(job_id)
            except Exception:  # the database is away too: the lease expires and the reaper has it
                log.warning("could not give back %s", job_id, exc_info=True)
        return given

    def abort_jobs(self, job_ids: list[str]) -> list[str]:
        """Abort the given jobs if this process is generating them (cooperative cancel)."""
        aborted = []
        for job_id in job_ids:
            request_id = self.inflight.get(job_id)
            if request_id is not None:
                self.loop.abort(request_id)
                aborted.append(job_id)
        return aborted


_lock = threading.Lock()
_runtime: Runtime | None = None
_store = None


def start(model: str | None = None, device: str | None = None, **engine_kwargs_given: Any) -> Runtime:
    """Load the model and start its loop (once per process); raise if the engine cannot be built."""
    global _runtime
    with _lock:
        if _runtime is not None:
            return _runtime
        s = settings()
        model = model or s.model
        label = device or s.device
        engine_device, _ = pin_device(label)  # idempotent; `specbatch worker` already did it
        set_gil_switch_interval()
        kwargs = {**engine_kwargs(s), **engine_kwargs_given}
        log.info("loading %s on %s (%s)", model, label, kwargs)
        metrics = _make_metrics(model, label)
        loop = build_engine_loop(model, engine_device, kwargs, on_death=_on_engine_death,
                                 on_step=metrics.observe_step if metrics else None)
        _runtime = Runtime(model=model, device=engine_device, label=label, loop=loop,
                           queue=s.but(model=model).queue_name, metrics=metrics)
        return _runtime


def prompt_tokenizer(model: str) -> Any:
    """The model's tokenizer in the worker process, or None (the engine tokenizes).

    A prompt the producer did not tokenize (one proven to fit the context is only bounded at
    ingest) is tokenized here, a message's jobs in one batched call, and reaches the engine as
    token ids: the engine process steps the model in one thread, and every prompt it tokenizes
    is CPU time taken from its steps (15% of it with one-token jobs on a tiny model), while the
    worker process has time to spare (vLLM tokenizes in its front-end process for the same
    reason). Only a tokenizer that loads without torch qualifies: the worker process never
    imports torch. The ids are the engine's own (``TokenCounter.tokenize_many``)."""
    from worker.request.validate import torch_free_counter

    try:
        return torch_free_counter(model)
    except Exception as exc:  # the engine tokenizes as before: slower, never wrong
        log.warning("prompts will be tokenized by the engine: the tokenizer did not load here (%r)", exc)
        return None


def engine_in_own_process() -> bool:
    """``ENGINE_PROCESS`` (default 1): the engine steps in a child process of its own, where the
    consumer's and task threads' Python never holds the GIL it needs (see ``engine.process``);
    0 keeps it in a thread of the worker process."""
    return settings().engine_process


def build_engine_loop(model: str, device: str, kwargs: dict[str, Any], **hooks: Any) -> Any:
    """The running engine: an ``EngineProcess`` or an in-process ``EngineLoop``, one interface.

    Either way the engine is built in the thread that steps it: all torch work in one thread
    (see ``EngineLoop.build``)."""
    from functools import partial

    from engine.process import llm_engine

    threads = settings().engine_threads or None
    factory = partial(llm_engine, model, device, kwargs, threads)
    if engine_in_own_process():
        from engine.process import EngineProcess

        return EngineProcess.build(factory, **hooks)
    from engine import EngineLoop

    return EngineLoop.build(factory, **hooks)


def _make_metrics(model: str, label: str) -> Any:
    """The process's Prometheus metrics when ``METRICS_PORT`` is set (served once the engine is up)."""
    if not settings().metrics_port:
        return None
    from worker.run.metrics import WorkerMetrics

    return WorkerMetrics(model=model, worker=_worker_name or worker_name(label),
                         stats=lambda: _runtime.loop.stats(), cache_stats=lambda: store().cache_stats())


def serve_metrics(rt: Runtime) -> None:
    """Expose ``/metrics`` on ``METRICS_ADDRESS:METRICS_PORT``; a taken port ends the worker."""
    if rt.metrics is None:
        return
    port, address = settings().metrics_port, settings().metrics_address
    try:
        rt.metrics.serve(port, address)
    except OSError as exc:
        _record_state("failed", f"metrics port {address}:{port} unavailable: {exc}")
        _exit(EXIT_METRICS_PORT, f"metrics port {address}:{port} unavailable ({exc}): "
                                 "give every worker process a port of its own")
    log.info("metrics on http://%s:%d/metrics", address, port)


def set_gil_switch_interval() -> None:
    """Hand the GIL over within ``GIL_SWITCH_INTERVAL`` seconds (default 1 ms, Python's is 5 ms).

    Why: the engine thread runs Python between torch ops for most of a step, and a task thread's
    claim gives the GIL up at every database round trip and then waits up to one switch interval
    to get it back; with the default an urgent job spent ~70 ms between its claim and its first
    step under a full batch (bench/priority.py's claimed->scheduled), most of it in those waits.
    """
    sys.setswitchinterval(settings().gil_switch_interval)


def get() -> Runtime:
    """The process's runtime, loading it now if the worker did not (e.g. ``-P solo`` tests)."""
    return _runtime or start()


def current() -> Runtime | None:
    return _runtime


def stop(drain_timeout: float = 30.0) -> None:
    global _runtime
    with _lock:
        if _runtime is not None:
            _runtime.loop.shutdown(drain_timeout=drain_timeout)
            if _runtime.heartbeat is not None:
                _runtime.heartbeat.stop()
            if _runtime.reaper is not None:
                _runtime.reaper.stop()
            if _runtime.pacer is not None:
                _runtime.pacer.stop()
            if _runtime.metrics is not None:
                _runtime.metrics.stop()
            _runtime = None


def store():
    """The process's Store (thread-safe; each call opens its own short transaction)."""
    global _store
    with _lock:
        if _store is None:
            from worker.store.store import Store

            _store = Store(settings().database_url, group_commit=True)
        return _store


_worker_name: str | None = None


def drain_timeout() -> float:
    return settings().drain_timeout


def _record_state(state: str, error: str | None = None) -> None:
    if _worker_name is None:
        return
    try:
        store().worker_state(_worker_name, state, error)
    except Exception:
        log.warning("could not record worker state %s", state, exc_info=True)


def _exit(code: int, why: str) -> None:
    """Leave now with ``code`` so the supervisor restarts this worker; record the exit first
    (``status`` shows ``exited N``), unless the database is why."""
    log.critical("worker exiting with %d: %s", code, why)
    if code != EXIT_STORE_UNREACHABLE:
        _record_exit(code, why)
    logging.shutdown()
    os._exit(code)


def _record_exit(code: int, why: str, timeout_s: float = 5.0) -> None:
    """``Store.worker_exited``, waited for at most ``timeout_s`` (an exit never hangs on it)."""
    if _worker_name is None:
        return

    def record() -> None:
        try:
            store().worker_exited(_worker_name, code, why[:1000])
        except Exception:
            log.warning("could not record the exit", exc_info=True)

    thread = threading.Thread(target=record, name="specbatch-record-exit", daemon=True)
    thread.start()
    thread.join(timeout_s)


def _arm_stop_watchdog(controller: Any) -> None:
    """Make every stop of the worker end the process: if it has not exited ``DRAIN_TIMEOUT`` +
    60 s after Celery began stopping, leave non-zero so the supervisor restarts it. (Seen: a
    Redis killed mid-reconnect raised inside kombu, Celery logged "Unrecoverable error" and its
    stop then hung, leaving a live process that served nothing.)"""
    original = controller.stop

    def stop(*args: Any, **kwargs: Any) -> Any:
        # Every stop drains, not only a signal's: after Celery's "Unrecoverable error" running
        # jobs got no drain timeout and were abandoned to the reaper, each charged an attempt.
        _drain_on_shutdown()

        def force_exit() -> None:
            time.sleep(drain_timeout() + 60.0)
            _give_back_inflight("the worker's stop did not finish")
            _exit(EXIT_STOP_HUNG, "the worker's stop did not finish")

        threading.Thread(target=force_exit, name="specbatch-stop-watchdog", daemon=True).start()
        return original(*args, **kwargs)

    controller.stop = stop


def _give_back_inflight(why: str) -> None:
    """Before a forced exit: every job in flight goes back to the queue, forgiven, with a new
    message (the orphan sweep publishes any this cannot)."""
    rt = _runtime
    if rt is None:
        return
    given = rt.give_back_inflight(store(), why)
    if not given:
        return
    try:
        from worker.dispatch.app import app
        from worker.dispatch.publish import publish_jobs

        publish_jobs(app, store().message_rows(given), lambda row: row.get("queue") or rt.queue)
    except Exception:
        log.warning("could not publish %d given-back job(s); the orphan sweep will", len(given), exc_info=True)


@signals.worker_init.connect
def _load_at_worker_start(sender=None, **_: Any) -> None:
    """Build the engine before the consumer starts; a worker that cannot serve never says
    ready and never takes a message: it records why and exits non-zero."""
    global _worker_name
    s = settings()
    if not s.load_at_start:
        return
    if sender is not None and hasattr(sender, "stop"):
        _arm_stop_watchdog(sender)
    _worker_name = getattr(sender, "hostname", None) or worker_name(s.device)
    info = dict(host=socket.gethostname(), pid=os.getpid(), device=s.device, queue=s.queue_name, model=s.model)
    deadline = time.monotonic() + s.db_retry_seconds
    while True:
        try:
            store().worker_starting(_worker_name, **info)
            break
        except Exception as exc:
            if time.monotonic() > deadline:
                _exit(EXIT_STORE_UNREACHABLE, f"database unreachable: {exc!r}")
            log.warning("database unreachable at start (%r); retrying", exc)
            time.sleep(2.0)
    try:
        rt = start()
    except BaseException as exc:
        log.exception("building the engine failed")
        _record_state("failed", f"engine could not be built: {exc!r}")
        _exit(EXIT_ENGINE_BUILD_FAILED, f"engine could not be built: {exc!r}")
        return
    _start_maintenance(rt)
    serve_metrics(rt)
    _record_state("ready")


def _start_maintenance(rt: Runtime) -> None:
    """The heartbeat (leases of running jobs) and the reaper (sweeps once now, then every interval)."""
    from worker.dispatch.app import app
    from worker.dispatch.pacer import Pacer
    from worker.run.reaper import Reaper

    s = settings()
    rt.heartbeats(store(), s.heartbeat_seconds)
    rt.reaper = Reaper(store(), app, lane_queues(rt.queue), worker=_worker_name or rt.label,
                       lease_s=s.lease_seconds, max_attempts=s.max_attempts).start()
    rt.pacer = Pacer(store(), app, lane_queues(rt.queue), owner=_worker_name or rt.label).start()


def _ready_file() -> str | None:
    """``READY_FILE``: exists exactly while this worker can take jobs (a Kubernetes exec
    readiness probe: ``test -f``); written once the model is loaded and the consumer runs."""
    return settings().ready_file


@signals.worker_ready.connect
def _mark_ready(**_: Any) -> None:
    path = _ready_file()
    rt = _runtime
    if path and rt is not None and not (rt.dead or rt.draining):
        with open(path, "w") as fh:
            fh.write(f"{os.getpid()} {_worker_name or rt.label} {rt.model}\n")


def _unmark_ready() -> None:
    path = _ready_file()
    if path:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def _on_engine_death(exc: BaseException) -> None:
    """The loop thread died: stop taking messages; task threads give their jobs back (they get
    ``EngineDied``) and hand back the messages this process had reserved; once all of them are
    acked, exit non-zero so the supervisor restarts us. Exiting while messages were still
    reserved left them in Redis's unacked index, and their jobs waited for the orphan sweep
    (90 s) before any worker saw them again."""
    from worker.dispatch.governor import holding_messages, stop_taking_messages

    rt = _runtime
    if rt is not None:
        rt.dead = True
    stop_taking_messages()
    _unmark_ready()
    _record_state("failed", f"engine loop died: {exc!r}")

    def exit_when_given_back() -> None:
        deadline = time.monotonic() + 30.0
        while (rt is not None and rt.inflight or holding_messages()) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # let the task threads' acks go out
        _exit(EXIT_ENGINE_DIED, f"engine loop died: {exc!r}")

    threading.Thread(target=exit_when_given_back, name="specbatch-exit", daemon=True).start()


@signals.worker_shutting_down.connect
def _drain_on_shutdown(**_: Any) -> None:
    """Warm shutdown (SIGTERM) began: messages not yet started go back to the queue; running
    jobs get ``DRAIN_TIMEOUT`` seconds to finish, then are aborted and given back at once."""
    rt = _runtime
    if rt is None or rt.draining:
        return
    rt.draining = True
    _unmark_ready()
    _record_state("draining")
    timeout = drain_timeout()

    def give_back_after_timeout() -> None:
        deadline = time.monotonic() + timeout
        while rt.inflight and time.monotonic() < deadline:
            time.sleep(0.05)
        for job_id in rt.abort_inflight():
            log.warning("drain timeout: giving back %s", job_id)

    threading.Thread(target=give_back_after_timeout, name="specbatch-drain", daemon=True).start()


@signals.worker_shutdown.connect
def _drain_at_worker_stop(sender: Any = None, **_: Any) -> None:
    _unmark_ready()
    stop(drain_timeout=drain_timeout())
    code = getattr(sender, "exitcode", 0) or 0
    if isinstance(code, int) and code:  # e.g. 1 after Celery's "Unrecoverable error"
        _record_exit(code, "Celery stopped the worker (its log says why)")
    else:
        _record_state("stopped")
