"""``SpeculativeConfig``: which proposer runs and how many tokens it may propose per step."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import torch

METHODS = ("ngram", "draft", "suffix")
ACCEPTANCE = ("coupled", "rejection")
MAX_SPEC_TOKENS = 32  # the verifier lays out at most this many draft rows per sequence


def _check_k(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_SPEC_TOKENS:
        raise ValueError(f"{name} must be an integer in 1..{MAX_SPEC_TOKENS} or 'auto', got {value!r}")


@dataclass
class SpeculativeConfig:
    """Speculation settings (vLLM's names where they exist).

    ``num_speculative_tokens``: a fixed k for every sequence, or ``"auto"``: k adapts per sequence
    in ``0..max_speculative_tokens`` from its measured acceptance and the measured step costs, so
    speculation switches itself off where it does not pay (large compute-bound batches).
    """

    method: Literal["ngram", "draft", "suffix"] = "ngram"
    num_speculative_tokens: int | Literal["auto"] = "auto"
    max_speculative_tokens: int = 10  # the ceiling of "auto"
    draft_model: "str | torch.nn.Module | None" = None  # a path/hub id, or a model already loaded
    draft_dtype: str | None = None  # defaults to the target's dtype
    # ngram (prompt lookup): match the last n tokens, n from max down to min.
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 3
    # suffix decoding: bounded-depth suffix index over this run's prompts and outputs.
    suffix_max_depth: int = 24
    suffix_max_cached_tokens: int = 200_000
    suffix_min_token_prob: float = 0.1
    suffix_max_spec_factor: float = 1.0
    # adaptive k: per-sequence acceptance estimate (decayed counts) and the gain k must promise.
    acceptance_decay: float = 0.7
    min_speedup: float = 1.05
    # "coupled": accept a draft iff it equals the token sampled with the request's own noise
    # (output identical to no speculation); "rejection": Leviathan/Chen's accept/resample.
    acceptance: Literal["coupled", "rejection"] = "coupled"

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {METHODS}, got {self.method!r}")
        if self.acceptance not in ACCEPTANCE:
            raise ValueError(f"acceptance must be one of {ACCEPTANCE}, got {self.acceptance!r}")
        if self.num_speculative_tokens != "auto":
            _check_k("num_speculative_tokens", self.num_speculative_tokens)
        _check_k("max_speculative_tokens", self.max_speculative_tokens)
        if self.method == "draft" and self.draft_model is None:
            raise ValueError("method 'draft' needs draft_model (a model with the target's tokenizer)")
        if self.method != "draft" and self.draft_model is not None:
            raise ValueError(f"draft_model is only used by method 'draft', not {self.method!r}")
        for name in ("prompt_lookup_min", "prompt_lookup_max", "suffix_max_depth", "suffix_max_cached_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"prompt_lookup_min ({self.prompt_lookup_min}) must not exceed prompt_lookup_max ({self.prompt_lookup_max})"
            )
        if not 0 <= self.suffix_min_token_prob < 1:
            raise ValueError(f"suffix_min_token_prob must be in [0, 1), got {self.suffix_min_token_prob}")
        if self.suffix_max_spec_factor <= 0:
            raise ValueError(f"suffix_max_spec_factor must be positive, got {self.suffix_max_spec_factor}")
        if not 0 < self.acceptance_decay < 1:
            raise ValueError(f"acceptance_decay must be in (0, 1), got {self.acceptance_decay}")

    @property
    def adaptive(self) -> bool:
        return self.num_speculative_tokens == "auto"

    @property
    def k_max(self) -> int:
        return self.max_speculative_tokens if self.adaptive else int(self.num_speculative_tokens)

    @classmethod
    def from_any(cls, value: "SpeculativeConfig | dict | None") -> "SpeculativeConfig | None":
        """Accept a config, a dict of its fields (JSON, CLI) or None."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, dict):
            unknown = sorted(set(value) - {f.name for f in fields(cls)})
            if unknown:
                raise ValueError(f"unknown speculative_config field(s): {', '.join(unknown)}")
            return cls(**value)
        raise ValueError(f"speculative_config must be a SpeculativeConfig or a dict, got {type(value).__name__}")
