"""``EngineLoop``: the engine stepping in its own thread while requests come and go.

Callers in any thread ``submit`` (validation and tokenisation happen in the caller, so bad
input raises there); the loop thread merges new requests into the running batch at the next
step, streams new tokens to each ``RequestHandle`` and resolves it when the request ends.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable, Iterator

from engine.errors import EngineDied
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput

log = logging.getLogger(__name__)
_DONE = object()


class RequestHandle:
    """A submitted request: a future for its final output and an iterator of new token ids."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.future: Future[RequestOutput] = Future()
        self._tokens: queue.Queue = queue.Queue()
        self._sent = 0

    def result(self, timeout: float | None = None) -> RequestOutput:
        return self.future.result(timeout)

    def done(self) -> bool:
        return self.future.done()

    def __iter__(self) -> Iterator[list[int]]:
        """New token ids of the first sample, as they are generated."""
        while True:
            item = self._tokens.get()
            if item is _DONE:
                return
            yield item

    def _publish(self, out: RequestOutput) -> None:
        tokens = out.outputs[0].token_ids if out.outputs else []
        if len(tokens) > self._sent:
            self._tokens.put(tokens[self._sent :])
            self._sent = len(tokens)
        if out.finished:
            self._tokens.put(_DONE)
            if not self.future.done():
                self.future.set_result(out)


class EngineLoop:
    def __init__(self, engine: LLMEngine | None = None, *, factory: Callable[[], LLMEngine] | None = None,
                 on_death: Callable[[BaseException], None] | None = None,
                 on_step: Callable[[float, int, int], None] | None = None) -> None:
        if (engine is None) == (factory is None):
            raise ValueError("pass an engine or a factory that builds one, not both")
        self.engine = engine
        self._factory = factory
        self._ready = threading.Event()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._handles: dict[str, RequestHandle] = {}
        self._stopping = threading.Event()
        self._accepting = True
        self._stop_requested = False
        # Accepting and enqueueing are one step w.r.t. shutdown: a request is either queued before
        # the loop stops taking requests (and then resolved) or refused at submit.
        self._accept_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="specbatch-engine-loop", daemon=True)
        self.error: BaseException | None = None
        # Called from the loop thread after a crash, once every pending handle has failed.
        self.on_death = on_death
        # Called from the loop thread after every step with (seconds, scheduled tokens, batch
        # size): monitoring observes steps without the engine knowing who watches.
        self.on_step = on_step

    def start(self) -> "EngineLoop":
        self._thread.start()
        return self

    @classmethod
    def build(cls, factory: Callable[[], LLMEngine], timeout: float | None = None,
              on_death: Callable[[BaseException], None] | None = None,
              on_step: Callable[[float, int, int], None] | None = None) -> "EngineLoop":
        """Build the engine inside the loop's own thread, then start stepping; raise its load error.

        Why: torch's CPU ops run on an OpenMP thread team owned by the calling thread. An engine
        loaded (or warmed up) in one thread and stepped in another leaves two teams on the cores;
        libgomp then sees more threads than CPUs, stops spin-waiting between parallel regions, and
        every small op pays a futex wake-up: steps were ~20% slower on 2 cores (measured). All of
        the engine's torch work in one thread keeps one team.
        """
        loop = cls(factory=factory, on_death=on_death, on_step=on_step).start()
        if not loop._ready.wait(timeout):
            raise TimeoutError(f"the engine was not built within {timeout} s")
        if loop.engine is None:
            raise RuntimeError(f"building the engine failed: {loop.error!r}") from loop.error
        return loop

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    @property
    def accepting(self) -> bool:
        """New requests are taken (False once shutting down or dead)."""
        return self._accepting and self.error is None

    @property
    def stop_requested(self) -> bool:
        """``shutdown`` was called: a loop that stops now stopped cleanly, it did not die."""
        return self._stop_requested

    @property
    def died(self) -> bool:
        """The loop crashed (as opposed to being shut down or never built)."""
        return self.error is not None and self.engine is not None

    # ------------------------------------------------------------ any thread
    def submit(self, prompt: str | list[int] | None = None, **fields: Any) -> RequestHandle:
        """Validate a request (``LLMEngine.make_request``, whose keywords it takes: messages,
        params, request_id, arrival_time, cache_salt, priority) and queue it; it joins the running
        batch at the next step."""
        result = self.submit_many([dict(fields, prompt=prompt)])[0]
        if isinstance(result, BaseException):
            raise result
        return result

    def submit_many(self, requests: list[dict[str, Any]]) -> list[RequestHandle | ValueError]:
        """``submit`` for several requests (each a dict of its keywords) that join the running batch
        at the same step: a handle for each, or the ``ValueError`` that refused it. Why together:
        a worker submitting a message's 32 jobs one by one made the loop step on the first few
        (mean batch 33 of 64 with one-token jobs) while the rest were still on their way.
        A loop that is shutting down refuses them all (``RuntimeError``)."""
        if not self._accepting:
            raise RuntimeError("the engine loop is shutting down")
        if self.engine is None:  # built by the loop thread: wait for it
            self._ready.wait()
            if self.engine is None:
                raise RuntimeError(f"the engine could not be built: {self.error!r}")
        results: list[RequestHandle | ValueError] = []
        accepted: list[tuple[Any, RequestHandle]] = []
        for fields in requests:
            fields = dict(fields)
            try:
                request = self.engine.make_request(fields.pop("prompt", None), **fields)
            except ValueError as exc:
                results.append(exc)
                continue
            handle = RequestHandle(request.request_id)
            accepted.append((request, handle))
            results.append(handle)
        with self._accept_lock:
            if not self._accepting:
                raise RuntimeError("the engine loop is shutting down")
            for request, handle in accepted:
                self._inbox.put(("add", request, handle))
        if accepted:
            self._wakeup.set()
        return results

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id, None))
        self._wakeup.set()

    def shutdown(self, drain_timeout: float = 30.0) -> None:
        """Stop accepting, let running requests finish for up to ``drain_timeout``, abort the rest."""
        self._stop_requested = True
        with self._accept_lock:
            self._accepting = False
        deadline = time.monotonic() + drain_timeout
        while self._handles_pending() and time.monotonic() < deadline and self.running:
            time.sleep(0.01)
        self._stopping.set()
        self._wakeup.set()
        if self._thread.is_alive():
            self._thread.join(timeout=max(1.0, drain_timeout))

    def _handles_pending(self) -> bool:
        return bool(self._handles) or not self._inbox.empty()

    def token_pieces(self, ids: list[int]) -> list[tuple[str, bytes]]:
        """Each token's display text and exact bytes (for logprobs)."""
        return self.engine.token_bytes.pieces(ids)

    def stats(self) -> dict[str, Any]:
        scheduler = self.engine.scheduler
        return {
            **self.engine.stats,
            "running": len(scheduler.running),
            "waiting": len(scheduler.waiting),
            "preemptions": scheduler.num_preemptions,
            "free_blocks": self.engine.block_manager.num_free_blocks,
            "num_blocks": self.engine.block_manager.num_blocks,
        }

    # ----------------------------------------------------------- loop thread
    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, payload, handle = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                try:
                    self.engine.add(payload)
                    self._handles[payload.request_id] = handle
                except Exception as exc:
                    handle.future.set_exception(exc)
                    handle._tokens.put(_DONE)
            elif kind == "abort":
                request = self.engine.abort(payload)
                handle = self._handles.pop(payload, None)
                if request is not None and handle is not None:
                    handle._publish(self.engine.make_output(request))

    def _run(self) -> None:
        try:
            if self.engine is None:
                self.engine = self._factory()
        except BaseException as exc:
            self.error = exc
            log.exception("building the engine failed")
            return
        finally:
            self._ready.set()
        faults = self.engine.faults
        try:
            while not self._stopping.is_set():
                if faults.active:
                    faults.check_loop(self.engine.stats["steps"])
                self._wakeup.clear()
                self._drain_inbox()
                if not self.engine.has_unfinished():
                    self._wakeup.wait(timeout=0.5)
                    continue
                for request in self._step():
                    handle = self._handles.get(request.request_id)
                    if handle is None:
                        continue
                    try:
                        handle._publish(self.engine.make_output(request))
                    except Exception as exc:  # one bad output never stops the loop
                        log.exception("publishing %s failed", request.request_id)
                        handle.future.set_exception(exc)
                    if request.is_finished:
                        self._handles.pop(request.request_id, None)
        except BaseException as exc:  # the loop itself broke: fail everyone, loudly
            self.error = exc
            log.exception("engine loop crashed")
        finally:
            self._refuse_queued()
            for request_id, handle in list(self._handles.items()):
                if self.error is not None:  # died: the request is fine, the engine is not
                    if not handle.done():
                        handle.future.set_exception(EngineDied(f"engine loop died: {self.error!r}"))
                    handle._tokens.put(_DONE)
                    continue
                request = self.engine.abort(request_id)
                if request is not None:
                    handle._publish(self.engine.make_output(request))
                elif not handle.done():
                    handle.future.set_exception(RuntimeError("engine loop stopped"))
            self._handles.clear()
            if self.error is not None and self.on_death is not None:
                try:
                    self.on_death(self.error)
                except Exception:
                    log.exception("on_death callback failed")

    def _step(self) -> list:
        """One engine step, reported to ``on_step`` (a failing observer never stops the loop)."""
        if self.on_step is None:
            return self.engine.step()
        stats = self.engine.stats
        steps, tokens = stats["steps"], stats["scheduled_tokens"]
        start = time.perf_counter()
        changed = self.engine.step()
        if stats["steps"] > steps:
            try:
                self.on_step(time.perf_counter() - start, stats["scheduled_tokens"] - tokens, stats["last_batch_size"])
            except Exception:
                log.exception("step observer failed")
        return changed

    def _refuse_queued(self) -> None:
        """Stop accepting and fail what is still queued: nothing steps it any more (a loop that
        died says so with ``EngineDied``, so callers hand the request to another engine)."""
        with self._accept_lock:
            self._accepting = False
        while True:
            try:
                kind, _payload, handle = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add" and not handle.done():
                handle.future.set_exception(
                    EngineDied(f"engine loop died: {self.error!r}") if self.error is not None
                    else RuntimeError("engine loop stopped before the request started")
                )
                handle._tokens.put(_DONE)
