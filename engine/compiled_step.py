"""A compiled CPU decode step: the fused Llama forward through ``torch.compile`` (inductor).

Why: at batch 1 a decode step was 1.39x its weight floor; the rest was norms, rotary, attention
and Python glue run op by op. Inductor fuses the glue into a few C++ loops; the graph calls our
oneDNN-prepacked linears by handle (``specbatch::packed_linear``: a packed weight cannot be a
graph input, and inductor's own packing, freezing, makes graphs it never caches on disk;
``SPECBATCH_COMPILE_WEIGHTS=frozen`` measures that alternative) and our paged attention, a
``torch.library`` op that reads each K/V block once (``specbatch_kernels.cpu_ops``).

Decode steps and speculative verification run compiled: every step whose every token is sampled,
each token as a decode row of its own (its context ends at its position); their inputs are copied
into persistent buffers and one graph serves every number of rows, 1 included, and any number of
KV blocks (dynamic dimensions traced size-obliviously: no specialisation of a size-1 batch, so batch 1 needs no padding row).
Int8 linears (``engine.quantization``) are called by handle the same way. Prefill, chunks and
non-Llama layers run eagerly; so does
everything after a compile or run fails (the runner logs it once). Inductor's caches live in the
project's cache directory (``<cache>/inductor``), and the graph itself is compiled ahead of time
and saved there (``<cache>/compiled_step``, ``engine.compiled_artifact``), so a later start on the
machine loads it without tracing.
"""

from __future__ import annotations

import functools
import logging
import os
import time
import weakref

import torch
import torch._inductor.config
import torch.nn.functional as F
from torch import nn

from engine import compiled_artifact
from engine.cpu_linear import PackedLinear
from engine.decode_graphs import DecodeGraphs
from engine.fused_layers import FusedDecoderLayer, _rms_norm, _rotate
from engine.quantization import Int8DynamicLinear
from specbatch_kernels.cpu_ops import register_int8_linear, register_packed_linear, release_packed_linear

# Smallest batch the graph is traced at. A backed size-1 dimension would be specialised (a second
# graph, twice the compile time), so tracing is size-oblivious (``_size_oblivious``): batch 1 used
# to run padded to 2, which made its linears read 2 rows (and an int8 step's per-call activation
# scale depend on the padding row).
MIN_BATCH = 1
log = logging.getLogger(__name__)


def _size_oblivious():
    """Trace with size-1 dimensions left symbolic (``backed_size_oblivious``), for this graph only."""
    import torch.fx.experimental._config as fx_config

    return fx_config.patch(backed_size_oblivious=True)
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


def saves_graph() -> bool:
    """Whether the graph is compiled ahead of time and saved (``SPECBATCH_COMPILE_SAVE``, default
    1); 0 traces it at every start from inductor's caches (the path before, kept to compare and
    as a way out should torch's AOT compile misbehave)."""
    value = os.environ.get("SPECBATCH_COMPILE_SAVE", "1")
    if value not in ("0", "1"):
        raise ValueError(f"SPECBATCH_COMPILE_SAVE must be 0 or 1, got {value!r}")
    return value == "1"


class _Linear(nn.Module):
    """One linear of the compiled graph, optionally adding a residual (as ``_add_linear`` does)."""

    def __init__(self, linear: nn.Module, mode: str, handles: list[int]) -> None:
        super().__init__()
        self.handle: int | None = None
        self.small: nn.Parameter | None = None
        if isinstance(linear, Int8DynamicLinear):  # by handle in either mode: it has no dense weight
            self.handle = register_int8_linear(linear.packed_params, linear.reduce_range, linear.out_features)
            handles.append(self.handle)
            self.fuse_add = True  # the op adds after the int8 product, as eager's residual + linear(x)
            return
        if mode == "packed" and isinstance(linear, PackedLinear) and linear.small_weight is not None:
            # Our small-GEMM layout is a plain tensor: a graph input like any weight (cacheable).
            self.small = nn.Parameter(linear.small_weight, requires_grad=False)
            self.bias = None if linear.bias is None else nn.Parameter(linear.bias, requires_grad=False)
            self.out_features = linear.out_features
            return
        if mode == "packed" and isinstance(linear, PackedLinear):
            self.handle = register_packed_linear(linear.packed_weight, linear.bias, linear.out_features)
            handles.append(self.handle)
            self.fuse_add = linear.dtype == torch.float32  # exact in fp32 only (PackedLinear.forward_add)
            return
        weight, bias = _dense(linear)
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if self.small is not None:  # the residual add is exact inside it in both dtypes
            return torch.ops.specbatch.small_linear(x, self.small, self.out_features, self.bias, residual)
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
    if any(_dense(m) is None and not isinstance(m, Int8DynamicLinear)
           for m in [*linears, model.get_output_embeddings()]):
        return "a linear is neither float nor engine.quantization's int8"
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
    ``DecodeGraphs`` keeps (one graph dynamic in the batch size, batch 1 included).

    With our packed weights the graph is compiled ahead of time and saved whole
    (``engine.compiled_artifact``): a later start on the machine loads it without tracing.
    Frozen weights (inductor folds them into the graph), or a graph that cannot be saved, are
    traced by ``torch.compile`` at each start, from inductor's caches."""

    def __init__(self, runner, max_rows: int, max_context_len: int, cache_root: str | os.PathLike) -> None:
        super().__init__(runner, max(max_rows, MIN_BATCH), max_context_len, static=True)
        self.mode = weights_mode()
        self.module = DecodeModule(runner.model, self.mode).eval()
        weakref.finalize(self, _release, list(self.module.handles))
        self.caches = [t for pair in runner.kv_caches for t in pair]
        self.artifact = (compiled_artifact.artifact_path(cache_root, self.module, (self.mode, self._inputs_key()))
                         if self.mode == "packed" and saves_graph() else None)
        self.loaded = False  # whether warm_up found the saved graph
        self.saved = False  # whether this start runs the saved (AOT) graph
        self.compiled = None  # called with the step's tensors; set by warm_up
        self.warmup_s: float | None = None

    def describe(self) -> str:
        weights = "our packed weights" if self.mode == "packed" else "frozen weights"
        how = ("loaded from its saved graph" if self.loaded else "saved for the next start") if self.saved else "traced"
        return f"decode compiled (inductor, {weights}, {how}) for batch sizes 1..{self.sizes[-1]}"

    def can_run(self, inputs) -> bool:
        """Steps that want every token's logits: decode steps and speculative verification. Each
        token then is its sequence's next and runs as a row of its own, attending to its
        sequence's blocks up to its own position: a verification row computes what the decode
        step at that position would, op for op (so speculation stays exact in any dtype)."""
        meta = inputs.metadata
        rows = inputs.input_ids.shape[0]
        return (
            inputs.logits_indices.shape[0] == rows  # ascending within the step: 0..rows-1
            and rows <= self.sizes[-1]
            and meta.block_tables.shape[1] <= self.block_tables.shape[1]
            and meta.max_context_len <= self.max_context_len
        )

    def run(self, inputs) -> torch.Tensor:
        """Logits ``[rows, vocab]`` of a decode or verification step (one graph for every size)."""
        rows = inputs.input_ids.shape[0]
        size = max(rows, MIN_BATCH)
        if inputs.metadata.max_query_len == 1:
            self._fill(inputs, rows, size)
        else:
            self._fill_rows(inputs, rows)
        return self._call(size)[:rows]

    def _fill_rows(self, inputs, rows: int) -> None:
        """A step of several tokens per sequence as one decode row per token."""
        meta = inputs.metadata
        query_lens = meta.query_start_loc.diff()
        width = meta.block_tables.shape[1]
        self.input_ids[:rows].copy_(inputs.input_ids)
        self.positions[:rows].copy_(inputs.positions)
        self.slot_mapping[:rows].copy_(meta.slot_mapping)
        self.context_lens[:rows].copy_(inputs.positions + 1)
        self.block_tables[:rows, :width].copy_(meta.block_tables.repeat_interleave(query_lens, dim=0))

    def _args(self, size: int) -> tuple[torch.Tensor, ...]:
        return (self.input_ids[:size], self.positions[:size], self.slot_mapping[:size],
                self.block_tables[:size], self.context_lens[:size])

    def _inputs_key(self) -> str:
        """The graph's inputs as it bakes them in: dtypes and every size but the dynamic first
        (batch; KV blocks), e.g. the block table's width (the context bound) and the block size."""
        return repr([(str(t.dtype), tuple(t.shape[1:])) for t in (*self._args(MIN_BATCH), *self.caches)])

    def _call(self, size: int) -> torch.Tensor:
        args = self._args(size)
        if self.saved:  # compiled once for every size: no tracing, no guards
            return self.compiled(*args, self.caches)
        for arg in args:  # fresh views each call: mark their batch dimension symbolic again
            torch._dynamo.mark_dynamic(arg, 0)
        with _size_oblivious():  # any (re)trace, the first included, keeps batch 1 symbolic
            return self.compiled(*args, self.caches)

    def _mark_dynamic(self, args=()) -> None:
        """Batch (every input) and KV blocks (every cache) are the graph's dynamic dimensions."""
        for tensor in (*args, *self.caches):
            torch._dynamo.mark_dynamic(tensor, 0)

    def _aot_graph(self):
        """The saved graph for this module, loaded, or compiled now and saved; None when it
        cannot be compiled ahead of time (logged; then it is traced)."""
        saved = compiled_artifact.load(self.artifact, DecodeModule.forward)
        self.loaded = saved is not None
        if saved is None:
            args = self._args(MIN_BATCH)
            self._mark_dynamic(args)
            try:
                saved = compiled_artifact.compile_and_save(DecodeModule.forward, (self.module, *args, self.caches),
                                                           self.artifact, _skip_parameter_guards, _size_oblivious())
            except Exception as exc:
                log.warning("compile_step: the decode step could not be compiled ahead of time (%s: %s); "
                            "it is traced at each start", type(exc).__name__, exc)
                return None
        return functools.partial(saved, self.module)

    @torch.inference_mode()
    def warm_up(self) -> float:
        """Compile (or load) the graph ahead of the first step and run it on rows that write and
        attend to nothing (slot -1, context 0); returns the seconds it took."""
        start = time.perf_counter()
        self.slot_mapping.fill_(-1)
        self.context_lens.zero_()
        self.compiled = self._aot_graph() if self.artifact is not None else None
        self.saved = self.compiled is not None
        if self.compiled is None:
            if self.mode == "frozen":
                # Read from the global config when a graph is compiled (the first calls), not from
                # torch.compile's options; no other code of the engine compiles.
                torch._inductor.config.freezing = True
            self._mark_dynamic()  # the graph serves any number of blocks (one cache entry per model)
            # Dynamic where marked (batch, cache blocks); heads, head_dim and the rest stay static.
            self.compiled = torch.compile(self.module, options={"guard_filter_fn": _skip_parameter_guards})
        self._call(MIN_BATCH)
        self.warmup_s = time.perf_counter() - start
        return self.warmup_s
