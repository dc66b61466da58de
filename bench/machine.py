"""Measured ceilings of the machine the benchmark runs on (same process, same moment)."""

from __future__ import annotations

import time

import torch


def matmul_flops(dtype: torch.dtype = torch.float32, n: int = 1536, repeat: int = 10) -> float:
    """Sustained dense matmul FLOP/s."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b
    start = time.perf_counter()
    for _ in range(repeat):
        a @ b
    return 2 * n**3 * repeat / (time.perf_counter() - start)


def memory_bandwidth(num_bytes: int = 256 << 20, repeat: int = 5) -> float:
    """Bytes/s of a large copy (read + write counted)."""
    src = torch.empty(num_bytes // 4, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    dst.copy_(src)
    start = time.perf_counter()
    for _ in range(repeat):
        dst.copy_(src)
    return 2 * num_bytes * repeat / (time.perf_counter() - start)
