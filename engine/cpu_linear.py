"""Linear layers with oneDNN-prepacked weights, for float32/bfloat16 on the CPU.

``F.linear`` goes through MKL's sgemm, which re-packs the weight matrix on every call; with the
few rows of a decode step that packing dominates (the 49152x576 output head: ~10 ms per call at
one row, ~15 ms at eight). Reordering the weight once at load time into oneDNN's blocked layout
(``mkldnn._reorder_linear_weight``, the prepacking torch.compile's CPU backend uses) and calling
``mkldnn._linear_pointwise`` on plain dense activations makes the head 2-3x cheaper and every
layer's projections 1.5-2x cheaper at 1-64 rows (measured on this project's 2-core AVX-512 CPU),
with the same maths. Activations stay dense: no ``to_mkldnn``/``to_dense`` round trip per call.
"""

from __future__ import annotations

import torch
from torch import nn


# Rows the weight layout is tuned for: the prepacked layout serves any row count, and tuning for a
# mid-size batch was the best compromise between decode (1-8 rows) and prefill chunks.
_ROWS_HINT = 64


class PackedLinear(nn.Module):
    """Drop-in for ``nn.Linear`` in inference: the weight is a prepacked oneDNN tensor."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        weight = linear.weight.detach()
        self.dtype = weight.dtype
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), _ROWS_HINT)
        self.bias = linear.bias.detach().contiguous() if linear.bias is not None else None

    @property
    def weight(self) -> torch.Tensor:
        """The dense weight (for code that inspects it, e.g. tied embeddings or a vocab check)."""
        return self.packed_weight.to_dense()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.dtype)
        if not x.is_contiguous():
            x = x.contiguous()
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def forward_add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``residual + self(x)`` in one oneDNN call (a binary post-op) where that is exact.

        In float32 oneDNN adds ``residual`` to the finished float32 product, the very sum the two
        ops compute (bit for bit, tested); in bfloat16 the fused add would round once where the
        two ops round twice, so bfloat16 keeps them apart.
        """
        if self.dtype != torch.float32 or residual.dtype != torch.float32 or not residual.is_contiguous():
            return residual + self(x)
        if not x.is_contiguous():
            x = x.contiguous()
        return torch.ops.mkldnn._linear_pointwise.binary(x, residual, self.packed_weight, self.bias, "add")


def onednn_bf16_supported() -> bool:
    """Whether oneDNN has a bfloat16 path on this CPU (AVX-512 BW/VL/DQ or AVX-NE-CONVERT):
    on an AVX2-only CPU its bfloat16 linear raises instead of computing."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and onednn_bf16_supported())


def pack_linears(model: nn.Module) -> int:
    """Replace every ``nn.Linear`` of ``model`` by a ``PackedLinear``; return how many."""
    targets = [(name, module) for name, module in model.named_modules() if type(module) is nn.Linear]
    for name, module in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, PackedLinear(module))
    return len(targets)
