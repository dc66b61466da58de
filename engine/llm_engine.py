"""``LLMEngine``: requests in, one scheduled forward per ``step()``, outputs out.

It is single-threaded by design: ``EngineLoop`` owns it from one thread; ``LLM`` drives it
directly. ``make_request`` (validation and tokenisation) is the only method safe to call from
other threads, so bad input fails in the caller, at submission, never inside the loop.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import uuid
from typing import Any

import torch

from engine import memory
from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.detokenizer import StopChecker
from engine.faults import Faults
from engine.loader import eos_token_ids, load_model, load_tokenizer
from engine.messages import check_messages
from engine.model_runner import ModelRunner
from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from engine.sampler import SampleRow, Sampler, fresh_seed
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput
from engine.sequence import Request, Sequence, SequenceStatus
from engine.step_recovery import StepRecovery
from engine.token_bytes import TokenBytes
from specbatch_kernels import kernel_backend

log = logging.getLogger(__name__)

#: Bound on a request's priority (keeps the aging arithmetic far from overflow and typos out).
MAX_PRIORITY = 1_000_000


class LLMEngine:
    def __init__(self, config: EngineConfig, model=None, tokenizer=None) -> None:
        self.config = config
        self.tokenizer = tokenizer or load_tokenizer(config.tokenizer or config.model, config.trust_remote_code)
        self.model = model or load_model(
            config.model, config.dtype, config.device, config.trust_remote_code, config.fuse_layers,
            config.quantization,
        )
        text_config = self.model.config.get_text_config()
        self.vocab_size = text_config.vocab_size
        model_len = getattr(text_config, "max_position_embeddings", None) or 2048
        self.max_model_len = min(config.max_model_len or model_len, model_len)
        self.runner = ModelRunner(self.model, config, self.max_model_len)
        self.memory = memory.report(self.model, self.runner.num_blocks, config.block_size, self.runner.bytes_per_block)
        self.block_manager = BlockManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching,
                                          by_priority=config.scheduling_policy == "priority")
        self.scheduler = Scheduler(
            self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
            policy=config.scheduling_policy, aging_steps=config.priority_aging_steps,
            reserved_seqs=config.reserved_seqs, urgent_only_steps=config.urgent_only_steps,
            admission=config.admission, prefix_aging_steps=config.prefix_aging_steps,
        )
        self.eos_ids = eos_token_ids(self.model, self.tokenizer)
        self.sampler = Sampler(self.eos_ids, kernel_backend(config.device), self.vocab_size)
        self.recovery = StepRecovery(self.scheduler, self.block_manager)
        self.faults = Faults.from_env()  # test-only switches; inert unless SPECBATCH_FAULTS is set
        self._probed_last = False
        self.requests: dict[str, Request] = {}
        self._tokenizer_lock = threading.Lock()
        self.stop_checker = StopChecker(self.tokenizer, self.eos_ids, self.max_model_len, self._tokenizer_lock)
        # Token id -> (text, bytes) for logprobs; any thread (it takes the tokenizer lock).
        self.token_bytes = TokenBytes(self.tokenizer, self._tokenizer_lock)
        # Structured output: the compiler (built on first use) and the requests waiting for
        # their grammar, which join the scheduler once it is compiled.
        self.grammar_compiler = None
        self.waiting_for_grammar: dict[str, tuple[Request, Any]] = {}
        self._forced_cache: dict[str, tuple[int, ...]] = {}
        self.speculator = None
        if config.speculative_config is not None:
            from engine.spec.speculator import Speculator

            self.speculator = Speculator(config.speculative_config, self)
        # Called as hook(scheduler_output, step_inputs, logits) after each forward (tests, debugging).
        self.logits_hook = None
        self.last_forward_seconds = 0.0
        # Cumulative counters (monitoring reads them at any time): prompt_tokens and
        # cached_prompt_tokens count each request once, when it is first scheduled.
        self.stats: dict[str, int] = {"steps": 0, "scheduled_tokens": 0, "sampled_tokens": 0, "max_batch_size": 0,
                                      "last_batch_size": 0, "prompt_tokens": 0, "cached_prompt_tokens": 0}

    # ------------------------------------------------------------- submission
    def make_request(
        self,
        prompt: str | list[int] | None = None,
        *,
        messages: list[dict[str, Any]] | None = None,
        params: SamplingParams | dict | None = None,
        request_id: str | None = None,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        priority: int = 0,
    ) -> Request:
        """Validate and tokenise one request; raise ``ValueError`` naming the field at fault.

        ``cache_salt``: only requests with the same salt share prefix-cache blocks (tenants).
        ``priority``: lower is served first under ``scheduling_policy="priority"`` (vLLM's).
        """
        if params is None:
            params = SamplingParams()
        elif isinstance(params, dict):
            params = SamplingParams.from_dict(params)
        elif not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams or a dict, got {type(params).__name__}")
        if request_id is not None and not isinstance(request_id, str):
            raise ValueError(f"request_id must be a string, got {type(request_id).__name__}")
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise ValueError(f"cache_salt must be a string, got {type(cache_salt).__name__}")
        if not isinstance(priority, int) or isinstance(priority, bool) or abs(priority) > MAX_PRIORITY:
            raise ValueError(f"priority must be an integer in [-{MAX_PRIORITY}, {MAX_PRIORITY}], got {priority!r}")
        text: str | None = None
        if messages is not None:
            if prompt is not None:
                raise ValueError("give either prompt or messages, not both")
            token_ids = self.apply_chat_template(messages)
        elif isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            text = prompt
            with self._tokenizer_lock:
                token_ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)):
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                raise ValueError("prompt token ids must all be integers")
            token_ids = list(prompt)
            bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"prompt token ids out of the vocabulary [0, {self.vocab_size}): {bad[:5]}")
        elif prompt is None:
            raise ValueError("prompt (or messages) is required")
        else:
            raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if not token_ids:
            raise ValueError("prompt must not be empty (it has no tokens)")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt is {len(token_ids)} tokens, over the model's context of {self.max_model_len} "
                "(it must leave room for at least one output token)"
            )
        if not self.block_manager.can_ever_fit(len(token_ids) + 1):
            raise ValueError(
                f"prompt needs {self.block_manager.blocks_needed(len(token_ids) + 1)} KV-cache blocks but the "
                f"cache holds {self.block_manager.num_blocks}; raise kv_cache_memory_bytes"
            )
        params.check_vocabulary(self.vocab_size)
        room = self.max_model_len - len(token_ids)
        if params.max_tokens > room:  # a limit past the context ends with "length", never fails
            params = dataclasses.replace(params, max_tokens=room, min_tokens=min(params.min_tokens, room))
        metrics = RequestMetrics(arrival_time=arrival_time or time.time(), num_prompt_tokens=len(token_ids))
        return Request(
            request_id=request_id or uuid.uuid4().hex,
            prompt=text,
            prompt_token_ids=token_ids,
            params=params,
            metrics=metrics,
            cache_salt=cache_salt,
            seed=params.seed if params.seed is not None else fresh_seed(),
            priority=priority,
        )

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> list[int]:
        check_messages(messages)
        with self._tokenizer_lock:
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)

    def add(self, request: Request) -> None:
        """Put a validated request into the waiting queue (loop thread only)."""
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already running")
        self.requests[request.request_id] = request
        spec = request.params.structured_outputs
        compilation = self._compiler().submit(spec) if spec is not None else None
        for index in range(request.params.n):
            seq = Sequence(
                request=request,
                index=index,
                token_ids=list(request.prompt_token_ids),
                num_prompt_tokens=len(request.prompt_token_ids),
                logprobs=[] if request.params.logprobs is not None else None,
            )
            request.seqs.append(seq)
            if compilation is None:
                self.scheduler.add(seq)
        if compilation is not None:  # scheduled once its grammar is compiled (_admit_compiled)
            self.waiting_for_grammar[request.request_id] = (request, compilation)

    def add_request(self, prompt: str | list[int] | None = None, **kwargs) -> str:
        request = self.make_request(prompt, **kwargs)
        self.add(request)
        return request.request_id

    def abort(self, request_id: str) -> Request | None:
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        self.waiting_for_grammar.pop(request_id, None)
        request.aborted = True
        for seq in request.seqs:
            if not seq.is_finished:
                self._finish(seq, "abort")
        request.metrics.finished_time = time.time()
        return request

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self.recovery.has_work() or bool(self.waiting_for_grammar)

    # ------------------------------------------------------- structured output
    def _compiler(self):
        if self.grammar_compiler is None:
            from engine.structured.compiler import GrammarCompiler

            self.grammar_compiler = GrammarCompiler(
                self.tokenizer, self.vocab_size, self.eos_ids, self.config.structured_outputs_timeout_s,
                tokenizer_lock=self._tokenizer_lock,
            )
        return self.grammar_compiler

    def _admit_compiled(self, changed: dict[str, Request]) -> None:
        """Requests whose grammar is compiled join the scheduler; those whose grammar failed
        (or ran out of time) fail alone. Waits a little when nothing else could run."""
        if not self.waiting_for_grammar:
            return
        if not self.scheduler.has_unfinished() and not self.recovery.has_work():
            entries = [c for _r, c in self.waiting_for_grammar.values()]
            soonest = min(c.deadline for c in entries) - time.monotonic()
            entries[0].done.wait(timeout=max(0.0, min(0.02, soonest)))
        from engine.structured.state import GrammarState

        for request_id, (request, compilation) in list(self.waiting_for_grammar.items()):
            if not compilation.poll():
                continue
            del self.waiting_for_grammar[request_id]
            if compilation.failed:
                self._fail(request, compilation.error, changed)
                continue
            self._ensure_forced_drafter()
            words = -(-self.vocab_size // 32)
            for seq in request.seqs:
                seq.grammar = GrammarState(compilation.compiled, self._encode_forced, self.eos_ids, words)
                self.scheduler.add(seq)

    def _encode_forced(self, text: str) -> tuple[int, ...]:
        """Token ids of a grammar's forced text (loop thread: the stop checker's private
        tokenizer). Memoised: a schema's forced texts (``", "age": ``) recur in every record."""
        cache = self._forced_cache
        tokens = cache.get(text)
        if tokens is None:
            checker = self.stop_checker
            with checker._lock:
                tokens = tuple(checker.tokenizer.encode(text, add_special_tokens=False))
            if len(cache) >= 4096:
                cache.pop(next(iter(cache)))
            cache[text] = tokens
        return tokens

    def _ensure_forced_drafter(self) -> None:
        """Forced-token drafting needs the verifier: without speculation configured, a
        speculator whose proposer proposes nothing carries the grammar's forced tokens alone."""
        if self.speculator is not None or not self.config.forced_token_drafts:
            return
        from engine.spec.config import SpeculativeConfig
        from engine.spec.proposer import NullProposer
        from engine.spec.speculator import Speculator

        self.speculator = Speculator(SpeculativeConfig(method="ngram"), self, proposer=NullProposer())

    # ------------------------------------------------------------------- step
    def step(self) -> list[Request]:
        """Run one scheduled forward; return the requests that changed (new tokens or finished).

        A step that raises fails none of its requests outright: they are recomputed and probed
        one at a time (``StepRecovery``), so only a request that fails alone ends in error.
        """
        changed: dict[str, Request] = {}
        self._admit_compiled(changed)
        recovery = self.recovery
        probe = recovery.has_work() and (recovery.probing is not None or not self._probed_last)
        sched = recovery.schedule_probe() if probe else self.scheduler.schedule()
        self._probed_last = probe
        for seq, message in sched.failed:
            self._fail(seq.request, message, changed)
        if not sched.scheduled:
            return list(changed.values())
        self.stats["steps"] += 1
        self.stats["scheduled_tokens"] += sched.num_tokens
        now = time.time()
        requests_in_step = {item.seq.request.request_id: item.seq.request for item in sched.scheduled}
        batch_size = len(sched.scheduled)
        self.stats["max_batch_size"] = max(self.stats["max_batch_size"], batch_size)
        self.stats["last_batch_size"] = batch_size
        for request in requests_in_step.values():
            metrics = request.metrics
            if metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = now
                metrics.num_waiting_steps = self.scheduler.num_steps - 1 - request.arrival_step
                self.stats["prompt_tokens"] += metrics.num_prompt_tokens
                self.stats["cached_prompt_tokens"] += metrics.num_cached_tokens
            metrics.num_steps += 1
            metrics.max_batch_size = max(metrics.max_batch_size, batch_size)
        started = time.perf_counter()
        try:
            accepted = self._run_step(sched, list(requests_in_step.values()))
        except Exception as exc:  # recompute the step's requests; fail only one that fails alone
            error = f"model step failed: {type(exc).__name__}: {exc}"
            log.exception("step failed for %d requests; recomputing them", len(requests_in_step))
            self.stats["failed_steps"] = self.stats.get("failed_steps", 0) + 1
            for request in recovery.on_failure(list(requests_in_step.values()), error):
                self._fail(request, error, changed)
            return list(changed.values())
        for seq, tokens in accepted:
            request = seq.request
            try:
                self._append_tokens(seq, tokens)
            except Exception as exc:
                log.exception("post-processing %s failed", request.request_id)
                self._fail(request, f"post-processing failed: {type(exc).__name__}: {exc}", changed)
                continue
            changed[request.request_id] = request
        for item in sched.scheduled:
            seq = item.seq
            if not seq.is_finished and seq.status is SequenceStatus.RUNNING:
                self.block_manager.cache_full_blocks(seq)
        if probe:
            recovery.after_probe_step()
        if self.speculator is not None:
            self.speculator.propose([s for s in self.scheduler.running if not s.is_finished])
        if not probe:
            self.scheduler.record_step_time(time.perf_counter() - started)
        return list(changed.values())

    def _run_step(self, sched: SchedulerOutput, requests: list[Request]) -> list[tuple[Sequence, list[int]]]:
        """Prepare, forward and sample (or verify drafts): everything that may raise in a step."""
        start = time.perf_counter()
        inputs = self.runner.prepare(sched.scheduled)
        if self.faults.active:
            self.faults.before_forward(requests, self._prompt_text)
        logits = self.runner.forward(inputs)
        # Speculation's adaptive k fits the step's cost against its scheduled tokens.
        self.last_forward_seconds = time.perf_counter() - start
        if self.logits_hook is not None:
            self.logits_hook(sched, inputs, logits)
        for item in sched.scheduled:
            item.seq.num_computed_tokens += item.num_new_tokens
        if self.speculator is not None:
            return self.speculator.verify(sched, inputs, logits)
        return self._sample(sched, inputs, logits)

    def _prompt_text(self, request: Request) -> str:
        if request.prompt is not None:
            return request.prompt
        with self._tokenizer_lock:
            return self.tokenizer.decode(request.prompt_token_ids)

    def _sample(self, sched: SchedulerOutput, inputs, logits: torch.Tensor) -> list[tuple[Sequence, list[int]]]:
        seqs = [sched.scheduled[i].seq for i, _row, _n in inputs.sample_rows]
        if not seqs:
            return []
        rows = [SampleRow(seq, []) for seq in seqs]
        tokens = self.sampler.sample(logits, rows)
        wants_logprobs = [seq.params.logprobs for seq in seqs]
        logprobs = self.sampler.logprobs(logits, tokens, wants_logprobs)
        for seq, lp in zip(seqs, logprobs):
            if lp is not None:
                seq.logprobs.append(lp)
        return [(seq, [token]) for seq, token in zip(seqs, tokens)]

    def _append_tokens(self, seq: Sequence, tokens: list[int]) -> None:
        metrics = seq.request.metrics
        now = time.time()
        grammar = seq.grammar
        for token in tokens:
            if grammar is not None and not grammar.commit(token):
                # Cannot happen with the mask applied to every sampled row; never emit such a token.
                raise RuntimeError(f"token {token} is refused by the request's grammar")
            finished = self.stop_checker.append(seq, token)
            metrics.num_output_tokens += 1
            self.stats["sampled_tokens"] += 1
            if metrics.first_token_time is None:
                metrics.first_token_time = now
            metrics.last_token_time = now
            if grammar is not None and not (finished and seq.finish_reason == "stop") and grammar.must_stop():
                # The record is complete and only a stop token may follow: end here (even at the
                # max_tokens limit, which then did not cut anything).
                seq.finish_reason, seq.stop_reason, finished = "stop", None, True
            if finished:
                # Its prompt's KV is computed: cache it before the blocks are freed, or requests
                # that waited a step to share this prompt's prefix (the scheduler's in-batch prefix
                # sharing) would find nothing and compute it again, one request per step.
                self.block_manager.cache_full_blocks(seq)
                self._finish(seq, seq.finish_reason)
                break
        if seq.logprobs is not None and len(seq.logprobs) > seq.num_output_tokens:
            del seq.logprobs[seq.num_output_tokens :]

    def _finish(self, seq: Sequence, reason: str | None) -> None:
        seq.finish_reason = reason
        seq.status = SequenceStatus.FINISHED
        seq.draft_token_ids = []
        self.scheduler.remove(seq)
        self.recovery.discard(seq)
        if self.speculator is not None:
            self.speculator.finished(seq)
        request = seq.request
        if request.is_finished:
            request.metrics.finished_time = time.time()
            self.requests.pop(request.request_id, None)

    def _fail(self, request: Request, message: str, changed: dict[str, Request]) -> None:
        request.error = message
        for seq in request.seqs:
            if not seq.is_finished:
                self._finish(seq, "error")
        request.metrics.finished_time = time.time()
        self.requests.pop(request.request_id, None)
        changed[request.request_id] = request

    # ---------------------------------------------------------------- outputs
    def make_output(self, request: Request) -> RequestOutput:
        finished = request.is_finished
        outputs = []
        for seq in request.seqs:
            text = self.stop_checker.final_text(seq) if seq.is_finished else seq.text
            outputs.append(
                CompletionOutput(
                    index=seq.index,
                    text=text,
                    token_ids=list(seq.output_token_ids),
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                    logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
                    cumulative_logprob=(
                        sum(lp[t] for lp, t in zip(seq.logprobs, seq.output_token_ids)) if seq.logprobs else None
                    ),
                )
            )
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=outputs,
            finished=finished,
            metrics=request.metrics,
            error=request.error,
            num_cached_tokens=request.metrics.num_cached_tokens,
            seed=request.seed,
        )
