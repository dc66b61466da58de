"""Outside dicts -> the engine's request model, in one place.

``SamplingParams`` owns every default and bound; this module only maps names onto it: the
OpenAI body fields of a bulk line or a ``Client.submit`` call (``openai_sampling_params``),
and the stored job a worker's claim returns (``request_from_row``). Every failure is a
``ValueError`` naming the field, so a bad request fails its own job and nothing else.
"""

from __future__ import annotations

import copy
import os
import secrets
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any

from engine.sampling_params import SEED_MAX, SamplingParams
from engine.structured.params import StructuredOutputsParams

from worker.request.openai_fields import BODY_FIELDS, JOB_FIELDS, RULES, Endpoint

#: OpenAI body fields that become ``SamplingParams`` (vLLM's extensions included), as
#: ``openai_fields`` classifies them; ``max_completion_tokens`` is OpenAI's newer name for
#: ``max_tokens``, and chat's ``logprobs``/``top_logprobs`` map onto ``SamplingParams.logprobs``.
OPENAI_SAMPLING_FIELDS = frozenset(
    name for name, rule in RULES.items() if rule.status == "honoured" and name not in BODY_FIELDS | JOB_FIELDS
)


def openai_sampling_params(fields: dict[str, Any], *, endpoint: Endpoint | None = None) -> SamplingParams:
    """``SamplingParams`` from OpenAI-named fields; ``null`` means "the default", as in OpenAI.

    ``max_completion_tokens`` and the deprecated ``max_tokens`` mean the same limit; when both
    are given, ``max_completion_tokens`` wins (vLLM's rule: OpenAI's own files carry both, and
    the newer name is the one OpenAI honours). ``logprobs`` is the endpoint's: chat's is a
    boolean with the number of alternatives in ``top_logprobs``; completions' (and
    ``SamplingParams``', the default) is that number itself.
    """
    given = {k: v for k, v in fields.items() if v is not None}
    _structured_outputs(given)
    if endpoint == "chat":
        _chat_logprobs(given)
    elif "top_logprobs" in given:
        raise ValueError("top_logprobs: a chat completions field; here logprobs is the number of alternatives")
    newer = given.pop("max_completion_tokens", None)
    if newer is not None:
        older = given.get("max_tokens")
        if older is not None:
            SamplingParams(max_tokens=older)  # the one it replaces is still checked: a bad value stays an error
        given["max_tokens"] = newer
    try:
        return SamplingParams.from_dict(given)
    except ValueError as exc:
        if newer is not None and str(exc).startswith("max_tokens"):
            raise ValueError(f"max_completion_tokens: {exc}") from None
        raise


def line_sampling_params(fields: dict[str, Any], endpoint: Endpoint) -> SamplingParams:
    """``openai_sampling_params`` for a bulk line, checked once per distinct set of scalar fields.

    A file's lines mostly share their sampling fields (``{"max_tokens": 1}``), and checking them
    is half of parsing a line; identical scalar fields give an equal ``SamplingParams``, so each
    line gets a copy of the one built for them (its lists its own: the caller may set them)."""
    key = _scalar_key(fields)
    if key is None:
        return openai_sampling_params(fields, endpoint=endpoint)
    shared = _params_for(key, endpoint)
    params = object.__new__(SamplingParams)  # a field-for-field copy, without checking it again
    params.__dict__.update(shared.__dict__)
    params.stop, params.stop_token_ids = list(shared.stop), list(shared.stop_token_ids)
    if shared.structured_outputs is not None:
        params.structured_outputs = copy.copy(shared.structured_outputs)
    return params


_SCALARS = (str, int, float, bool, type(None))


def _scalar_key(fields: dict[str, Any]) -> tuple | None:
    """The fields as a hashable key that tells ``1``, ``1.0`` and ``True`` apart, or None when a
    value is not a scalar (a list, an object: built afresh each time)."""
    items = []
    for name, value in fields.items():
        kind = type(value)
        if kind not in _SCALARS:
            return None
        items.append((name, kind, value))
    items.sort(key=lambda item: item[0])
    return tuple(items)


@lru_cache(maxsize=512)
def _params_for(key: tuple, endpoint: Endpoint) -> SamplingParams:
    return openai_sampling_params({name: value for name, _kind, value in key}, endpoint=endpoint)


#: vLLM's older body fields for structured output -> ``StructuredOutputsParams`` fields.
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def _structured_outputs(given: dict[str, Any]) -> None:
    """OpenAI's ``response_format`` and vLLM's ``guided_*`` -> ``structured_outputs``, in place."""
    specs: list[tuple[str, dict[str, Any]]] = []
    response_format = given.pop("response_format", None)
    if response_format is not None:
        spec = response_format_spec(response_format)
        if spec is not None:
            specs.append(("response_format", spec))
    for name, field in GUIDED.items():
        if name in given:
            specs.append((name, {field: given.pop(name)}))
    if len(specs) > 1:
        raise ValueError(f"{specs[1][0]}: give one structured output constraint, not {specs[0][0]} and {specs[1][0]}")
    if specs:
        name, spec = specs[0]
        try:
            given["structured_outputs"] = StructuredOutputsParams.from_any(spec)
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from None


def response_format_spec(value: Any) -> dict[str, Any] | None:
    """OpenAI's ``response_format`` as ``structured_outputs`` fields (None for plain text)."""
    if not isinstance(value, dict):
        raise ValueError(f"response_format must be an object, got {_brief(value)}")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        body = value.get("json_schema")
        if not isinstance(body, dict):
            raise ValueError('response_format: "json_schema" must be an object with the schema under "schema"')
        schema = body.get("schema")
        if not isinstance(schema, dict):
            raise ValueError("response_format: json_schema.schema must be a JSON schema object")
        return {"json": schema}
    raise ValueError(f"response_format: type must be text, json_object or json_schema, got {_brief(kind)}")


def _chat_logprobs(given: dict[str, Any]) -> None:
    """Chat's ``logprobs: true`` + ``top_logprobs: k`` -> ``logprobs=k``, in place."""
    wanted = given.pop("logprobs", False)
    top = given.pop("top_logprobs", None)
    if not isinstance(wanted, bool):
        raise ValueError(f"logprobs must be true or false for chat completions, got {_brief(wanted)}")
    if top is not None and not wanted:
        raise ValueError("top_logprobs: needs logprobs: true")
    if wanted:
        if top is not None and (not isinstance(top, int) or isinstance(top, bool)):
            raise ValueError(f"top_logprobs must be an integer, got {_brief(top)}")
        given["logprobs"] = 0 if top is None else top


def fresh_seed() -> int:
    """A random non-negative 63-bit seed (fits every generator that takes an int64)."""
    return secrets.randbelow(SEED_MAX + 1)


def fresh_seeds(n: int) -> list[int]:
    """``n`` seeds as ``fresh_seed`` draws them, from one read of the OS's randomness."""
    entropy = os.urandom(8 * n)
    return [int.from_bytes(entropy[i:i + 8], "big") >> 1 for i in range(0, 8 * n, 8)]


def with_seed(params: SamplingParams) -> SamplingParams:
    """``params`` with a seed: unseeded requests get a fresh one, recorded with the job, so a
    retry on another worker draws the same samples (irrelevant, and harmless, when greedy)."""
    return params if params.seed is not None else replace(params, seed=fresh_seed())


@dataclass(frozen=True, slots=True)
class WorkRequest:
    """What the engine is handed for one job: a prompt (text or token ids) or messages."""

    prompt: str | list[int] | None
    messages: list[dict[str, Any]] | None
    params: SamplingParams
    priority: int = 1  # the engine's scheduling priority (worker.dispatch.lanes); bulk when unset
    cache_salt: str | None = None  # vLLM's: only requests with the same salt share prefix-cache blocks

    @property
    def prompt_token_ids(self) -> list[int] | None:
        """The prompt when it is token ids (what ``TokenCounter.tokenize_many`` reads)."""
        return self.prompt if isinstance(self.prompt, list) else None


def request_from_row(job: dict[str, Any]) -> WorkRequest:
    """The engine request a claimed job's row describes (``Claim.job``: ``CLAIM_FIELDS``).

    The store holds what the producer validated: the params are rebuilt without checking them
    again (``SamplingParams.from_stored``), and a prompt the producer tokenized goes to the engine
    as its token ids (``prompt_tokens``), so it is not tokenized (or its chat template rendered)
    a second time. Shape, context and vocabulary stay the engine's ``make_request`` checks.
    """
    prompt = job.get("prompt_tokens")
    messages = None
    if prompt is None:
        prompt = job.get("prompt")
        if prompt is None:
            prompt = job.get("prompt_token_ids_in")
        messages = job.get("messages")
        if (prompt is None) == (messages is None):
            raise ValueError("a job needs exactly one of prompt, prompt_token_ids_in or messages")
    params = job.get("params")
    from worker.request.priority import parse_priority

    return WorkRequest(prompt, messages, SamplingParams.from_stored({} if params is None else params),
                       parse_priority(job.get("priority")), job.get("cache_salt"))


def _brief(value: Any) -> str:
    text = repr(value) if not isinstance(value, int) or abs(value) < 10**30 else f"{type(value).__name__} too large"
    return text if len(text) <= 40 else text[:37] + "..."
