"""Opt-in int8 linear layers for the CPU, on torch's own quantized kernels (no GEMM of ours).

Why this kernel: decode at small batch reads every weight once per step, so 4x fewer weight
bytes is the lever. Measured on this project's 2-core AVX-512 CPU (one thread, one row), torch's
weight-only ``aten._weight_int8pack_mm`` was 4-6x *slower* than the fp32 oneDNN linear, and
``aten._weight_int4pack_mm_for_cpu`` about 10x slower; ``quantized::linear_dynamic`` (the
kernel behind ``torch.ao`` dynamic quantization: fbgemm/oneDNN, int8 weights, activations
quantized per call) was 2-5x *faster* (the 49152x576 head: 1.2 ms vs 6.8 ms). So ``int8`` here
means int8 weights, per output channel, symmetric, with activations quantized on the fly to
8 bits per call; the exact fp32/bf16 path stays the default.

MLP down projections stay in float (prepacked, exact): their input (SiLU(gate) * up) has outlier
channels that one 8-bit activation scale per call cannot hold. Measured on SmolLM2-135M (mean
token log-likelihood of bench/int8.py's held-out text, teacher-forced prefill): every linear int8
-19.2% vs fp32; all but down_proj -2.3%; all but down_proj and o_proj -1.8%.

Caveat (measured and reported in bench/results/int8-cpu.txt): the activation scale is per call,
i.e. shared by the rows of a step, so an int8 request's output may depend on what it is batched
with; fp32 has no such coupling.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from engine.cpu_features import has_vnni

QUANTIZATIONS = ("int8",)
# Linears kept in float, by the last part of their module name (see the module docstring).
KEEP_FLOAT = ("down_proj",)


def int8_available() -> bool:
    return "fbgemm" in torch.backends.quantized.supported_engines or "x86" in torch.backends.quantized.supported_engines


class Int8DynamicLinear(nn.Module):
    """``nn.Linear`` with int8 per-channel weights run by ``quantized::linear_dynamic``."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        weight = linear.weight.detach().float()
        scales = (weight.abs().amax(dim=1) / 127.0).clamp_min(1e-12).double()
        zero_points = torch.zeros(weight.shape[0], dtype=torch.int64)
        bias = linear.bias.detach().float() if linear.bias is not None else None
        with warnings.catch_warnings():  # torch flags quantized tensor creation as deprecated
            warnings.simplefilter("ignore")
            qweight = torch.quantize_per_channel(weight, scales, zero_points, 0, torch.qint8)
            self._packed = torch.ops.quantized.linear_prepack(qweight, bias)
        # 7-bit activations (reduce_range) keep fbgemm's u8*s8 pair sums clear of int16
        # saturation on CPUs without VNNI; with VNNI there is no saturation to avoid.
        self.reduce_range = not has_vnni()

    @property
    def packed_params(self) -> torch.ScriptObject:
        """The prepacked int8 weight and bias (what the compiled step registers by handle)."""
        return self._packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).float()
        if not x2.is_contiguous():
            x2 = x2.contiguous()
        out = torch.ops.quantized.linear_dynamic(x2, self._packed, self.reduce_range)
        return out.view(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per-channel"


def quantize_linears(model: nn.Module, method: str = "int8", keep_float: tuple[str, ...] = KEEP_FLOAT) -> int:
    """Replace each ``nn.Linear`` of ``model`` by its int8 version, except those named in
    ``keep_float``; return how many were replaced."""
    if method not in QUANTIZATIONS:
        raise ValueError(f"quantization {method!r} is not supported; choose one of {QUANTIZATIONS}")
    targets = [
        (name, module)
        for name, module in model.named_modules()
        if type(module) is nn.Linear and name.rpartition(".")[2] not in keep_float
    ]
    for name, module in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, Int8DynamicLinear(module))
    return len(targets)
