"""KV-cache operations over the engine's paged layout.

Layout (one tensor per layer and per K/V): ``cache[num_blocks, block_size, num_kv_heads, head_dim]``.
A token's *slot* is ``block_id * block_size + offset``; slot ``-1`` marks padding and is skipped.
The torch functions here are the references that define what the Triton kernels must compute.
"""

from __future__ import annotations

import torch


def write_kv_torch(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    all_valid: bool | None = None,
) -> None:
    """Scatter new ``key``/``value`` rows ``[T, kv_heads, head_dim]`` into their slots.

    ``all_valid=True`` says no slot is ``-1`` (the caller knows it for the whole step), which
    spares every layer the check.
    """
    flat_k = k_cache.view(-1, *k_cache.shape[2:])
    flat_v = v_cache.view(-1, *v_cache.shape[2:])
    if all_valid is None:
        all_valid = bool((slot_mapping >= 0).all())
    if all_valid:
        flat_k.index_copy_(0, slot_mapping, key.to(flat_k.dtype))
        flat_v.index_copy_(0, slot_mapping, value.to(flat_v.dtype))
        return
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    flat_k.index_copy_(0, slots, key[valid].to(flat_k.dtype))
    flat_v.index_copy_(0, slots, value[valid].to(flat_v.dtype))


# Triton versions: same semantics as the references above. The kernels live in
# ``specbatch_kernels._triton_cache``, imported on first use (see that module's docstring).


def write_kv_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Triton ``write_kv_torch``: one program per token, padding slots (-1) skipped in-kernel."""
    from specbatch_kernels import _triton_cache

    _triton_cache.write_kv(key, value, k_cache, v_cache, slot_mapping)
