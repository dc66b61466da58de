"""Speculative decoding: proposers (ngram, draft model, suffix), the lossless rejection sampler,
adaptive k, and the ``Speculator`` that ties them into the engine's step."""

from engine.spec.config import SpeculativeConfig

__all__ = ["SpeculativeConfig"]
