"""Triton kernels for the KV-cache operations (see ``specbatch_kernels.cache_ops`` for the semantics).

Imported lazily, like ``specbatch_kernels._triton_attention``, so that ``TRITON_INTERPRET`` is read when
the Triton path is first used rather than at ``import specbatch_kernels``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _row_offsets(stride_h, H: tl.constexpr, H_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr):
    """Offsets and mask of one token's ``[kv_heads, head_dim]`` row (head_dim contiguous)."""
    offs_h = tl.arange(0, H_PAD)
    offs_d = tl.arange(0, D_PAD)
    mask = (offs_h[:, None] < H) & (offs_d[None, :] < D)
    return offs_h[:, None] * stride_h + offs_d[None, :], mask


@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    BLOCK_SIZE: tl.constexpr, H: tl.constexpr, H_PAD: tl.constexpr,
    D: tl.constexpr, D_PAD: tl.constexpr,
):
    """One program per new token: copy its K and V rows into the cache slot (skip slot -1)."""
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block, offset = slot // BLOCK_SIZE, slot % BLOCK_SIZE
    src_k, mask = _row_offsets(stride_kh, H, H_PAD, D, D_PAD)
    src_v, _ = _row_offsets(stride_vh, H, H_PAD, D, D_PAD)
    dst_k, _ = _row_offsets(stride_kch, H, H_PAD, D, D_PAD)
    dst_v, _ = _row_offsets(stride_vch, H, H_PAD, D, D_PAD)
    k = tl.load(key_ptr + token.to(tl.int64) * stride_kt + src_k, mask=mask)
    v = tl.load(value_ptr + token.to(tl.int64) * stride_vt + src_v, mask=mask)
    k_row = k_cache_ptr + block * stride_kcb + offset * stride_kcs
    v_row = v_cache_ptr + block * stride_vcb + offset * stride_vcs
    tl.store(k_row + dst_k, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_row + dst_v, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------- host side


def _row_consts(cache: torch.Tensor) -> dict:
    num_heads, head_dim = cache.shape[2], cache.shape[3]
    return dict(
        BLOCK_SIZE=cache.shape[1],
        H=num_heads,
        H_PAD=triton.next_power_of_2(num_heads),
        D=head_dim,
        D_PAD=triton.next_power_of_2(head_dim),
    )


def _last_dim_contiguous(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.stride(-1) != 1:
            raise ValueError("KV tensors need a contiguous last (head_dim) dimension")


def write_kv(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    key = key if key.stride(-1) == 1 else key.contiguous()
    value = value if value.stride(-1) == 1 else value.contiguous()
    _last_dim_contiguous(k_cache, v_cache)
    if key.shape[0] == 0:
        return
    _write_kv_kernel[(key.shape[0],)](
        key, value, k_cache, v_cache, slot_mapping.contiguous(),
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        **_row_consts(k_cache),
    )
