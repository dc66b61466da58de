"""Hot loops of the engine: paged attention and KV-cache operations.

Each operation has a plain torch reference (the CPU path, and the definition of what it
computes) and, where Triton runs, a Triton kernel. ``kernel_backend`` picks one for a device;
``SPECBATCH_KERNEL_BACKEND=torch|triton`` overrides the choice.

Dispatchers: ``paged_attention``, ``write_kv`` and ``coupled_sample``, each taking
``backend=``. The Triton kernels live in ``specbatch_kernels._triton_*``
and are imported on first use only, so ``TRITON_INTERPRET=1`` (the CPU interpreter, used by
the tests) takes effect as long as it is set before the first Triton call.
"""

from __future__ import annotations

import os

import torch

from specbatch_kernels.cache_ops import write_kv_torch
from specbatch_kernels.paged_attention import paged_attention_torch
from specbatch_kernels.sampling import coupled_sample_torch

BACKENDS = ("torch", "triton")
TRITON_HINTS = ("max_query_len", "max_context_len", "kv_split_len")
TORCH_HINTS = ("plan_cache",)
TORCH_WRITE_HINTS = ("all_valid",)


def kernel_backend(device: torch.device | str) -> str:
    """``triton`` on CUDA, ``torch`` elsewhere, unless ``SPECBATCH_KERNEL_BACKEND`` says otherwise."""
    forced = os.environ.get("SPECBATCH_KERNEL_BACKEND")
    if forced:
        if forced not in BACKENDS:
            raise ValueError(f"SPECBATCH_KERNEL_BACKEND must be one of {BACKENDS}, got {forced!r}")
        return forced
    return "triton" if torch.device(device).type == "cuda" else "torch"


def _check(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


def paged_attention(*args, backend: str = "torch", **kwargs) -> torch.Tensor:
    """Dispatch to the chosen implementation of paged attention (see ``specbatch_kernels.paged_attention``).

    The Triton-only hints (``max_query_len``, ``max_context_len``, ``kv_split_len``) and the
    torch-only ``plan_cache`` may be passed on any backend; the other one ignores them.
    """
    _check(backend)
    if backend == "triton":
        from specbatch_kernels.paged_attention import paged_attention_triton

        for hint in TORCH_HINTS:
            kwargs.pop(hint, None)
        return paged_attention_triton(*args, **kwargs)
    for hint in TRITON_HINTS:
        kwargs.pop(hint, None)
    return paged_attention_torch(*args, **kwargs)


def write_kv(*args, backend: str = "torch", **kwargs) -> None:
    """Dispatch to the chosen implementation of the KV-cache write (see ``specbatch_kernels.cache_ops``).

    The torch-only hint ``all_valid`` may be passed on any backend (Triton skips padding slots
    in the kernel and ignores it).
    """
    _check(backend)
    if backend == "triton":
        from specbatch_kernels.cache_ops import write_kv_triton

        for hint in TORCH_WRITE_HINTS:
            kwargs.pop(hint, None)
        return write_kv_triton(*args, **kwargs)
    return write_kv_torch(*args, **kwargs)


def coupled_sample(*args, backend: str = "torch", **kwargs) -> torch.Tensor:
    """Dispatch the seeded sampling step (see ``specbatch_kernels.sampling``)."""
    _check(backend)
    if backend == "triton":
        from specbatch_kernels.sampling import coupled_sample_triton

        return coupled_sample_triton(*args, **kwargs)
    return coupled_sample_torch(*args, **kwargs)


__all__ = [
    "BACKENDS",
    "kernel_backend",
    "paged_attention",
    "paged_attention_torch",
    "coupled_sample",
    "coupled_sample_torch",
    "write_kv",
    "write_kv_torch",
]
