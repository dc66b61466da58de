"""Leaner decoder layers for the Llama family, swapped into transformers' own model.

transformers' ``LlamaDecoderLayer`` spends about as long in Python and small ops as in its
matrix products when a step holds a few tokens (the long tail of a batch): three projections
where one would do, two for the MLP, RMSNorm as eight ops, rotary embeddings as fourteen, and
transposes to and from the ``[batch, heads, tokens, dim]`` layout our flat step never needs.
``FusedDecoderLayer`` computes the same function from the same weights with one QKV and one
gate-up projection, ``rms_norm`` in one op, rotary applied to query and key heads at once,
and attention straight on the flat ``[tokens, heads, dim]`` layout.

Only layers whose maths is known to be exactly Llama's are swapped (Llama, Mistral, Qwen2:
pre-norm, RMSNorm, rotary, SiLU-gated MLP, optional QKV bias); any other model runs
transformers' code unchanged. The embedding, final norm, rotary table and head stay
transformers' modules.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import PagedMetadata, paged_attention_flat

# Decoder layers whose forward is the Llama one, by class name (model code is per family).
FUSABLE_LAYERS = {"LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer"}
_NORMS = {"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm"}
_ACTIVATIONS = {"silu", "swish"}


def _concat_linears(linears: list[nn.Linear]) -> nn.Linear:
    """One ``nn.Linear`` computing ``linears`` side by side (outputs concatenated)."""
    first = linears[0]
    has_bias = any(lin.bias is not None for lin in linears)
    out_features = sum(lin.out_features for lin in linears)
    # Built on the meta device, then given the concatenated weights: no random init (no time
    # spent on it, and no use of the device's generator).
    fused = nn.Linear(first.in_features, out_features, bias=has_bias, device="meta", dtype=first.weight.dtype)
    with torch.no_grad():
        fused.weight = nn.Parameter(torch.cat([lin.weight for lin in linears]), requires_grad=False)
        if has_bias:
            fused.bias = nn.Parameter(
                torch.cat([lin.bias if lin.bias is not None else lin.weight.new_zeros(lin.out_features) for lin in linears]),
                requires_grad=False)
    return fused.requires_grad_(False)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm: fp32 statistics, cast back, then scale by the weight."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    return weight * F.rms_norm(x.float(), weight.shape, None, eps).to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding (rotate-half convention) of ``x[T, heads, D]`` with ``cos/sin[T, 1, D]``."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class FusedDecoderLayer(nn.Module):
    """A Llama decoder layer over the engine's flat step (batch dimension 1)."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        attn, mlp = layer.self_attn, layer.mlp
        self.layer_idx = attn.layer_idx
        self.head_dim = attn.head_dim
        self.num_heads = attn.q_proj.out_features // attn.head_dim
        self.num_kv_heads = attn.k_proj.out_features // attn.head_dim
        self.scaling = attn.scaling
        self.sliding_window = _sliding_window(layer)
        self.qkv_proj = _concat_linears([attn.q_proj, attn.k_proj, attn.v_proj])
        self.o_proj = attn.o_proj
        self.gate_up_proj = _concat_linears([mlp.gate_proj, mlp.up_proj])
        self.down_proj = mlp.down_proj
        self.intermediate_size = mlp.gate_proj.out_features
        self.input_norm_weight = layer.input_layernorm.weight
        self.input_norm_eps = layer.input_layernorm.variance_epsilon
        self.post_norm_weight = layer.post_attention_layernorm.weight
        self.post_norm_eps = layer.post_attention_layernorm.variance_epsilon

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        specbatch_metadata: PagedMetadata | None = None,
        **kwargs,
    ) -> torch.Tensor:
        if specbatch_metadata is None or position_embeddings is None:
            raise RuntimeError("FusedDecoderLayer runs inside the engine's paged step only")
        x = hidden_states[0]  # [T, hidden]
        t = x.shape[0]
        h = _rms_norm(x, self.input_norm_weight, self.input_norm_eps)
        qkv = self.qkv_proj(h).view(t, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        cos, sin = position_embeddings
        qk = _rotate(qkv[:, : self.num_heads + self.num_kv_heads], cos[0][:, None], sin[0][:, None])
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = qkv[:, self.num_heads + self.num_kv_heads :]
        attended = paged_attention_flat(self.layer_idx, q, k, v, specbatch_metadata, self.scaling, self.sliding_window)
        x = _add_linear(x, self.o_proj, attended.reshape(t, -1))
        h = _rms_norm(x, self.post_norm_weight, self.post_norm_eps)
        gate, up = self.gate_up_proj(h).split(self.intermediate_size, dim=-1)
        x = _add_linear(x, self.down_proj, F.silu(gate) * up)
        return x[None]


def _add_linear(residual: torch.Tensor, linear: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``residual + linear(x)``: one call where the linear can fuse the add (``PackedLinear``)."""
    forward_add = getattr(linear, "forward_add", None)
    if forward_add is not None:
        return forward_add(x, residual)
    return residual + linear(x)


def _sliding_window(layer: nn.Module) -> int | None:
    """Qwen2 keeps the window on the attention module (per layer type); Mistral in its config."""
    attn = layer.self_attn
    if hasattr(attn, "sliding_window"):
        return attn.sliding_window
    if type(layer).__name__ == "MistralDecoderLayer":
        return getattr(attn.config, "sliding_window", None)
    return None


def _fusable(layer: nn.Module) -> bool:
    if type(layer).__name__ not in FUSABLE_LAYERS:
        return False
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if attn is None or mlp is None:
        return False
    linears = [getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
    linears += [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    if any(type(lin) is not nn.Linear for lin in linears):
        return False
    act = getattr(getattr(mlp, "config", None), "hidden_act", None)
    norms = (getattr(layer, "input_layernorm", None), getattr(layer, "post_attention_layernorm", None))
    return act in _ACTIVATIONS and all(type(n).__name__ in _NORMS for n in norms)


def fuse_decoder_layers(model: nn.Module, after: Callable[[nn.Module], object] | None = None) -> int:
    """Swap every fusable decoder layer of ``model`` for a ``FusedDecoderLayer``; return how many.

    ``after`` runs on each new layer as soon as it is made (e.g. prepacking its linears), so one
    layer's intermediate copies are freed before the next is built: loading peaks lower.
    """
    count = 0
    for module in model.modules():
        layers = getattr(module, "layers", None)
        if not isinstance(layers, nn.ModuleList):
            continue
        for i, layer in enumerate(layers):
            if _fusable(layer):
                layers[i] = FusedDecoderLayer(layer)
                if after is not None:
                    after(layers[i])
                count += 1
    return count
