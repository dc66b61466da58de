"""specbatch's engine: continuous batching over a paged KV cache with speculative decoding.

Knows nothing of queues or databases; ``worker`` drives it through ``EngineLoop``.
"""

from engine.config import EngineConfig
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.loop import EngineDied, EngineLoop, RequestHandle
from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from engine.sampling_params import SamplingParams
from engine.spec.config import SpeculativeConfig
from engine.structured.params import StructuredOutputsParams

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "EngineDied",
    "EngineLoop",
    "LLMEngine",
    "RequestHandle",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParams",
    "SpeculativeConfig",
    "StructuredOutputsParams",
]
