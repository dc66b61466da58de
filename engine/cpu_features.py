"""What this CPU computes natively, from ``/proc/cpuinfo`` and oneDNN's ISA cap.

Torch-free on purpose: producers and workers, which never load torch, key the result cache by
the dtype an engine on this machine picks for ``auto`` (``auto_dtype_name``), and the engine
picks it with these same functions, so the two can never disagree.
"""

from __future__ import annotations

import functools
import os

#: oneDNN ISA caps (``ONEDNN_MAX_CPU_ISA``) that still include native bf16 instructions.
_BF16_ISA_CAPS = frozenset({"AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX512_CORE_AMX", "AVX512_CORE_AMX_FP16",
                            "AVX10_1_512", "AVX10_1_512_AMX", "AVX10_1_512_AMX_FP16", "AVX10_2_512",
                            "AVX10_2_512_AMX_2", "ALL"})


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (empty where ``/proc/cpuinfo`` cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return frozenset()
    return frozenset(line.partition(":")[2].split())


def native_bf16() -> bool:
    """bfloat16 in hardware (AVX512_BF16 or AMX, the check vLLM's CPU build makes), and oneDNN
    not capped below it. There bf16 linears read half the bytes and ran 1.3-3.3x faster than
    float32 at 1-64 rows (SmolLM2's shapes, 2-core AMD EPYC with AVX512_BF16)."""
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA")
    if cap and cap.upper() not in _BF16_ISA_CAPS:
        return False
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


def has_vnni() -> bool:
    """8-bit dot products in hardware (AVX512_VNNI or AVX_VNNI)."""
    return bool({"avx512_vnni", "avx_vnni"} & cpu_flags())


def auto_dtype_name(device_kind: str, quantization: str | None = None) -> str:
    """The dtype ``auto`` means: bfloat16 on CUDA; on the CPU bfloat16 where it is native,
    float32 elsewhere and under int8 quantization (its kernels take float32 activations)."""
    if device_kind == "cuda":
        return "bfloat16"
    return "bfloat16" if quantization is None and native_bf16() else "float32"
