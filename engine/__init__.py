"""specbatch's engine: continuous batching over a paged KV cache with speculative decoding.

Knows nothing of queues or databases; ``worker`` drives it through ``EngineLoop``.

The names below load on first use (PEP 562): a producer that only needs ``SamplingParams``
(``specbatch run`` reading a file) does not pay for importing torch and transformers' models.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_WHERE = {
    "EngineConfig": "engine.config",
    "LLM": "engine.llm",
    "LLMEngine": "engine.llm_engine",
    "EngineDied": "engine.errors",
    "EngineLoop": "engine.loop",
    "RequestHandle": "engine.loop",
    "CompletionOutput": "engine.outputs",
    "RequestMetrics": "engine.outputs",
    "RequestOutput": "engine.outputs",
    "SamplingParams": "engine.sampling_params",
    "SpeculativeConfig": "engine.spec.config",
    "StructuredOutputsParams": "engine.structured.params",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))


if TYPE_CHECKING:  # pragma: no cover
    from engine.config import EngineConfig
    from engine.llm import LLM
    from engine.llm_engine import LLMEngine
    from engine.errors import EngineDied
    from engine.loop import EngineLoop, RequestHandle
    from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
    from engine.sampling_params import SamplingParams
    from engine.spec.config import SpeculativeConfig
    from engine.structured.params import StructuredOutputsParams
