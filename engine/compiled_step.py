"""A compiled CPU decode step: the fused Llama forward through ``torch.compile`` (inductor).

Why: at batch 1 a decode step was 1.39x its weight floor; the rest was norms, rotary, attention
and Python glue run op by op. Inductor fuses the glue into a few C++ loops; the graph calls our
oneDNN-prepacked linears by handle (``specbatch::packed_linear``: a packed weight cannot be a
graph input, and inductor's own packing, freezing, makes graphs it never caches on disk;
``SPECBATCH_COMPILE_WEIGHTS=frozen`` measures that alternative) and our paged attention, a
``torch.library`` op that reads each K/V block once (``specbatch_kernels.cpu_ops``).

Only decode-only steps run compiled (one query token and one sampled row per sequence, as the
CUDA graphs of ``engine.decode_graphs``); their inputs are copied into persistent buffers and one
graph serves every batch size (dynamic; batch 1 runs padded to 2) and any number of KV blocks.
Prefill, chunks, speculative verification, int8 models and non-Llama layers run eagerly; so does
everything after a compile or run fails (the runner logs it once). Inductor's caches live in the
project's cache directory (``<cache>/inductor``), so a later start on the machine reuses them.
"""

from __future__ import annotations

import os
import time
import weakref

import torch
import torch._inductor.config
import torch.nn.functional as F
from torch import nn

from engine.cpu_linear import PackedLinear
from engine.decode_graphs import DecodeGraphs
from engine.fused_layers import FusedDecoderLayer, _rms_norm, _rotate
from specbatch_kernels.cpu_ops import register_packed_linear, release_packed_linear

# Smallest batch the graph runs: batch 1 is padded to 2, since a size-1 dimension would be
# specialised (a second graph, twice the compile time).
MIN_BATCH = 2
_STATIC_ROPE = {"default", "linear", "llama3", "yarn"}  # inv_freq fixed at load (no dynamic update)


def _dense(linear: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """Dense ``(weight, bias)`` of a float linear (``nn.Linear`` or ``PackedLinear``), else None."""
    if not isinstance(linear, (nn.Linear, PackedLinear)):
        return None
    return linear.weight.detach().contiguous(), getattr(linear, "bias", None)


def weights_mode() -> str:
    """``packed`` (default): our prepacked oneDNN weights, called by handle from the graph (the
    graph is cacheable on disk); ``frozen``: dense weights that inductor freezes and packs itself
    (its graphs are never cached: every start compiles). ``SPECBATCH_COMPILE_WEIGHTS`` picks one."""
    mode = os.environ.get("SPECBATCH_COMPILE_WEIGHTS", "packed")
    if mode not in ("packed", "frozen"):
        raise ValueError(f"SPECBATCH_COMPILE_WEIGHTS must be packed or frozen, got {mode!r}")
    return mode


class _Linear(nn.Module):
    """One linear of the compiled graph, optionally adding a residual (as ``_add_linear`` does)."""

    def __init__(self, linear: nn.Module, mode: str, handles: list[int]) -> None:
        super().__init__()
        self.handle: int | None = None
        if mode == "packed" and isinstance(linear, PackedLinear):
            self.handle = register_packed_linear(linear.packed_weight, linear.bias, linear.out_features)
            handles.append(self.handle)
            self.fuse_add = linear.dtype == torch.float32  # exact in fp32 only (PackedLinear.forward_add)
            return
        weight, bias = _dense(linear)
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if self.handle is None:
            out = F.linear(x, self.weight, self.bias)
        elif residual is not None and self.fuse_add:
            return torch.ops.specbatch.packed_linear(x, self.handle, residual)
        else:
            out = torch.ops.specbatch.packed_linear(x, self.handle)
        return out if residual is None else residual + out


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
    def __init__(self, layer: FusedDecoderLayer, mode: str, handles: list[int]) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = layer.num_heads, layer.num_kv_heads, layer.head_dim
        self.scaling, self.window = layer.scaling, int(layer.sliding_window or 0)
        self.intermediate = layer.intermediate_size
        self.in_eps, self.post_eps = layer.input_norm_eps, layer.post_norm_eps
        self.in_norm = nn.Parameter(layer.input_norm_weight.detach(), requires_grad=False)
        self.post_norm = nn.Parameter(layer.post_norm_weight.detach(), requires_grad=False)
        self.qkv_proj = _Linear(layer.qkv_proj, mode, handles)
        self.o_proj = _Linear(layer.o_proj, mode, handles)
        self.gate_up_proj = _Linear(layer.gate_up_proj, mode, handles)
        self.down_proj = _Linear(layer.down_proj, mode, handles)

    def forward(self, x, cos, sin, k_cache, v_cache, slots, tables, ctx):
        b, h, hkv = x.shape[0], self.heads, self.kv_heads
        qkv = self.qkv_proj(_rms_norm(x, self.in_norm, self.in_eps)).view(b, h + 2 * hkv, self.head_dim)
        qk = _rotate(qkv[:, : h + hkv], cos, sin)
        torch.ops.specbatch.write_kv(qk[:, h:], qkv[:, h + hkv :], k_cache, v_cache, slots)
        attended = torch.ops.specbatch.paged_decode_attention(qk[:, :h], k_cache, v_cache, tables, ctx,
                                                              self.scaling, self.window)
        x = self.o_proj(attended.reshape(b, -1), x)
        gate, up = self.gate_up_proj(_rms_norm(x, self.post_norm, self.post_eps)).split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up, x)


class DecodeModule(nn.Module):
    """The decode forward on plain tensors (one token per sequence), built for tracing."""

    def __init__(self, model: nn.Module, mode: str) -> None:
        super().__init__()
        self.handles: list[int] = []  # packed-linear registry entries this module holds
        inner = model.model
        self.embed = inner.embed_tokens
        rotary = inner.rotary_emb
        self.register_buffer("inv_freq", rotary.inv_freq.detach().float().clone(), persistent=False)
        self.rope_scaling = float(rotary.attention_scaling)
        self.layers = nn.ModuleList(_Layer(layer, mode, self.handles) for layer in inner.layers)
        self.norm = inner.norm
        self.head = _Linear(model.get_output_embeddings(), mode, self.handles)

    def forward(self, input_ids, positions, slots, tables, ctx, caches: list[torch.Tensor]) -> torch.Tensor:
        x = self.embed(input_ids)
        # transformers' rotary maths (LlamaRotaryEmbedding.forward), for [B, 1, D] broadcasting.
        freqs = positions[:, None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.rope_scaling).to(x.dtype)[:, None]
        sin = (emb.sin() * self.rope_scaling).to(x.dtype)[:, None]
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, caches[2 * i], caches[2 * i + 1], slots, tables, ctx)
        return self.head(self.norm(x)).float()


def _skip_parameter_guards(entries) -> list[bool]:
    """Keep every dynamo guard but those on the module's parameters (SmolLM2, 30 layers: the
    guard check went from 0.65 to 0.4 ms per step). Parameters are set once and never
    change; the packed-linear handles (plain ints) stay guarded, so a second engine in the
    process, whose handles differ, compiles its own graph instead of running the first one's."""
    return [not (e.guard_type == "TENSOR_MATCH" and isinstance(e.value, nn.Parameter)) for e in entries]


def _release(handles: list[int]) -> None:
    for handle in handles:
        release_packed_linear(handle)


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
    ``DecodeGraphs`` keeps (one graph dynamic in the batch size; batch 1 runs padded to 2)."""

    def __init__(self, runner, max_batch: int, max_context_len: int) -> None:
        super().__init__(runner, max(max_batch, MIN_BATCH), max_context_len, static=True)
        self.mode = weights_mode()
        self.module = DecodeModule(runner.model, self.mode).eval()
        weakref.finalize(self, _release, list(self.module.handles))
        self.caches = [t for pair in runner.kv_caches for t in pair]
        for cache in self.caches:  # the graph serves any number of blocks (one cache entry per model)
            torch._dynamo.mark_dynamic(cache, 0)
        if self.mode == "frozen":
            # Read from the global config when a graph is compiled (the first calls), not from
            # torch.compile's options; no other code of the engine compiles.
            torch._inductor.config.freezing = True
        # Dynamic where marked (batch, cache blocks); heads, head_dim and the rest stay static.
        self.compiled = torch.compile(self.module, options={"guard_filter_fn": _skip_parameter_guards})
        self.warmup_s: float | None = None

    def describe(self) -> str:
        weights = "our packed weights" if self.mode == "packed" else "frozen weights"
        return f"decode compiled (inductor, {weights}) for batch sizes 1..{self.sizes[-1]}"

    def run(self, inputs) -> torch.Tensor:
        """Logits ``[batch, vocab]`` of a decode step; batch 1 runs padded to 2 (one graph for all)."""
        batch = inputs.metadata.context_lens.shape[0]
        size = max(batch, MIN_BATCH)
        self._fill(inputs, batch, size)
        return self._call(size)[:batch]

    def _call(self, size: int) -> torch.Tensor:
        args = (self.input_ids[:size], self.positions[:size], self.slot_mapping[:size],
                self.block_tables[:size], self.context_lens[:size])
        for arg in args:  # fresh views each call: mark their batch dimension symbolic again
            torch._dynamo.mark_dynamic(arg, 0)
        return self.compiled(*args, self.caches)

    @torch.inference_mode()
    def warm_up(self) -> float:
        """Compile the graph ahead of the first step on rows that write and attend to nothing
        (slot -1, context 0); returns the seconds it took (cold: compiling; warm: cache hits)."""
        start = time.perf_counter()
        self.slot_mapping.fill_(-1)
        self.context_lens.zero_()
        self._call(MIN_BATCH)
        self.warmup_s = time.perf_counter() - start
        return self.warmup_s
