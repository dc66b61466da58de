"""Grammar compilation: cached per distinct grammar, off the loop thread, with a time limit.

Why threads and a deadline: xgrammar compiles a schema in C++ with the GIL released, in
milliseconds for ordinary schemas but in seconds to minutes for some (bounded string lengths in
many properties: measured 3.8 s for 10 such properties, several minutes for 300 on this
machine), and it cannot be interrupted. vLLM compiles with no limit (vllm#54003), so one such
schema stalls everything behind it. Here each distinct grammar compiles in a daemon thread of
its own; the loop only polls. A compilation not done ``timeout_s`` after it started fails
every request waiting on it, and that failure is cached: the same grammar fails at once later
instead of starting another compilation. The thread itself cannot be stopped and finishes in
the background; at most ``MAX_RUNAWAY`` such threads may run, beyond that new grammars are
refused (per request, with the reason) rather than piling up work on the cores.

Why xgrammar (not llguidance): mask time, measured by ``bench/grammar_mask.py`` on this 2-core
machine with SmolLM2's 49k vocabulary and a nested schema: xgrammar median 1 us / p90 4 us per
token mask, llguidance median 8 us / p90 20-33 us. (llguidance compiles lazily, in ~2-5 ms even
for the schemas that take xgrammar minutes, so it would need no time limit at all; the mask is
paid every step for every constrained row, compilation once per schema.)
"""

from __future__ import annotations

import atexit
import json
import logging
import threading
import time
from collections import OrderedDict
from typing import Any

from engine.structured.params import StructuredOutputsParams

log = logging.getLogger(__name__)

MAX_CACHED = 256  # compiled grammars (and cached failures) kept, least recently used evicted
MAX_RUNAWAY = 4  # compilations past their deadline still running before new ones are refused
JSON_OBJECT_SCHEMA = {"type": "object"}  # OpenAI's json_object: any JSON object
#: At interpreter exit, wait this long for compilations still running. Why: xgrammar aborts the
#: process (``terminate called without an active exception``, exit code 134) when it exits
#: during the last phase of a compilation (measured: exit 3.2 s into a 3.7 s compilation).
EXIT_WAIT_S = 60.0
_running: set[threading.Thread] = set()
_running_lock = threading.Lock()


@atexit.register
def _wait_for_compilations() -> None:
    deadline = time.monotonic() + EXIT_WAIT_S
    with _running_lock:
        threads = list(_running)
    for thread in threads:
        thread.join(timeout=max(0.0, deadline - time.monotonic()))


class Compilation:
    """One distinct grammar's compilation: pending, then a compiled grammar or an error."""

    __slots__ = ("key", "started", "deadline", "done", "compiled", "error", "thread")

    def __init__(self, key: tuple, timeout_s: float) -> None:
        self.key = key
        self.started = time.monotonic()
        self.deadline = self.started + timeout_s
        self.done = threading.Event()
        self.compiled: Any = None
        self.error: str | None = None
        self.thread: threading.Thread | None = None

    def poll(self) -> bool:
        """True once the outcome is known: compiled, failed, or past the deadline (failed)."""
        if self.done.is_set():
            return True
        if time.monotonic() >= self.deadline:
            self.error = self.error or (
                f"structured_outputs: compiling the grammar took longer than its "
                f"{self.deadline - self.started:g} s limit; it was abandoned (simplify the schema, e.g. fewer "
                "bounded string lengths)"
            )
            return True
        return False

    @property
    def failed(self) -> bool:
        return self.error is not None


class GrammarCompiler:
    """Compiles ``StructuredOutputsParams`` for one tokenizer and vocabulary (the target model's)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: set[int], timeout_s: float = 10.0,
                 tokenizer_lock: threading.Lock | None = None) -> None:
        if not timeout_s > 0:
            raise ValueError(f"the grammar compile timeout must be positive, got {timeout_s!r}")
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self.timeout_s = timeout_s
        self._tokenizer_lock = tokenizer_lock or threading.Lock()  # the tokenizer is shared with other threads
        self._lock = threading.Lock()  # the cache (the loop thread takes it: held briefly)
        self._build_lock = threading.Lock()  # building xgrammar's compiler (compile threads only)
        self._cache: OrderedDict[tuple, Compilation] = OrderedDict()
        self._xgr_compiler = None
        self.stats = {"compiled": 0, "cache_hits": 0, "failed": 0, "timed_out": 0}

    def _compiler(self):
        """xgrammar's compiler over this vocabulary (built once: ~0.1-0.2 s for SmolLM2's)."""
        with self._build_lock:
            if self._xgr_compiler is None:
                import xgrammar as xgr

                with self._tokenizer_lock:
                    info = xgr.TokenizerInfo.from_huggingface(
                        self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids
                    )
                # One thread per compilation: the loop keeps the other core(s).
                self._xgr_compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._xgr_compiler

    def submit(self, spec: StructuredOutputsParams) -> Compilation:
        """The compilation of ``spec``: cached, or started now in a thread of its own."""
        key = spec.key()
        with self._lock:
            entry = self._cache.get(key)
            if entry is not None:
                self._cache.move_to_end(key)
                self.stats["cache_hits"] += 1
                return entry
            entry = Compilation(key, self.timeout_s)
            runaway = sum(1 for e in self._cache.values()
                          if not e.done.is_set() and time.monotonic() >= e.deadline)
            if runaway >= MAX_RUNAWAY:
                entry.error = (f"structured_outputs: {runaway} grammar compilations are still running past their "
                               "time limit; new grammars are refused until they end")
                entry.done.set()
                return entry  # not cached: it may be fine later
            self._cache[key] = entry
            while len(self._cache) > MAX_CACHED:
                oldest_key, oldest = next(iter(self._cache.items()))
                if not oldest.done.is_set():
                    break  # never evict a pending one: its waiters hold it anyway
                self._cache.pop(oldest_key)
        entry.thread = threading.Thread(target=self._compile, args=(entry, spec), daemon=True,
                                        name="specbatch-grammar-compile")
        with _running_lock:
            _running.add(entry.thread)
        entry.thread.start()
        return entry

    def _compile(self, entry: Compilation, spec: StructuredOutputsParams) -> None:
        try:
            compiled = compile_spec(self._compiler(), spec)
        except Exception as exc:  # xgrammar raises RuntimeError with the parser's message
            message = str(exc).strip().splitlines()
            detail = message[-1] if message else type(exc).__name__
            # xgrammar prefixes "[time] /path/file.cc:line: "; keep the cause only.
            detail = detail.split(": ", 1)[1] if detail.startswith("[") and ": " in detail else detail
            entry.error = f"structured_outputs: the {spec.kind} does not compile: {detail[:500]}"
            self.stats["failed"] += 1
        else:
            if time.monotonic() >= entry.deadline:  # too late: its waiters already failed
                entry.error = entry.error or "structured_outputs: compiling the grammar took longer than its limit"
                self.stats["timed_out"] += 1
                log.warning("grammar compilation ended %.1f s after its deadline", time.monotonic() - entry.deadline)
            else:
                entry.compiled = compiled
                self.stats["compiled"] += 1
        finally:
            entry.done.set()
            with _running_lock:
                _running.discard(threading.current_thread())


#: The character class xgrammar 0.2.9 writes for a string with ``minLength``/``maxLength`` (and
#: no ``pattern`` or ``format``), and the class it writes for every other JSON string.
_BOUNDED_STRING_CLASS = r'[^\"\\\r\n]'
_JSON_STRING_CLASS = r'[^\0-\x1f\"\\\r\n]'


def json_schema_grammar(schema: dict, any_whitespace: bool):
    """xgrammar's grammar for ``schema``, with no raw control character inside any string.

    Why: xgrammar 0.2.9 lets U+0000-U+001F into length-bounded strings (its other strings and its
    patterns exclude them, as RFC 8259 section 7 requires), so a sampled record could fail
    ``json.loads`` (seen in CI: ``"name": "\x02~ore_A-"``). The class is narrowed in the grammar's
    text, wherever it occurs: no JSON string may hold those characters raw. Rewriting such strings
    as ``pattern`` instead would cost ~3 ms of compilation each with a 49k vocabulary, against
    microseconds for xgrammar's own repetition.
    """
    import xgrammar as xgr

    grammar = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=any_whitespace, strict_mode=True)
    return xgr.Grammar.from_ebnf(str(grammar).replace(_BOUNDED_STRING_CLASS, _JSON_STRING_CLASS))


def compile_spec(compiler, spec: StructuredOutputsParams):
    """``spec`` compiled by an ``xgrammar.GrammarCompiler``."""
    kind = spec.kind
    any_ws = not spec.disable_any_whitespace
    if kind in ("json", "json_object"):
        schema = spec.json if kind == "json" else JSON_OBJECT_SCHEMA
        return compiler.compile_grammar(json_schema_grammar(schema, any_ws))
    if kind == "regex":
        return compiler.compile_regex(spec.regex)
    if kind == "choice":
        # EBNF string literals escape like JSON strings.
        return compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.choice))
    return compiler.compile_grammar(spec.grammar)
