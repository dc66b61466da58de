"""``LLM``: the offline API, in vLLM's shape (``generate`` and ``chat`` over whole lists)."""

from __future__ import annotations

import itertools
from typing import Any, Sequence as Seq

from tqdm.auto import tqdm

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

PromptType = str | list[int] | dict[str, Any]
_call_counter = itertools.count()


class LLM:
    """Load a model once; ``generate`` runs every prompt through one continuous batch."""

    def __init__(self, model: str, **kwargs: Any) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs))

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> "LLM":
        """Wrap an existing engine (e.g. one sharing loaded weights with another)."""
        llm = cls.__new__(cls)
        llm.engine = engine
        return llm

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Seq[PromptType],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
        *,
        cache_salt: str | None = None,
        priority: Seq[int] | None = None,
    ) -> list[RequestOutput]:
        """Outputs in input order. A prompt is text, a token-id list or ``{"prompt_token_ids": [...]}``.

        ``cache_salt`` (for every prompt, or per prompt as a dict's ``"cache_salt"``): only
        requests with the same salt share prefix-cache blocks. ``priority`` (one per prompt, as
        in vLLM): lower is served first when the engine runs ``scheduling_policy="priority"``.
        """
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        items = []
        for prompt in prompts:
            if isinstance(prompt, dict):
                if "prompt_token_ids" in prompt:
                    item = {"prompt": list(prompt["prompt_token_ids"])}
                elif "prompt" in prompt:
                    item = {"prompt": prompt["prompt"]}
                else:
                    raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
                item["cache_salt"] = prompt.get("cache_salt", cache_salt)
            else:
                item = {"prompt": prompt, "cache_salt": cache_salt}
            items.append(item)
        if priority is not None:
            if len(priority) != len(items):
                raise ValueError(f"priority has {len(priority)} entries for {len(items)} prompts; they must match")
            for item, value in zip(items, priority):
                item["priority"] = value
        return self._run(items, sampling_params, use_tqdm)

    def chat(
        self,
        messages: list[dict[str, Any]] | Seq[list[dict[str, Any]]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """One conversation (a list of messages) or a list of them, through the chat template."""
        if messages and isinstance(messages[0], dict):
            messages = [messages]
        return self._run([{"messages": list(m)} for m in messages], sampling_params, use_tqdm)

    def _run(self, items: list[dict[str, Any]], sampling_params, use_tqdm: bool) -> list[RequestOutput]:
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(items)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(items):
                raise ValueError(
                    f"sampling_params has {len(params_list)} entries for {len(items)} prompts; they must match"
                )
        engine = self.engine
        # Validate everything before anything runs, so a bad prompt costs no work.
        call = next(_call_counter)
        requests = [
            engine.make_request(**item, params=params, request_id=f"gen-{call}-{i}")
            for i, (item, params) in enumerate(zip(items, params_list))
        ]
        order = {request.request_id: i for i, request in enumerate(requests)}
        for request in requests:
            engine.add(request)
        results: list[RequestOutput | None] = [None] * len(requests)
        bar = tqdm(total=len(requests), desc="generate", unit="req", disable=not use_tqdm)
        output_tokens = 0
        try:
            while engine.has_unfinished():
                for request in engine.step():
                    if request.is_finished:
                        out = engine.make_output(request)
                        results[order[request.request_id]] = out
                        output_tokens += sum(len(c.token_ids) for c in out.outputs)
                        bar.update(1)
                        elapsed = bar.format_dict["elapsed"] or 1e-9
                        bar.set_postfix(tok_s=f"{output_tokens / elapsed:.1f}")
        finally:
            bar.close()
            for request in requests:  # e.g. KeyboardInterrupt: leave no request behind
                if results[order[request.request_id]] is None:
                    engine.abort(request.request_id)
        return results  # type: ignore[return-value]
