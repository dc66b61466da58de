"""Memory accounting on the CPU: what the weights and the KV cache take, and freeing the rest.

Why: on the CPU the process's memory *is* the machine's. Two things used to cost as much as the
model: a fixed 2 GiB KV-cache default whatever the batch needed, and weights held twice (the
checkpoint's mmapped pages stayed mapped behind the fused and prepacked copies, and glibc kept
the freed intermediates). This module sizes the KV cache from the batch and the free memory,
drops the checkpoint mapping, hands freed heap back, and reports the breakdown at start.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from dataclasses import dataclass

import torch
from torch import nn

log = logging.getLogger(__name__)

# A bulk request's typical prompt plus answer, in tokens: the default KV cache holds this many
# for every sequence of a full batch (longer ones still run; the scheduler preempts if needed).
CPU_TOKENS_PER_SEQ = 512
# At most this fraction of the memory available at start goes to a default-sized KV cache.
CPU_KV_MEMORY_FRACTION = 0.5


def available_memory_bytes() -> int | None:
    """Memory the kernel can hand out now without swapping (``MemAvailable``), or None."""
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:
        pass
    return _proc_kib_field("/proc/meminfo", "MemAvailable:")


def default_cpu_kv_blocks(
    bytes_per_block: int, block_size: int, max_num_seqs: int, max_model_len: int, available: int | None
) -> int:
    """Blocks for ``max_num_seqs`` typical sequences (and at least one of ``max_model_len``),
    capped by a fraction of the available memory."""
    per_seq = -(-min(max_model_len, CPU_TOKENS_PER_SEQ) // block_size) + 1
    longest = -(-max_model_len // block_size) + 1
    blocks = max(max_num_seqs * per_seq, longest)
    if available is not None:
        blocks = min(blocks, int(available * CPU_KV_MEMORY_FRACTION) // bytes_per_block)
    return max(blocks, 1)


def tensor_bytes(model: nn.Module) -> int:
    """Bytes of the distinct tensors a model holds: parameters, buffers and prepacked weights."""
    seen: set[int] = set()
    total = 0
    tensors = list(model.parameters()) + list(model.buffers())
    tensors += [t for m in model.modules() for t in vars(m).values() if isinstance(t, torch.Tensor)]
    for t in tensors:
        key = t.data_ptr() if t.layout == torch.strided else id(t)
        if key in seen:
            continue
        seen.add(key)
        total += t.numel() * t.element_size()
    return total


def own_weights(model: nn.Module) -> None:
    """Copy the tensors that still view the checkpoint's memory map into memory of their own.

    After fusing and prepacking, only a few tensors (embeddings, norms) still point into the
    mmapped checkpoint, yet they keep the whole map alive: every page the load touched stays
    resident beside our copies. Owning them unmaps the file.
    """
    for module in model.modules():
        for param in module._parameters.values():
            if param is not None:
                param.data = param.data.clone()
        for name, buf in list(module._buffers.items()):
            if buf is not None:
                module._buffers[name] = buf.clone()
        for name, value in list(vars(module).items()):  # plain tensor attributes (a packed bias)
            if isinstance(value, torch.Tensor) and value.layout == torch.strided:
                setattr(module, name, value.clone())


def release_freed_heap() -> None:
    """Give the heap pages freed while loading back to the OS (glibc keeps them otherwise)."""
    name = ctypes.util.find_library("c")
    if not name:
        return
    try:
        ctypes.CDLL(name).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def resident_bytes() -> int | None:
    """This process's resident set size now."""
    return _proc_kib_field("/proc/self/status", "VmRSS:")


def _proc_kib_field(path: str, key: str) -> int | None:
    """Bytes of a ``key: N kB`` line of a /proc file, or None where there is none."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


@dataclass(frozen=True, slots=True)
class MemoryBreakdown:
    weights_bytes: int
    kv_cache_bytes: int
    num_blocks: int
    block_size: int
    resident_bytes: int | None

    @property
    def other_bytes(self) -> int | None:
        """Everything else resident: the runtime, libraries, tokenizer, allocator slack."""
        if self.resident_bytes is None:
            return None
        return self.resident_bytes - self.weights_bytes - self.kv_cache_bytes

    def describe(self) -> str:
        mb = 1 << 20
        other = "unknown" if self.other_bytes is None else f"{self.other_bytes / mb:.1f} MB"
        return (
            f"memory: weights {self.weights_bytes / mb:.1f} MB, KV cache {self.kv_cache_bytes / mb:.1f} MB "
            f"({self.num_blocks} blocks, {self.num_blocks * self.block_size} tokens), other {other}"
        )


def report(model: nn.Module, num_blocks: int, block_size: int, bytes_per_block: int) -> MemoryBreakdown:
    """The engine's memory at start, logged as one line."""
    breakdown = MemoryBreakdown(tensor_bytes(model), num_blocks * bytes_per_block, num_blocks, block_size, resident_bytes())
    log.info(breakdown.describe())
    return breakdown
