"""Our paged attention, plugged into unmodified transformers models.

The runner flattens a whole step into one ragged sequence (batch dimension 1) and passes a
``PagedMetadata`` through the model's ``**kwargs``; transformers hands it to every attention
layer, which writes the step's new K/V into their slots and attends over each sequence's
blocks through ``specbatch_kernels``. No causal mask is built: the kernels know the layout.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

import specbatch_kernels

ATTN_IMPLEMENTATION = "specbatch_paged"


@dataclass(slots=True)
class PagedMetadata:
    """What every attention layer needs to know about the current flat step."""

    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (k_cache, v_cache)
    slot_mapping: torch.Tensor  # [T] int64
    block_tables: torch.Tensor  # [B, max_blocks] int32
    context_lens: torch.Tensor  # [B] int32, tokens in cache per sequence after this step
    query_start_loc: torch.Tensor  # [B + 1] int32
    backend: str = "torch"
    # Host-side maxima, so a GPU kernel launch never reads them back from the device.
    max_query_len: int = 0
    max_context_len: int = 0
    # True when no slot of ``slot_mapping`` is padding (-1): the torch write skips its check.
    slots_all_valid: bool | None = None
    # Layer-independent attention work (masks, gather indices), built by the first layer.
    plan_cache: dict = field(default_factory=dict)


def paged_attention_flat(
    layer_idx: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: PagedMetadata,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """Write this step's ``k``/``v`` ``[T, Hkv, D]`` into layer ``layer_idx``'s cache and attend.

    ``q[T, H, D]`` → ``[T, H, D]``. Shared by the attention-interface entry below and by the
    fused decoder layers of ``engine.fused_layers``.
    """
    k_cache, v_cache = meta.kv_caches[layer_idx]
    specbatch_kernels.write_kv(k, v, k_cache, v_cache, meta.slot_mapping, backend=meta.backend, all_valid=meta.slots_all_valid)
    return specbatch_kernels.paged_attention(
        q,
        k_cache,
        v_cache,
        meta.block_tables,
        meta.context_lens,
        meta.query_start_loc,
        scale,
        sliding_window,
        backend=meta.backend,
        max_query_len=meta.max_query_len,
        max_context_len=meta.max_context_len,
        plan_cache=meta.plan_cache,
    )


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    specbatch_metadata: PagedMetadata | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention-interface entry: ``query[1, H, T, D]`` → ``[1, T, H, D]``."""
    meta = specbatch_metadata
    if meta is None:
        raise RuntimeError(f"{ATTN_IMPLEMENTATION} attention needs specbatch_metadata")
    q = query[0].transpose(0, 1)
    k = key[0].transpose(0, 1)
    v = value[0].transpose(0, 1)
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    # Mistral passes its window as a keyword; Qwen2 and others keep it on the module.
    window = kwargs.get("sliding_window", getattr(module, "sliding_window", None))
    out = paged_attention_flat(module.layer_idx, q, k, v, meta, scale, window)
    return out[None], None


def _no_mask(*args, **kwargs) -> None:
    return None


AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _no_mask)
