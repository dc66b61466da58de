"""Triton kernels for paged attention (see ``specbatch_kernels.paged_attention`` for the semantics).

Kept apart from ``specbatch_kernels.paged_attention`` on purpose: ``@triton.jit`` decides between compiled
and interpreted mode (``TRITON_INTERPRET=1``) when the decorator runs, so this module is
imported only when the Triton path is first used, never as a side effect of ``import specbatch_kernels``.

Two kernels plus one reduction:

- ``_decode_kernel``: one query token per sequence. One program handles one (sequence, KV head,
  KV split): the query heads that share the KV head (GQA group, padded to 16 rows for
  ``tl.dot``) read each K/V tile once. Long contexts are cut into splits (flash-decoding) so
  that a small batch still fills the GPU; ``_combine_splits_kernel`` merges the partial results
  by their log-sum-exp.
- ``_varlen_kernel``: several query tokens per sequence (prefill chunks, draft verification).
  One program handles a tile of query tokens times the GQA group of one KV head, causal
  among the new tokens and attending to every cached position before them.

Both walk K/V in tiles of ``BLOCK_N`` token positions, looking each position's block id up in
the block table, so any cache block size works. Softmax runs online in fp32 in base 2.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def _mma(a, b, acc, UPCAST: tl.constexpr):
    """``acc + a @ b`` in fp32.

    ``UPCAST`` computes in exact fp32: used for fp32 inputs (no silent TF32) and on the CPU
    interpreter, whose bf16 ``tl.dot`` returns garbage in triton 3.9.
    """
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _load_kv_tile(
    cache_ptr, block_table_row, pos, pos_mask, kv_head, offs_d, d_mask,
    stride_b, stride_s, stride_h, BLOCK_SIZE: tl.constexpr,
):
    """``[BLOCK_N, D_PAD]`` rows of one KV head at token positions ``pos`` of one sequence."""
    block_id = tl.load(block_table_row + pos // BLOCK_SIZE, mask=pos_mask, other=0).to(tl.int64)
    row = block_id * stride_b + (pos % BLOCK_SIZE) * stride_s + kv_head * stride_h
    return tl.load(
        cache_ptr + row[:, None] + offs_d[None, :],
        mask=pos_mask[:, None] & d_mask[None, :],
        other=0.0,
    )


@triton.jit
def _online_softmax_step(q, k, v, valid, m_i, l_i, acc, scale_log2, UPCAST: tl.constexpr):
    """Fold one K/V tile into the running (max, sum, accumulator) of flash attention.

    Masked scores are ``-inf``; ``m_i`` starts finite (-1e30), so a row with no visible
    position in this tile gets ``p = 0`` rather than NaN.
    """
    s = _mma(q, tl.trans(k), tl.zeros([q.shape[0], k.shape[0]], dtype=tl.float32), UPCAST)
    s = tl.where(valid, s * scale_log2, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = _mma(p.to(v.dtype), v, acc * alpha[:, None], UPCAST)
    return m_new, l_i, acc


@triton.jit
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr, query_start_loc_ptr,
    out_ptr, part_out_ptr, part_lse_ptr,
    scale_log2, split_len, window,
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_bt, stride_ot, stride_oh,
    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, GROUP: tl.constexpr, G_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """One (sequence, KV head, KV split) of a decode step.

    ``SPLIT`` (a bool, so the split count never triggers a recompile) says whether to write
    fp32 partials plus their log-sum-exp for ``_combine_splits_kernel`` or the final output.
    """
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    q_row = tl.load(query_start_loc_ptr + seq)
    if tl.load(query_start_loc_ptr + seq + 1) == q_row:
        return  # a sequence without query tokens this step
    ctx = tl.load(context_lens_ptr + seq)
    lo = tl.where(window > 0, tl.maximum(ctx - window, 0), 0)  # first position in the window
    start = lo + split * split_len
    if start >= ctx:
        return  # this split lies past the sequence's end; the combine step skips it
    end = tl.minimum(start + split_len, ctx)

    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, D_PAD)
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_g
    q = tl.load(
        q_ptr + q_row.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt

    m_i = tl.full([G_PAD], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([G_PAD], dtype=tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        pos_mask = pos < end
        k = _load_kv_tile(k_cache_ptr, table_row, pos, pos_mask, kv_head, offs_d, d_mask,
                          stride_kb, stride_ks, stride_kh, BLOCK_SIZE).to(q.dtype)
        v = _load_kv_tile(v_cache_ptr, table_row, pos, pos_mask, kv_head, offs_d, d_mask,
                          stride_vb, stride_vs, stride_vh, BLOCK_SIZE).to(q.dtype)
        m_i, l_i, acc = _online_softmax_step(q, k, v, pos_mask[None, :], m_i, l_i, acc,
                                             scale_log2, UPCAST)

    mask = g_mask[:, None] & d_mask[None, :]
    if not SPLIT:
        out = acc / l_i[:, None]
        dst = out_ptr + q_row.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        part = seq.to(tl.int64) * stride_pb + heads * stride_ph + split * stride_ps
        tl.store(part_out_ptr + part[:, None] + offs_d[None, :], acc / l_i[:, None], mask=mask)
        lse = (seq.to(tl.int64) * stride_lb + heads * stride_lh + split)
        tl.store(part_lse_ptr + lse, m_i + tl.log2(l_i), mask=g_mask)  # base-2 log-sum-exp


@triton.jit
def _combine_splits_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, context_lens_ptr, query_start_loc_ptr,
    split_len, window,
    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, S_PAD: tl.constexpr,
):
    """Merge one (sequence, head)'s split results, weighting each by ``exp(lse - max lse)``."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    q_row = tl.load(query_start_loc_ptr + seq)
    if tl.load(query_start_loc_ptr + seq + 1) == q_row:
        return
    ctx = tl.load(context_lens_ptr + seq)
    lo = tl.where(window > 0, tl.maximum(ctx - window, 0), 0)  # first position in the window
    num_splits = tl.cdiv(ctx - lo, split_len)  # the splits the decode kernel wrote
    offs_s = tl.arange(0, S_PAD)
    offs_d = tl.arange(0, D_PAD)
    s_mask = offs_s < num_splits
    d_mask = offs_d < HEAD_DIM
    lse = tl.load(part_lse_ptr + seq.to(tl.int64) * stride_lb + head * stride_lh + offs_s,
                  mask=s_mask, other=float("-inf"))
    weight = tl.where(s_mask, tl.exp2(lse - tl.max(lse, axis=0)), 0.0)
    part = seq.to(tl.int64) * stride_pb + head * stride_ph + offs_s * stride_ps
    parts = tl.load(part_out_ptr + part[:, None] + offs_d[None, :],
                    mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    out = tl.sum(parts * weight[:, None], axis=0) / tl.sum(weight, axis=0)
    dst = out_ptr + q_row.to(tl.int64) * stride_ot + head * stride_oh + offs_d
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=d_mask)


@triton.jit
def _varlen_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr, query_start_loc_ptr,
    out_ptr, scale_log2, window,
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_bt, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, GROUP: tl.constexpr, G_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """One (sequence, KV head, tile of BLOCK_Q query tokens) of a prefill/verification step.

    The tile's rows are (token, head in GQA group) pairs, ``BLOCK_Q * G_PAD`` of them, so all
    heads sharing a KV head read each K/V tile once.
    """
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    q_tile = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_tile * BLOCK_Q >= q_len:
        return
    ctx = tl.load(context_lens_ptr + seq)

    BLOCK_M: tl.constexpr = BLOCK_Q * G_PAD
    rows = tl.arange(0, BLOCK_M)
    tok = q_tile * BLOCK_Q + rows // G_PAD
    g = rows % G_PAD
    row_mask = (tok < q_len) & (g < GROUP)
    heads = kv_head * GROUP + g
    offs_d = tl.arange(0, D_PAD)
    d_mask = offs_d < HEAD_DIM
    q_rows = (q_start + tok).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=row_mask[:, None] & d_mask[None, :], other=0.0)
    q_pos = ctx - q_len + tok  # absolute position of each row's token

    first_pos = ctx - q_len + q_tile * BLOCK_Q
    hi = tl.minimum(first_pos + BLOCK_Q, ctx)  # causal: nothing after the tile's last token
    lo = tl.where(window > 0, tl.maximum(first_pos - window + 1, 0), 0)
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt

    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        pos_mask = pos < hi
        k = _load_kv_tile(k_cache_ptr, table_row, pos, pos_mask, kv_head, offs_d, d_mask,
                          stride_kb, stride_ks, stride_kh, BLOCK_SIZE).to(q.dtype)
        v = _load_kv_tile(v_cache_ptr, table_row, pos, pos_mask, kv_head, offs_d, d_mask,
                          stride_vb, stride_vs, stride_vh, BLOCK_SIZE).to(q.dtype)
        valid = pos_mask[None, :] & (pos[None, :] <= q_pos[:, None])
        valid = valid & ((window <= 0) | (pos[None, :] > q_pos[:, None] - window))
        m_i, l_i, acc = _online_softmax_step(q, k, v, valid, m_i, l_i, acc, scale_log2, UPCAST)

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    dst = out_ptr + q_rows[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])


# ---------------------------------------------------------------- host side


def _next_pow2(n: int, at_least: int = 1) -> int:
    return max(at_least, triton.next_power_of_2(n))


_SM_COUNT: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]


def choose_split_len(
    device: torch.device, batch: int, num_kv_heads: int, span: int, block_n: int
) -> int:
    """Tokens per KV split for decode: split only when (batch x KV heads) leaves SMs idle.

    Aims for about two programs per SM, never splits below 256 tokens. On the CPU (the
    interpreter) one split per sequence keeps the number of programs small.
    """
    if device.type != "cuda":
        return max(span, 1)
    programs = batch * num_kv_heads
    splits = min(triton.cdiv(2 * _sm_count(device), programs), triton.cdiv(span, 256))
    splits = max(splits, 1)
    return triton.cdiv(triton.cdiv(span, splits), block_n) * block_n


def _common(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> dict:
    """Compile-time constants and strides shared by both kernels."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not group over {num_kv_heads} KV heads")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k_cache/v_cache need a contiguous last (head_dim) dimension")
    return dict(
        HEAD_DIM=head_dim,
        D_PAD=_next_pow2(head_dim, 16),
        GROUP=num_heads // num_kv_heads,
        BLOCK_SIZE=k_cache.shape[1],
        UPCAST=query.dtype == torch.float32 or query.device.type != "cuda",
    )


def decode(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    block_tables: torch.Tensor, context_lens: torch.Tensor, query_start_loc: torch.Tensor,
    scale: float, window: int, out: torch.Tensor, max_context_len: int,
    split_len: int | None = None, block_n: int = 64,
) -> None:
    """Launch the decode kernel (and the split combine when the context is split)."""
    const = _common(query, k_cache, v_cache)
    batch, num_heads = context_lens.shape[0], query.shape[1]
    num_kv_heads = k_cache.shape[2]
    span = min(max_context_len, window) if window > 0 else max_context_len
    if split_len is None:
        split_len = choose_split_len(query.device, batch, num_kv_heads, span, block_n)
    num_splits = max(triton.cdiv(span, split_len), 1)
    const.update(G_PAD=_next_pow2(const["GROUP"], 16), BLOCK_N=block_n, SPLIT=num_splits > 1)
    if num_splits > 1:
        part_out = torch.empty(batch, num_heads, num_splits, query.shape[2],
                               dtype=torch.float32, device=query.device)
        part_lse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=query.device)
    else:  # never touched: the kernel writes the final output directly
        part_out = part_lse = torch.empty(1, 1, 1, 1, dtype=torch.float32, device=query.device)
    _decode_kernel[(batch, num_kv_heads, num_splits)](
        query, k_cache, v_cache, block_tables, context_lens, query_start_loc,
        out, part_out, part_lse,
        scale * LOG2E, split_len, window,
        query.stride(0), query.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1),
        **const,
    )
    if num_splits > 1:
        _combine_splits_kernel[(batch, num_heads)](
            part_out, part_lse, out, context_lens, query_start_loc,
            split_len, window,
            part_out.stride(0), part_out.stride(1), part_out.stride(2),
            part_lse.stride(0), part_lse.stride(1), out.stride(0), out.stride(1),
            HEAD_DIM=const["HEAD_DIM"], D_PAD=const["D_PAD"], S_PAD=_next_pow2(num_splits),
        )


def varlen(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    block_tables: torch.Tensor, context_lens: torch.Tensor, query_start_loc: torch.Tensor,
    scale: float, window: int, out: torch.Tensor, max_query_len: int,
    block_m: int = 64, block_n: int = 64,
) -> None:
    """Launch the prefill/verification kernel over ``cdiv(max_query_len, BLOCK_Q)`` tiles."""
    const = _common(query, k_cache, v_cache)
    g_pad = _next_pow2(const["GROUP"])
    block_q = max(block_m // g_pad, 16 // g_pad, 1)  # BLOCK_Q * G_PAD >= 16 rows for tl.dot
    const.update(G_PAD=g_pad, BLOCK_Q=block_q, BLOCK_N=block_n)
    batch, num_kv_heads = context_lens.shape[0], k_cache.shape[2]
    _varlen_kernel[(batch, num_kv_heads, triton.cdiv(max_query_len, block_q))](
        query, k_cache, v_cache, block_tables, context_lens, query_start_loc,
        out, scale * LOG2E, window,
        query.stride(0), query.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        **const,
    )
