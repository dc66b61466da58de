"""``EngineProcess``: the engine loop in a child process of its own, driven over a pipe.

Why: in a worker the Celery consumer, the task threads and the store's writes run Python in the
same process as the engine, and every torch op releases the GIL and then waits to get it back.
Measured on 2 CPU cores (bench/results/priority-cpu.txt): an interactive job's batch-1 steps took
~10 ms under a bulk run instead of ~3.5 ms, with the consumer thread holding the GIL 14% of the
time. vLLM V1 moved its EngineCore out of the API server's process for the same reason.

The child runs an ordinary ``EngineLoop``; this class mirrors that loop's interface (``submit``,
``abort``, ``stats``, ``shutdown``, ``running``, ``on_death``, ``on_step``) so callers do not
care which one they hold. Differences: handles resolve with the final output only (no token
stream), step observations arrive in batches a fraction of a second late, and the factory must
be picklable (the child is spawned, not forked: a fork of a process with threads is unsafe).

Life and death: the child ignores SIGINT/SIGTERM (a Ctrl-C or a systemd stop reaches the whole
group; the worker drains and then stops its engine), and exits as soon as its pipe closes, so a
worker killed with SIGKILL never leaves an engine holding memory. A child that dies (crash,
OOM killer) fails every pending request with ``EngineDied`` and calls ``on_death`` once.
"""

from __future__ import annotations

import itertools
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import Future
from multiprocessing.connection import Connection
from typing import Any, Callable

from engine.errors import EngineDied

log = logging.getLogger(__name__)

#: How often the child sends the step observations it has gathered.
STEP_FLUSH_SECONDS = 0.25
#: How long the child gathers finished requests' outputs before it sends them in one message.
OUTBOX_GATHER_SECONDS = 0.001
#: How long a control round trip (submit, stats) may take before the engine is presumed stuck.
REPLY_TIMEOUT_SECONDS = 60.0


class ProcessRequestHandle:
    """A request submitted to the engine process: a future for its final output."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.future: Future = Future()

    def result(self, timeout: float | None = None):
        return self.future.result(timeout)

    def done(self) -> bool:
        return self.future.done()


#: How long an idle OpenMP thread of the engine spins before it sleeps (libgomp's
#: ``GOMP_SPINCOUNT``), unless ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` is set already. Why: the
#: engine shares the host's cores with its worker process (Celery's consumer, task threads, the
#: store's writer), and libgomp's default (300,000 spins, ~a millisecond) kept the engine's
#: threads spinning on the cores those needed: with one-token jobs the engine process spent
#: 22 ms of CPU a job instead of 14 (bench/tiny_jobs.py), and batch-1 decode alone is no slower
#: at 1,000 (``OMP_WAIT_POLICY=passive`` saved as much but cost ~15% at batch 1).
ENGINE_SPINCOUNT = "1000"


def child_env() -> dict[str, str]:
    """The engine child's environment: the worker's, with a short OpenMP spin (see above)."""
    env = dict(os.environ)
    if "OMP_WAIT_POLICY" not in env and "GOMP_SPINCOUNT" not in env:
        env["GOMP_SPINCOUNT"] = env.get("SPECBATCH_ENGINE_SPINCOUNT", ENGINE_SPINCOUNT)
    return env


class EngineProcess:
    """Parent side: sends commands to the child and resolves handles from its replies."""

    def __init__(self, factory: Callable[[], Any], *,
                 on_death: Callable[[BaseException], None] | None = None,
                 on_step: Callable[[float, int, int], None] | None = None) -> None:
        self._factory = factory
        self._process: subprocess.Popen | None = None
        self._conn: Connection | None = None
        self.on_death = on_death
        self.on_step = on_step
        self.error: BaseException | None = None
        self.info: dict[str, Any] = {}
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        self._handles: dict[str, ProcessRequestHandle] = {}
        self._replies: dict[str, Future] = {}
        self._tokens = itertools.count()
        self._ready: Future = Future()
        self._accepting = True
        self._stopping = False
        self._stopped = threading.Event()
        self._reader = threading.Thread(target=self._read, name="specbatch-engine-reader", daemon=True)

    @classmethod
    def build(cls, factory: Callable[[], Any], timeout: float | None = None,
              on_death: Callable[[BaseException], None] | None = None,
              on_step: Callable[[float, int, int], None] | None = None) -> "EngineProcess":
        """Start the child, build the engine there and wait until it steps; raise its load error."""
        engine = cls(factory, on_death=on_death, on_step=on_step)
        engine._launch()
        try:
            engine.info = engine._ready.result(timeout)
        except BaseException:
            engine._kill()
            raise
        return engine

    def _launch(self) -> None:
        """A fresh interpreter (``python -c``), not ``multiprocessing``'s spawn: spawn re-runs the
        parent's ``__main__``, and a worker's main module is not ours to guard."""
        ours, theirs = socket.socketpair()
        env = child_env()
        package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
        code = f"from engine.process import serve_child; serve_child({theirs.fileno()})"
        self._process = subprocess.Popen([sys.executable, "-c", code], pass_fds=[theirs.fileno()], env=env,
                                         stdin=subprocess.DEVNULL, start_new_session=False)
        theirs.close()  # the child holds its end; ours must close for EOF to reach us
        self._conn = Connection(ours.detach())
        self._send(("build", self._factory, self.on_step is not None))
        self._reader.start()

    # ------------------------------------------------------------ any thread
    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    @property
    def running(self) -> bool:
        return self.error is None and not self._stopped.is_set() and self._alive()

    def _alive(self) -> bool:
        return self._process is not None and self._process.poll() is None

    @property
    def died(self) -> bool:
        return self.error is not None

    @property
    def accepting(self) -> bool:
        """New requests are taken. False from the moment the child is seen gone, up to 2 s before
        ``error`` is recorded (the reader first waits for the child to exit)."""
        return self._accepting and self.error is None

    @property
    def stop_requested(self) -> bool:
        """``shutdown`` was called: a loop that stops now stopped cleanly, it did not die."""
        return self._stopping

    def submit(self, prompt: str | list[int] | None = None, **fields: Any) -> ProcessRequestHandle:
        """Validate and queue a request in the child; bad input raises ``ValueError`` here."""
        result = self.submit_many([dict(fields, prompt=prompt)])[0]
        if isinstance(result, BaseException):
            raise result
        return result

    def submit_many(self, requests: list[dict[str, Any]]) -> list[ProcessRequestHandle | ValueError]:
        """``EngineLoop.submit_many`` in the child, in one round trip: a handle for each request,
        or the ``ValueError`` that refused it. A message's jobs submitted one round trip each
        reached the child's loop a few at a time (see ``EngineLoop.submit_many``)."""
        if not self._accepting or self.error is not None:
            raise RuntimeError("the engine is shutting down" if self.error is None
                               else f"the engine died: {self.error!r}")
        results: list[ProcessRequestHandle | ValueError] = []
        sent: list[tuple[str, dict[str, Any]]] = []
        waiting: list[tuple[int, str, Future]] = []
        now = time.time()
        with self._lock:
            for fields in requests:
                request_id = fields.get("request_id")
                request_id = request_id if request_id is not None else uuid.uuid4().hex
                if not isinstance(request_id, str):
                    results.append(ValueError(f"request_id must be a string, got {type(request_id).__name__}"))
                    continue
                if request_id in self._handles:
                    results.append(ValueError(f"request {request_id!r} is already running"))
                    continue
                handle = self._handles[request_id] = ProcessRequestHandle(request_id)
                reply = self._replies[request_id] = Future()
                waiting.append((len(results), request_id, reply))
                results.append(handle)
                sent.append((request_id, dict(fields, request_id=request_id,
                                              arrival_time=fields.get("arrival_time") or now)))
        if not sent:
            return results
        try:
            self._send(("submit_many", sent))
            for index, _request_id, reply in waiting:
                try:
                    reply.result(REPLY_TIMEOUT_SECONDS)
                except ValueError as exc:  # this request refused (the reader dropped its handle)
                    results[index] = exc
        except BaseException:
            with self._lock:
                for _index, request_id, _reply in waiting:
                    self._handles.pop(request_id, None)
                    self._replies.pop(request_id, None)
            raise
        return results

    def abort(self, request_id: str) -> None:
        try:
            self._send(("abort", request_id))
        except (OSError, RuntimeError):  # gone: its requests are failed by the reader
            pass

    def stats(self) -> dict[str, Any]:
        return self._ask("stats")

    def token_pieces(self, ids: list[int]) -> list[tuple[str, bytes]]:
        """Each token's display text and exact bytes (for logprobs), from the child's tokenizer."""
        return self._ask("pieces", list(ids))

    def shutdown(self, drain_timeout: float = 30.0) -> None:
        """Stop accepting, let running requests finish for up to ``drain_timeout``, abort the rest,
        then end the child."""
        self._accepting = False
        self._stopping = True
        if self._alive() and self.error is None:
            try:
                self._send(("shutdown", drain_timeout))
                self._stopped.wait(drain_timeout + 30.0)
            except (OSError, RuntimeError):
                pass
        self._wait(10.0)
        self._kill()
        self._reader.join(timeout=5.0)
        self._fail_pending(RuntimeError("engine loop stopped"))

    # ----------------------------------------------------------------- parent
    def _send(self, message: tuple) -> None:
        with self._send_lock:
            try:
                self._conn.send(message)
            except (OSError, ValueError) as exc:  # ValueError: the connection is closed
                raise RuntimeError(f"the engine process is gone: {exc!r}") from exc

    def _ask(self, kind: str, *args: Any) -> Any:
        if self.error is not None or self._stopped.is_set():
            raise RuntimeError("the engine process is not running")
        token = f"?{next(self._tokens)}"
        reply: Future = Future()
        with self._lock:
            self._replies[token] = reply
        try:
            self._send((kind, token, *args))
            return reply.result(REPLY_TIMEOUT_SECONDS)
        finally:
            with self._lock:
                self._replies.pop(token, None)

    def _read(self) -> None:
        """The reader thread: resolve replies and handles until the child's end closes."""
        died: str | None = None
        try:
            while True:
                message = self._conn.recv()
                kind = message[0]
                if kind == "outputs":  # finished requests: (request id, output, error), each
                    for request_id, output, error in message[1]:
                        with self._lock:
                            handle = self._handles.pop(request_id, None)
                        if handle is not None and not handle.done():
                            if error is None:
                                handle.future.set_result(output)
                            else:
                                handle.future.set_exception(error)
                elif kind == "answers":  # to a submit_many: (request id, None or the refusal), each
                    for request_id, refusal in message[1]:
                        self._answer(request_id, refusal is None, refusal)
                elif kind in ("rejected", "reply"):
                    self._answer(message[1], kind == "reply", message[2])
                elif kind == "steps":
                    self._observe_steps(message[1])
                elif kind == "ready":
                    self._ready.set_result(message[1])
                elif kind == "build_failed":
                    self._ready.set_exception(RuntimeError(f"building the engine failed: {message[1]}"))
                elif kind == "died":
                    died = message[1]
                elif kind == "stopped":
                    self._stopped.set()
        except (EOFError, OSError):
            pass
        finally:
            self._on_child_gone(died)

    def _answer(self, key: str, ok: bool, value: Any) -> None:
        """Resolve the reply awaited under ``key``; a refused submission drops its handle."""
        with self._lock:
            reply = self._replies.pop(key, None)
            if not ok:
                self._handles.pop(key, None)
        if reply is not None:
            if ok:
                reply.set_result(value)
            else:
                reply.set_exception(value)

    def _observe_steps(self, steps: list[tuple[float, int, int]]) -> None:
        if self.on_step is None:
            return
        for seconds, tokens, batch in steps:
            try:
                self.on_step(seconds, tokens, batch)
            except Exception:
                log.exception("step observer failed")
                return

    def _on_child_gone(self, died: str | None) -> None:
        self._accepting = False
        code = self._wait(2.0)
        if not self._ready.done():
            self._ready.set_exception(RuntimeError(f"the engine process exited while building (exit code {code})"))
            return
        if self._ready.exception() is not None:  # it never ran: build() raises, nothing died
            return
        if self._stopping and died is None:
            self._stopped.set()
            self._fail_pending(RuntimeError("engine loop stopped"))
            return
        self.error = EngineDied(f"engine loop died: {died}" if died else
                                f"the engine process exited unexpectedly (exit code {code})")
        log.error("%s", self.error)
        self._fail_pending(self.error)
        if self.on_death is not None:
            try:
                self.on_death(self.error)
            except Exception:
                log.exception("on_death callback failed")

    def _fail_pending(self, exc: BaseException) -> None:
        with self._lock:
            pending = list(self._handles.values()) + list(self._replies.values())
            self._handles.clear()
            self._replies.clear()
        for item in pending:
            future = item.future if isinstance(item, ProcessRequestHandle) else item
            if not future.done():
                future.set_exception(exc)

    def _wait(self, timeout: float) -> int | None:
        """The child's exit code once it has exited (within ``timeout``), else None."""
        try:
            return self._process.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def _kill(self) -> None:
        if self._alive():
            self._process.kill()
            self._wait(5.0)
        try:
            self._conn.close()
        except OSError:
            pass


# ---------------------------------------------------------------------- child
class _Sender:
    """The child's one way back: a lock around the pipe (the loop thread and the command thread
    both send) and the step observations gathered between flushes."""

    def __init__(self, conn) -> None:
        self.conn = conn
        self.lock = threading.Lock()
        self.steps: list[tuple[float, int, int]] = []
        self.steps_lock = threading.Lock()
        self.outbox: list[tuple[str, Any, BaseException | None]] = []  # (request id, output, error)
        self.outbox_lock = threading.Lock()
        self.outbox_ready = threading.Event()
        threading.Thread(target=self.flush_outputs_forever, name="specbatch-outputs", daemon=True).start()

    def send(self, message: tuple) -> None:
        with self.lock:
            try:
                self.conn.send(message)
            except (OSError, ValueError):  # the worker is gone
                os._exit(0)

    def post(self, request_id: str, output: Any, error: BaseException | None) -> None:
        """Queue a finished request's output for the next ``outputs`` message: a step's
        finished requests travel together (one-token jobs finish 30-60 a step, and a message
        each cost the engine process a pickle frame and a system call apiece)."""
        with self.outbox_lock:
            self.outbox.append((request_id, output, error))
        self.outbox_ready.set()

    def flush_outputs_forever(self) -> None:
        """Send the outbox whenever it fills, a moment after its first entry: the loop thread
        resolves a step's finished requests one after another, within about a millisecond."""
        while True:
            self.outbox_ready.wait()
            time.sleep(OUTBOX_GATHER_SECONDS)
            self.outbox_ready.clear()
            self.flush_outputs()

    def flush_outputs(self) -> None:
        """Send what the outbox holds now (also before the child reports a death or a stop)."""
        with self.outbox_lock:
            entries, self.outbox = self.outbox, []
            if not entries:
                return
            try:
                self.send(("outputs", entries))
            except Exception:  # one output that does not pickle: send the others, fail it alone
                self.send(("outputs", [_checked(entry) for entry in entries]))

    def observe_step(self, seconds: float, tokens: int, batch: int) -> None:
        with self.steps_lock:
            self.steps.append((seconds, tokens, batch))

    def flush_steps_forever(self) -> None:
        while True:
            time.sleep(STEP_FLUSH_SECONDS)
            with self.steps_lock:  # no step is appended to a list already sent
                steps, self.steps = self.steps, []
            if steps:
                self.send(("steps", steps))


def _picklable(exc: BaseException) -> BaseException:
    """The exception itself when it crosses a pipe intact, else a ``RuntimeError`` naming it."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return RuntimeError(repr(exc))


def _forward(sender: _Sender, request_id: str, future: Future) -> None:
    """A finished request's output (or error) into the sender's outbox (``_Sender.post``)."""
    exc = future.exception()
    sender.post(request_id, future.result() if exc is None else None, None if exc is None else _picklable(exc))


def _checked(entry: tuple[str, Any, BaseException | None]) -> tuple[str, Any, BaseException | None]:
    """An outbox entry whose output does not pickle becomes its request's error (it alone fails)."""
    request_id, output, error = entry
    try:
        pickle.dumps(output)
        return entry
    except Exception as pickling:
        return request_id, None, RuntimeError(f"the request's output could not be sent: {pickling!r}")


def serve_child(fd: int) -> None:
    """The engine process's entry point: the socket ``fd`` carries a ``("build", factory,
    observe_steps)`` message first, then commands until shutdown or until it closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=os.environ.get("SPECBATCH_ENGINE_LOG_LEVEL", "INFO"),
                        format="[%(asctime)s: %(levelname)s/engine %(process)d] %(name)s: %(message)s")
    conn = Connection(fd)
    try:
        _, factory, observe_steps = conn.recv()
    except (EOFError, OSError):
        os._exit(0)
    except BaseException as exc:  # the factory did not unpickle here
        conn.send(("build_failed", repr(exc)))
        return
    _serve(conn, factory, observe_steps)


def _serve(conn: Connection, factory: Callable[[], Any], observe_steps: bool) -> None:
    from engine.loop import EngineLoop

    sender = _Sender(conn)

    def on_death(exc: BaseException) -> None:
        sender.flush_outputs()
        sender.send(("died", repr(exc)))
        os._exit(1)

    try:
        loop = EngineLoop.build(factory, on_death=on_death,
                                on_step=sender.observe_step if observe_steps else None)
    except BaseException as exc:  # EngineLoop.build wraps the factory's error: send that one
        sender.send(("build_failed", repr(exc.__cause__ or exc)))
        return
    if observe_steps:
        threading.Thread(target=sender.flush_steps_forever, name="specbatch-step-flush", daemon=True).start()
    sender.send(("ready", {"pid": os.getpid()}))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the worker is gone: nobody is left to answer
            os._exit(0)
        kind = message[0]
        if kind == "submit_many":
            ids = [request_id for request_id, _ in message[1]]
            try:
                results = loop.submit_many([fields for _, fields in message[1]])
            except BaseException as exc:  # the loop refuses everything (shutting down, dead)
                results = [exc] * len(ids)
            sender.send(("answers", [(request_id, _picklable(r) if isinstance(r, BaseException) else None)
                                     for request_id, r in zip(ids, results)]))
            for request_id, result in zip(ids, results):  # after the answers: an output never comes first
                if not isinstance(result, BaseException):
                    result.future.add_done_callback(lambda future, rid=request_id: _forward(sender, rid, future))
        elif kind == "abort":
            loop.abort(message[1])
        elif kind in ("stats", "pieces"):
            try:
                value = loop.stats() if kind == "stats" else loop.engine.token_bytes.pieces(message[2])
                sender.send(("reply", message[1], value))
            except BaseException as exc:
                sender.send(("rejected", message[1], _picklable(exc)))
        elif kind == "shutdown":
            loop.shutdown(drain_timeout=message[1])
            sender.flush_outputs()
            sender.send(("stopped",))
            conn.close()
            return


def llm_engine(model: str, device: str, kwargs: dict[str, Any], threads: int | None = None) -> Any:
    """A picklable engine factory: resolve ``model`` (an alias, a GGUF file, a directory) and
    build its ``LLMEngine`` with the ``LLM`` keyword arguments ``kwargs``; ``threads`` sets
    torch's intra-op threads first (in the thread that will step the engine: its OpenMP team)."""
    from engine.llm import LLM
    from engine.model_hub import resolve_model

    if threads:
        import torch

        torch.set_num_threads(threads)
    return LLM(resolve_model(model), device=device, **kwargs).engine
