"""Engine configuration: the knobs a user sets on ``LLM`` or ``EngineLoop``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from engine.cpu_features import auto_dtype_name

if TYPE_CHECKING:
    from engine.spec.config import SpeculativeConfig

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def parse_dtype(dtype: str | torch.dtype | None, device: torch.device, quantization: str | None = None) -> torch.dtype:
    """The dtype named, or for ``auto`` (None) the one ``engine.cpu_features.auto_dtype_name``
    picks for this machine: bfloat16 on CUDA and on CPUs with native bf16, float32 elsewhere."""
    if dtype is None or dtype == "auto":
        return _DTYPES[auto_dtype_name(device.type, quantization)]
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    return _DTYPES[dtype]


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@dataclass
class EngineConfig:
    """Everything the engine needs to start; defaults suit a CPU and a small model."""

    model: str
    tokenizer: str | None = None
    dtype: str | torch.dtype | None = None
    device: str | torch.device | None = None
    block_size: int = 16
    # KV-cache budget: bytes on any device; on CUDA, when None, a fraction of free memory.
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    # vLLM's scheduling_policy: "fcfs" ignores request priorities; "priority" serves lower
    # priority values first (with aging after priority_aging_steps steps per level), preempts
    # less urgent running requests for more urgent ones, keeps reserved_seqs sequence slots for
    # priority <= 0, and keeps their prefix-cache blocks longer.
    scheduling_policy: str = "fcfs"
    priority_aging_steps: int = 1000
    reserved_seqs: int = 0
    # While urgent (priority <= 0) and background requests both run, this many steps of every
    # urgent_only_steps + 1 leave the background ones out (CPUs: a step's cost grows with its
    # batch; GPUs: keep 0, a bigger decode batch costs almost nothing more).
    urgent_only_steps: int = 0
    # Admission order of waiting requests (engine.waiting_queue): "prefix" tries, among equally
    # urgent ones, the one with the longest cached prefix first (SGLang's LPM); "fifo" keeps
    # the queue order. A request passed over by later arrivals goes in arrival order again after
    # prefix_aging_steps steps. 64: a CPU step takes ~0.05-0.5 s, so the extra wait stays within
    # seconds, a fraction of the hundreds of decode steps a request then runs for, while the
    # requests sharing what the cache holds now get that long to be served before it is evicted.
    admission: str = "prefix"
    prefix_aging_steps: int = 64
    speculative_config: "SpeculativeConfig | dict | None" = None
    trust_remote_code: bool = False
    # Llama-family decoder layers run as engine.fused_layers.FusedDecoderLayer (same maths, fewer
    # ops); False keeps transformers' own layers with our attention plugged in.
    fuse_layers: bool = True
    # Quantization of the linear layers: None (exact, the default) or "int8" (opt-in, CPU; see
    # engine.quantization for the kernel used and why int4 is not offered).
    quantization: str | None = None
    # On CUDA, decode-only steps replay a captured forward (CUDA graphs) for a fixed set of batch
    # sizes; anything else, any capture failure, and every CPU step run eagerly (no CPU capture yet).
    decode_capture: bool = True
    # On the CPU, decode-only steps run a torch.compile'd forward (engine.compiled_step) with
    # paged attention as a C++ op; compiled at start-up (inductor's on-disk cache makes later
    # starts fast). Off by default until measured faster everywhere; any failure falls back to eager.
    compile_step: bool = False
    # Structured output: a grammar not compiled this many seconds after its first request fails
    # the requests waiting on it (engine.structured.compiler says why a limit is needed).
    structured_outputs_timeout_s: float = 10.0
    # Where a request's grammar admits a single continuation, propose its tokens as drafts
    # (ahead of the speculative proposer's, or alone when speculation is off).
    forced_token_drafts: bool = True
    # Set from dtype: True when it was left to "auto" (the runner reports the choice).
    dtype_auto: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        self.device = torch.device(self.device) if self.device is not None else default_device()
        if self.quantization in ("none", ""):
            self.quantization = None
        self.dtype_auto = self.dtype in (None, "auto")  # chosen for this machine (runner.describe says so)
        self.dtype = parse_dtype(self.dtype, self.device, self.quantization)
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}")
        if self.admission not in ("prefix", "fifo"):
            raise ValueError(f"admission must be 'prefix' or 'fifo', got {self.admission!r}")
        if not isinstance(self.reserved_seqs, int) or not 0 <= self.reserved_seqs < self.max_num_seqs:
            raise ValueError(f"reserved_seqs must be an integer in [0, max_num_seqs), got {self.reserved_seqs!r}")
        if not isinstance(self.urgent_only_steps, int) or self.urgent_only_steps < 0:
            raise ValueError(f"urgent_only_steps must be a non-negative integer, got {self.urgent_only_steps!r}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "priority_aging_steps",
                     "prefix_aging_steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError(f"kv_cache_memory_bytes must be positive, got {self.kv_cache_memory_bytes}")
        if self.speculative_config is not None:
            from engine.spec.config import SpeculativeConfig

            self.speculative_config = SpeculativeConfig.from_any(self.speculative_config)
        if self.quantization not in (None, "int8"):
            raise ValueError(f"quantization must be None or 'int8', got {self.quantization!r}")
        if self.quantization is not None and self.device.type != "cpu":
            raise ValueError(f"quantization={self.quantization!r} runs on the CPU only (torch's quantized kernels)")
        if not isinstance(self.structured_outputs_timeout_s, (int, float)) or not self.structured_outputs_timeout_s > 0:
            raise ValueError(f"structured_outputs_timeout_s must be positive, got {self.structured_outputs_timeout_s!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
