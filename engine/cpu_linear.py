"""Linear layers with prepacked weights, for float32/bfloat16 on the CPU.

``F.linear`` goes through MKL's sgemm, which re-packs the weight matrix on every call; with the
few rows of a decode step that packing dominates (the 49152x576 output head: ~10 ms per call at
one row). So weights are packed once at load time, into one of two layouts:

- ``specbatch::small_linear``'s (``kernels/specbatch_kernels/csrc/small_gemm.cpp``), where our
  CPU ops build (every machine with a C++ compiler): a register-tiled kernel that streams each
  weight once and, for bfloat16 on AVX512_BF16 CPUs, adds k-pairs with ``vdpbf16ps``. oneDNN,
  through torch's ``mkldnn._linear_pointwise``, builds its primitive descriptor on every call
  (~30 us), and at 1-8 rows its kernels streamed the weights at 13-18 GB/s where this one
  reaches 17-26 GB/s. Every SmolLM2 linear once (``bench/linear_kernels.py``, 2-core AMD EPYC,
  AVX512_BF16): bf16 2.0x oneDNN at 1-2 rows, 1.3x at 8, equal at 32-64, 0.85x at 256-1024
  (prefill); fp32 1.7x at 1 row, 1.4x at 8, equal from 256. It is one kernel for every row
  count, whose sums run over k in the same order whatever the rows beside them, so a row's
  result never depends on the batch it is in.
- oneDNN's blocked layout (``mkldnn._reorder_linear_weight``, the prepacking torch.compile's CPU
  backend uses) where the ops do not build.
"""

from __future__ import annotations

import torch
from torch import nn


# Rows the weight layout is tuned for: the prepacked layout serves any row count, and tuning for a
# mid-size batch was the best compromise between decode (1-8 rows) and prefill chunks.
_ROWS_HINT = 64


def small_gemm_available() -> bool:
    """Whether ``specbatch::small_linear`` is loaded (built once per machine into the cache)."""
    from engine.model_hub import cache_dir
    from specbatch_kernels.cpu_ops import load_cpu_ops

    return load_cpu_ops(cache_dir())


class PackedLinear(nn.Module):
    """Drop-in for ``nn.Linear`` in inference, its weight prepacked for ``small_linear`` (or,
    where our ops do not build, for oneDNN)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        weight = linear.weight.detach().contiguous()
        self.dtype = weight.dtype
        self.bias = linear.bias.detach().contiguous() if linear.bias is not None else None
        self.small_weight: torch.Tensor | None = None
        self.packed_weight: torch.Tensor | None = None
        if small_gemm_available():
            self.small_weight = torch.ops.specbatch.pack_small_linear(weight)
        else:
            self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight, _ROWS_HINT)

    @property
    def weight(self) -> torch.Tensor:
        """The dense weight (for code that inspects it, e.g. tied embeddings or a vocab check)."""
        if self.small_weight is None:
            return self.packed_weight.to_dense()
        packed = self.small_weight
        if packed.dim() == 4:  # bfloat16 in k pairs: [blocks, K2, B, 2]
            dense = packed.permute(0, 2, 1, 3).reshape(packed.shape[0] * packed.shape[2], -1)
        else:  # [blocks, K, B]
            dense = packed.permute(0, 2, 1).reshape(packed.shape[0] * packed.shape[2], -1)
        return dense[: self.out_features, : self.in_features].contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.dtype)
        if self.small_weight is not None:
            return torch.ops.specbatch.small_linear(x, self.small_weight, self.out_features, self.bias)
        if not x.is_contiguous():
            x = x.contiguous()
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def forward_add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``residual + self(x)`` in one call where that is exact.

        ``small_linear`` adds the residual itself: in float32 to the unrounded sum, in bfloat16
        after rounding, i.e. exactly the two ops' result in both. oneDNN's binary post-op is
        exact in float32 only (in bfloat16 it would round once where the two ops round twice).
        """
        x = x.to(self.dtype)
        if self.small_weight is not None and residual.dtype == self.dtype:
            return torch.ops.specbatch.small_linear(x, self.small_weight, self.out_features, self.bias, residual)
        if self.small_weight is not None or self.dtype != torch.float32 or residual.dtype != torch.float32 \
                or not residual.is_contiguous():
            return residual + self(x)
        if not x.is_contiguous():
            x = x.contiguous()
        return torch.ops.mkldnn._linear_pointwise.binary(x, residual, self.packed_weight, self.bias, "add")


def onednn_bf16_supported() -> bool:
    """Whether oneDNN has a bfloat16 path on this CPU (AVX-512 BW/VL/DQ or AVX-NE-CONVERT):
    on an AVX2-only CPU its bfloat16 linear raises instead of computing."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``PackedLinear`` takes ``dtype`` here: ``small_linear`` computes float32 and
    bfloat16 on any CPU it builds on; oneDNN float32 anywhere, bfloat16 where it has a path."""
    if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return False
    if small_gemm_available():
        return True
    if not torch.backends.mkldnn.is_available():
        return False
    return dtype == torch.float32 or onednn_bf16_supported()


def pack_linears(model: nn.Module) -> int:
    """Replace every ``nn.Linear`` of ``model`` by a ``PackedLinear``; return how many."""
    targets = [(name, module) for name, module in model.named_modules() if type(module) is nn.Linear]
    for name, module in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, PackedLinear(module))
    return len(targets)
