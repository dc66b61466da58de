"""A compiled CPU decode step: the fused Llama forward through ``torch.compile`` (inductor).

Why: at batch 1 a decode step was 1.39x its weight floor; the rest was norms, rotary, attention
and Python glue run op by op. Inductor turns the glue into a few fused C++ loops, packs the
weights for oneDNN itself (``freezing``: the weights become graph constants; our own prepacked
tensors cannot enter its graph), and calls our paged attention, a ``torch.library`` op that reads
each K/V block once (``specbatch_kernels.cpu_ops``), as one opaque call per layer.

Only decode-only steps run compiled (one query token and one sampled row per sequence, as the
CUDA graphs of ``engine.decode_graphs``); their inputs are copied into persistent buffers and the
graph is dynamic in the batch size (batch 1 gets its own specialised graph). Prefill, chunks,
speculative verification, int8 models and non-Llama layers run eagerly; so does everything after
a compile or run fails (the runner logs it once). Inductor's caches live in the project's cache
directory (``<cache>/inductor``), so a second start on a machine reuses the compiled code.
"""

from __future__ import annotations

import os
import time

import torch
import torch._inductor.config
import torch.nn.functional as F
from torch import nn

from engine.decode_graphs import DecodeGraphs
from engine.fused_layers import FusedDecoderLayer, _rms_norm, _rotate

_STATIC_ROPE = {"default", "linear", "llama3", "yarn"}  # inv_freq fixed at load (no dynamic update)


def _dense(linear: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """Dense ``(weight, bias)`` of a float linear (``nn.Linear`` or ``PackedLinear``), else None."""
    if type(linear).__name__ not in ("Linear", "PackedLinear"):
        return None
    return linear.weight.detach().contiguous(), getattr(linear, "bias", None)


def unsupported_reason(model: nn.Module, device: torch.device) -> str | None:
    """Why ``model`` cannot take the compiled step, or None when it can."""
    if device.type != "cpu":
        return "compiled step is CPU-only (CUDA uses decode_capture)"
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None or not all(isinstance(layer, FusedDecoderLayer) for layer in layers):
        return "needs every decoder layer fused (Llama family, fuse_layers=True)"
    if getattr(getattr(inner, "rotary_emb", None), "rope_type", None) not in _STATIC_ROPE:
        return "rotary type updates its frequencies at run time"
    linears = [m for layer in layers for m in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)]
    if any(_dense(m) is None for m in [*linears, model.get_output_embeddings()]):
        return "quantized linears are not compiled"
    return None


class _Layer(nn.Module):
    def __init__(self, layer: FusedDecoderLayer) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = layer.num_heads, layer.num_kv_heads, layer.head_dim
        self.scaling, self.window = layer.scaling, int(layer.sliding_window or 0)
        self.intermediate = layer.intermediate_size
        self.in_eps, self.post_eps = layer.input_norm_eps, layer.post_norm_eps
        self.in_norm = nn.Parameter(layer.input_norm_weight.detach(), requires_grad=False)
        self.post_norm = nn.Parameter(layer.post_norm_weight.detach(), requires_grad=False)
        for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            weight, bias = _dense(getattr(layer, name))
            self.register_parameter(f"{name}_w", nn.Parameter(weight, requires_grad=False))
            self.register_parameter(f"{name}_b", None if bias is None else nn.Parameter(bias, requires_grad=False))

    def forward(self, x, cos, sin, k_cache, v_cache, slots, tables, ctx):
        b, h, hkv = x.shape[0], self.heads, self.kv_heads
        qkv = F.linear(_rms_norm(x, self.in_norm, self.in_eps), self.qkv_proj_w, self.qkv_proj_b)
        qkv = qkv.view(b, h + 2 * hkv, self.head_dim)
        qk = _rotate(qkv[:, : h + hkv], cos, sin)
        torch.ops.specbatch.write_kv(qk[:, h:], qkv[:, h + hkv :], k_cache, v_cache, slots)
        attended = torch.ops.specbatch.paged_decode_attention(qk[:, :h], k_cache, v_cache, tables, ctx,
                                                              self.scaling, self.window)
        x = x + F.linear(attended.reshape(b, -1), self.o_proj_w, self.o_proj_b)
        gate, up = F.linear(_rms_norm(x, self.post_norm, self.post_eps), self.gate_up_proj_w,
                            self.gate_up_proj_b).split(self.intermediate, dim=-1)
        return x + F.linear(F.silu(gate) * up, self.down_proj_w, self.down_proj_b)


class DecodeModule(nn.Module):
    """The decode forward on plain tensors (one token per sequence), built for tracing."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        inner = model.model
        self.embed = inner.embed_tokens
        rotary = inner.rotary_emb
        self.register_buffer("inv_freq", rotary.inv_freq.detach().float().clone(), persistent=False)
        self.rope_scaling = float(rotary.attention_scaling)
        self.layers = nn.ModuleList(_Layer(layer) for layer in inner.layers)
        self.norm = inner.norm
        head_w, head_b = _dense(model.get_output_embeddings())
        self.head_w = nn.Parameter(head_w, requires_grad=False)
        self.head_b = None if head_b is None else nn.Parameter(head_b, requires_grad=False)

    def forward(self, input_ids, positions, slots, tables, ctx, caches: list[torch.Tensor]) -> torch.Tensor:
        x = self.embed(input_ids)
        # transformers' rotary maths (LlamaRotaryEmbedding.forward), for [B, 1, D] broadcasting.
        freqs = positions[:, None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.rope_scaling).to(x.dtype)[:, None]
        sin = (emb.sin() * self.rope_scaling).to(x.dtype)[:, None]
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, caches[2 * i], caches[2 * i + 1], slots, tables, ctx)
        return F.linear(self.norm(x), self.head_w, self.head_b).float()


def use_cache_dir(root: str | os.PathLike) -> str:
    """Point inductor's on-disk caches (FX graphs, compiled C++, autotuning) at ``root``/inductor,
    unless ``TORCHINDUCTOR_CACHE_DIR`` already names a folder."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    path = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if path is None or path == default_cache_dir():  # inductor writes its default there itself
        path = os.path.join(str(root), "inductor")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = path
    os.makedirs(path, exist_ok=True)
    return path


class CompiledDecode(DecodeGraphs):
    """Decode-only steps through the compiled ``DecodeModule`` over the persistent buffers that
    ``DecodeGraphs`` keeps (no padding: the graph is dynamic in the batch size)."""

    def __init__(self, runner, max_batch: int, max_context_len: int) -> None:
        super().__init__(runner, max_batch, max_context_len, static=True)
        self.module = DecodeModule(runner.model).eval()
        self.caches = [t for pair in runner.kv_caches for t in pair]
        # Freezing is read from the global config when the graph is compiled (the first calls),
        # not from torch.compile's options; no other code of the engine compiles.
        torch._inductor.config.freezing = True
        # Automatic dynamic shapes: batch 1 compiles specialised, batch 2 marks the batch
        # dimension dynamic (the caches and block tables keep their static shapes).
        self.compiled = torch.compile(self.module, dynamic=None)
        self.warmup_s: float | None = None

    def describe(self) -> str:
        return f"decode compiled (inductor, freezing) for batch sizes 1..{self.sizes[-1]}"

    def run(self, inputs) -> torch.Tensor:
        batch = inputs.metadata.context_lens.shape[0]
        self._fill(inputs, batch, batch)
        return self._call(batch)

    def _call(self, batch: int) -> torch.Tensor:
        return self.compiled(self.input_ids[:batch], self.positions[:batch], self.slot_mapping[:batch],
                             self.block_tables[:batch], self.context_lens[:batch], self.caches)

    @torch.inference_mode()
    def warm_up(self, batches: tuple[int, ...] = (1, 2)) -> float:
        """Compile the graphs ahead of the first step on rows that write and attend to nothing
        (slot -1, context 0); returns the seconds it took (cold: compiling; warm: cache hits)."""
        start = time.perf_counter()
        self.slot_mapping.fill_(-1)
        self.context_lens.zero_()
        for batch in batches:
            if batch <= self.sizes[-1]:
                self._call(batch)
        self.warmup_s = time.perf_counter() - start
        return self.warmup_s
