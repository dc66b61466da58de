"""The in-process side of a queue benchmark runs with the engine process's OpenMP settings.

The worker's engine child starts with a short OpenMP spin (``engine.process.child_env``: libgomp
reads ``GOMP_SPINCOUNT`` once, when torch loads it). A benchmark process comparing ``LLM`` in
process against the queue must run its own engine the same way, or the two sides differ in more
than the queue: on 2 cores shared with other processes, the default spin made the in-process
side 3-10x slower than the same engine in the worker's child (bench/results/queue-cpu.txt).
"""

from __future__ import annotations

import os
import sys


def run_with_engine_openmp() -> None:
    """Re-execute this process with the engine child's environment unless it has it already."""
    from engine.process import child_env

    env = child_env()
    if all(os.environ.get(k) == v for k, v in env.items()):
        return
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
