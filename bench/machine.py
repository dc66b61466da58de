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


def describe_machine() -> str:
    """One line naming the machine and how loaded it was when the run started (the cores are
    shared, so absolute timings need this beside them)."""
    import os
    import platform

    cpu = "?"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "?")
    except OSError:
        pass
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    return (f"machine: {platform.node()}, {cpu}, {os.cpu_count()} CPUs, torch {torch.__version__} "
            f"({torch.get_num_threads()} threads); load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} "
            f"at {time.strftime('%Y-%m-%d %H:%M:%S')}")
