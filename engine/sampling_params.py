"""``SamplingParams``: how one request is sampled and when it stops (vLLM's names).

The one request model: every default and every bound lives here. The batch reader, the client
and the worker build a ``SamplingParams`` and never check a field themselves, so the rules
cannot drift apart between the producer and the worker.
"""

from __future__ import annotations

import math
from dataclasses import MISSING, dataclass, field, fields
from functools import lru_cache
from typing import Any

from engine.structured.params import StructuredOutputsParams

#: A line without a limit may generate this many tokens (clamped to the context left after the
#: prompt). Long enough that a typical answer ends by EOS, bounded so a model stuck in a loop
#: costs at most this much per sample instead of the whole context.
DEFAULT_MAX_TOKENS = 1024
MAX_N = 128  # samples per request (each one holds a sequence slot and its KV blocks)
MAX_TEMPERATURE = 2.0  # OpenAI's bound
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # int64, as OpenAI and vLLM take it
MAX_LOGPROBS = 20  # alternatives per position (OpenAI's top_logprobs bound, vLLM's default max_logprobs)
LOGIT_BIAS_MAX = 100.0  # OpenAI's bound; -100 bans a token and +100 makes it (one of) the only choice(s)


def _check_type(name: str, value: Any, types: tuple[type, ...], allow_none: bool = False) -> None:
    kind = type(value)
    if kind in types and (kind is not float or math.isfinite(value)):  # the common case, first
        return
    if value is None and allow_none:
        return
    if isinstance(value, bool) and bool not in types:
        raise ValueError(f"{name} must be {' or '.join(t.__name__ for t in types)}, got bool {value!r}")
    if not isinstance(value, types):
        raise ValueError(
            f"{name} must be {' or '.join(t.__name__ for t in types)}, got {type(value).__name__} {_short(value)}"
        )
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")


def _short(value: Any, limit: int = 80) -> str:
    """``repr`` cut to ``limit`` characters: errors name a hostile value without echoing 10 MB."""
    try:
        text = repr(value)
    except ValueError:  # an int past Python's digit limit for str()
        return f"<{type(value).__name__} too large to print>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass
class SamplingParams:
    """Per-request sampling and stopping; ``temperature=0`` means greedy.

    Every field is checked at construction, so bad input fails at submission with a
    ``ValueError`` that names the field, never inside the running loop.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int = DEFAULT_MAX_TOKENS
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    # token id -> bias added to its logit before sampling; JSON's string keys are accepted.
    logit_bias: dict[int, float] | None = None
    # What the output must match (JSON schema, regex, choice, EBNF): vLLM's structured_outputs;
    # a dict of its fields is accepted (JSON).
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is None:
            self.stop = []
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if self.top_k is None or self.top_k == -1:
            self.top_k = 0
        _check_type("n", self.n, (int,))
        _check_type("temperature", self.temperature, (int, float))
        _check_type("top_p", self.top_p, (int, float))
        _check_type("top_k", self.top_k, (int,))
        _check_type("min_p", self.min_p, (int, float))
        _check_type("repetition_penalty", self.repetition_penalty, (int, float))
        _check_type("presence_penalty", self.presence_penalty, (int, float))
        _check_type("frequency_penalty", self.frequency_penalty, (int, float))
        _check_type("seed", self.seed, (int,), allow_none=True)
        _check_type("max_tokens", self.max_tokens, (int,))
        _check_type("min_tokens", self.min_tokens, (int,))
        _check_type("ignore_eos", self.ignore_eos, (bool,))
        _check_type("include_stop_str_in_output", self.include_stop_str_in_output, (bool,))
        _check_type("skip_special_tokens", self.skip_special_tokens, (bool,))
        _check_type("logprobs", self.logprobs, (int,), allow_none=True)
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a string or a list of non-empty strings, got {_short(self.stop)}")
        if not isinstance(self.stop_token_ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids
        ):
            raise ValueError(f"stop_token_ids must be a list of token ids, got {_short(self.stop_token_ids)}")
        if not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be in [1, {MAX_N}], got {_short(self.n)}")
        if not 0 <= self.temperature <= MAX_TEMPERATURE:
            raise ValueError(f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {_short(self.temperature)}")
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            raise ValueError(f"seed must be a 64-bit signed integer, got {_short(self.seed)}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {_short(self.top_p)}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be 0 (off), -1 (off) or positive, got {_short(self.top_k)}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {_short(self.min_p)}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be positive, got {_short(self.repetition_penalty)}")
        if not -2 <= self.presence_penalty <= 2:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {_short(self.presence_penalty)}")
        if not -2 <= self.frequency_penalty <= 2:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {_short(self.frequency_penalty)}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {_short(self.max_tokens)}")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be in [0, max_tokens={_short(self.max_tokens)}], got {_short(self.min_tokens)}"
            )
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {_short(self.logprobs)}")
        self.logit_bias = _logit_bias(self.logit_bias)
        self.structured_outputs = StructuredOutputsParams.from_any(self.structured_outputs)

    def check_vocabulary(self, vocab_size: int) -> None:
        """The checks only a model's vocabulary allows (the engine's at submission, the
        producer's at validation with the tokenizer's config): ``logit_bias`` ids inside it,
        and at least one token left to sample. A bias of -100 on every token once "succeeded"
        with the sampler's fallback (token 0 each step) and empty text: nothing but garbage can
        come out of such a line, so it is refused up front."""
        bias = self.logit_bias
        if not bias:
            return
        top = max(bias)
        if top >= vocab_size:
            raise ValueError(f"logit_bias: token id {top} is outside the vocabulary [0, {vocab_size})")
        banned = sum(1 for value in bias.values() if value <= -LOGIT_BIAS_MAX)
        if banned >= vocab_size:
            raise ValueError(f"logit_bias bans every token of the vocabulary ({vocab_size} at -100): "
                             "no token is left to generate")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def needs_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
        )

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "SamplingParams":
        """Build from a JSON-like dict; anything wrong is a ``ValueError`` naming the field."""
        if not isinstance(data, dict):
            raise ValueError(f"sampling params must be an object, got {type(data).__name__}")
        unknown = sorted(str(k)[:40] for k in set(data).difference(_field_names(cls)))
        if unknown:
            raise ValueError(f"unknown sampling parameter(s): {', '.join(unknown)}")
        return cls(**data)

    @classmethod
    def from_stored(cls, data: dict[str, Any]) -> "SamplingParams":
        """Params ``to_dict`` gave and a producer checked before storing them: rebuilt without
        checking each field again (a worker trusts its store), only JSON's forms undone
        (string ``logit_bias`` keys, ``structured_outputs`` as a dict)."""
        if not isinstance(data, dict):
            raise ValueError(f"stored sampling params must be an object, got {type(data).__name__}")
        unknown = sorted(str(k)[:40] for k in set(data).difference(_field_names(cls)))
        if unknown:
            raise ValueError(f"unknown sampling parameter(s) stored: {', '.join(unknown)}")
        params = object.__new__(cls)
        own = params.__dict__
        own.update(_defaults(cls))
        own["stop"], own["stop_token_ids"] = [], []  # fresh lists: the defaults' are shared
        own.update(data)
        if params.logit_bias is not None:
            own["logit_bias"] = {int(k): float(v) for k, v in params.logit_bias.items()} or None
        if params.structured_outputs is not None:
            own["structured_outputs"] = StructuredOutputsParams.from_any(params.structured_outputs)
        return params

    def to_dict(self, *, only_set: bool = False) -> dict[str, Any]:
        """JSON-ready: ``logit_bias`` keys become strings, as JSON stores them anyway, and
        ``structured_outputs`` a dict of its fields. ``only_set``: only the fields that differ
        from their defaults (``from_dict`` gives the same params back), as a stored job keeps
        them: a million rows a third smaller, and as much less for the database to write."""
        if only_set:
            own = self.__dict__
            data = {name: value for name, default, kind in _default_checks(type(self))
                    if (value := own[name]) is not default and (value != default or type(value) is not kind)}
        else:
            data = {name: getattr(self, name) for name in _field_names(type(self))}
        if self.logit_bias is not None:
            data["logit_bias"] = {str(k): v for k, v in self.logit_bias.items()}
        if self.structured_outputs is not None:
            data["structured_outputs"] = self.structured_outputs.to_dict()
        return data


@lru_cache(maxsize=None)
def _field_names(cls: type) -> tuple[str, ...]:
    """The dataclass's field names in order, computed once (``fields()`` per request was a
    measurable share of a million-line ingest)."""
    return tuple(f.name for f in fields(cls))


@lru_cache(maxsize=None)
def _default_checks(cls: type) -> tuple[tuple[str, Any, type], ...]:
    """(name, default, the default's type) per field: ``to_dict(only_set=True)`` runs once per
    line of a bulk file, and a field holding its very default object is skipped by identity."""
    return tuple((name, default, type(default)) for name, default in _defaults(cls).items())


@lru_cache(maxsize=None)
def _defaults(cls: type) -> dict[str, Any]:
    """Each field's default value (a fresh one for those made by a factory)."""
    return {f.name: f.default_factory() if f.default_factory is not MISSING else f.default for f in fields(cls)}


def _logit_bias(value: Any) -> dict[int, float] | None:
    """``{token id: bias}`` with int keys and float values; ``{}`` means none. Keys may be
    decimal strings (JSON objects have string keys); the vocabulary bound is the engine's
    check, as only it knows the vocabulary."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError(f"logit_bias must be an object of token id -> bias, got {type(value).__name__} {_short(value)}")
    out: dict[int, float] = {}
    for key, bias in value.items():
        if isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 12:
            token = int(key)
        elif isinstance(key, int) and not isinstance(key, bool) and key >= 0:
            token = key
        else:
            raise ValueError(f"logit_bias keys must be token ids (non-negative integers), got {_short(key)}")
        _check_type(f"logit_bias[{token}]", bias, (int, float))
        if not -LOGIT_BIAS_MAX <= bias <= LOGIT_BIAS_MAX:
            raise ValueError(f"logit_bias[{token}] must be in [-100, 100], got {_short(bias)}")
        if token in out:
            raise ValueError(f"logit_bias gives token {token} twice")
        out[token] = float(bias)
    return out or None
