"""Paged attention over the engine's KV-cache layout.

One call covers a whole flat step: decode (one query token per sequence), prefill chunks and
speculative verification (several query tokens per sequence, causal among themselves, attending
to everything already cached). Inputs:

- ``query[T, num_heads, head_dim]``: the step's query tokens, sequence after sequence;
- ``k_cache/v_cache[num_blocks, block_size, num_kv_heads, head_dim]``: already holding this step's K/V;
- ``block_tables[B, max_blocks]`` (int32; unused entries may hold any valid block id);
- ``context_lens[B]``: tokens in the cache for each sequence *including* this step's;
- ``query_start_loc[B + 1]``: prefix sums of the query lengths (``cu_seqlens_q``);
- query token ``i`` of a sequence with ``q`` query tokens sits at position ``context_len - q + i``
  and sees cached positions ``<=`` its own (and ``> position - sliding_window`` when one is set).

``paged_attention_torch`` is the reference and the CPU path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _gather(cache: torch.Tensor, block_tables: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """``[B, kv_heads, num_blocks * block_size, head_dim]`` from each row's first blocks.

    ``index_select`` on the flattened cache copies whole blocks; advanced indexing is ~100x slower
    on the CPU.
    """
    b = block_tables.shape[0]
    n, bs, h, d = cache.shape
    idx = block_tables[:, :num_blocks].reshape(-1).long()
    blocks = cache.view(n, -1).index_select(0, idx)
    return blocks.view(b, num_blocks * bs, h, d).transpose(1, 2)


def _allowed(
    q_pos: torch.Tensor, kv_len: int, ctx: torch.Tensor, sliding_window: int | None
) -> torch.Tensor:
    """Boolean mask ``[B, q, kv_len]``: kv position j is visible to a query at ``q_pos``."""
    kv_pos = torch.arange(kv_len, device=q_pos.device)
    mask = (kv_pos[None, None, :] <= q_pos[:, :, None]) & (kv_pos[None, None, :] < ctx[:, None, None])
    if sliding_window is not None:
        mask &= kv_pos[None, None, :] > q_pos[:, :, None] - sliding_window
    return mask


def _attend_grouped(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """Grouped-query attention without repeating K/V.

    q ``[B, q, H, D]``, k/v ``[B, Hkv, L, D]``, mask ``[B, q, L]`` → ``[B, q, H, D]``. The ``H / Hkv``
    query heads that share a KV head are folded into the query-length axis, so one SDPA call per
    KV head serves them all (query head h reads KV head ``h // (H / Hkv)``, as transformers' repeat_kv).
    """
    b, n, h, d = q.shape
    hkv = k.shape[1]
    g = h // hkv
    qg = q.view(b, n, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(b, hkv, g * n, d)
    m = mask[:, None, None].expand(b, 1, g, n, mask.shape[-1]).reshape(b, 1, g * n, mask.shape[-1])
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=m, scale=scale)
    return out.view(b, hkv, g, n, d).permute(0, 3, 1, 2, 4).reshape(b, n, h, d)


# Sequences with at most this many query tokens (decode, speculative verification) are attended
# in padded batches; longer ones (prefill chunks) one by one, so they never pad the short ones.
MAX_BATCHED_QUERY = 33


def _attend_batch(
    out: torch.Tensor,
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seqs: list[int],
    starts: list[int],
    q_lens: list[int],
    ctx_list: list[int],
    scale: float,
    sliding_window: int | None,
) -> None:
    """One padded SDPA call for ``seqs``; query rows past a sequence's length are discarded."""
    device = query.device
    block_size = k_cache.shape[1]
    idx = torch.tensor(seqs, device=device)
    n = torch.tensor([q_lens[i] for i in seqs], device=device)
    ctx = torch.tensor([ctx_list[i] for i in seqs], device=device)
    q_max = int(n.max())
    nb = (max(ctx_list[i] for i in seqs) + block_size - 1) // block_size
    tables = block_tables.index_select(0, idx)
    k = _gather(k_cache, tables, nb).to(query.dtype)
    v = _gather(v_cache, tables, nb).to(query.dtype)
    j = torch.minimum(torch.arange(q_max, device=device)[None, :], (n - 1)[:, None])  # [B, q_max]
    rows = torch.tensor([starts[i] for i in seqs], device=device)[:, None] + j
    q = query[rows.reshape(-1)].view(len(seqs), q_max, *query.shape[1:])
    mask = _allowed(ctx[:, None] - n[:, None] + j, k.shape[2], ctx, sliding_window)
    attended = _attend_grouped(q, k, v, mask, scale)
    if q_max == 1:
        out.index_copy_(0, rows[:, 0], attended[:, 0])
    else:
        valid = torch.arange(q_max, device=device)[None, :] < n[:, None]
        out[rows[valid]] = attended[valid]


def paged_attention_torch(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Reference paged attention; returns ``[T, num_heads, head_dim]`` in ``query``'s dtype.

    Sequences with one query token are batched into one padded SDPA call (the decode case
    dominates a running batch), and so are those with 2..``MAX_BATCHED_QUERY`` (speculative
    verification: one call instead of one per sequence per layer); each longer sequence is
    attended on its own so that a long prefill chunk never pads the decodes.
    """
    out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    ctx_list = context_lens.tolist()
    q_lens = [starts[i + 1] - starts[i] for i in range(len(ctx_list))]
    single = [i for i, n in enumerate(q_lens) if n == 1]
    short = [i for i, n in enumerate(q_lens) if 1 < n <= MAX_BATCHED_QUERY]
    long = [[i] for i, n in enumerate(q_lens) if n > MAX_BATCHED_QUERY]
    for group in (single, short, *long):
        if group:
            _attend_batch(out, query, k_cache, v_cache, block_tables, group, starts, q_lens, ctx_list, scale, sliding_window)
    return out


def paged_attention_triton(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    *,
    max_query_len: int | None = None,
    max_context_len: int | None = None,
    kv_split_len: int | None = None,
) -> torch.Tensor:
    """Triton paged attention with the semantics of ``paged_attention_torch``.

    A step whose sequences all have one query token runs the split-KV decode kernel; any other
    step runs the varlen kernel. ``max_query_len``/``max_context_len`` are host-side maxima of
    the step; pass them (the scheduler knows them) to spare a device-to-host sync each.
    ``kv_split_len`` forces the decode split size (tokens per split; default: a heuristic that
    fills the GPU's SMs).

    All index tensors are read through pointers: any integer dtype works, but they must be on
    ``query``'s device; non-contiguous ones are copied first.
    """
    from kernels import _triton_attention as ta  # lazy: see the module docstring

    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    batch = context_lens.shape[0]
    if query.shape[0] == 0 or batch == 0:
        return out
    query = query if query.stride(-1) == 1 else query.contiguous()
    block_tables = block_tables.contiguous()
    context_lens = context_lens.contiguous()
    query_start_loc = query_start_loc.contiguous()
    window = int(sliding_window) if sliding_window is not None else 0
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    args = (query, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale, window, out)
    if max_query_len <= 1:
        if max_context_len is None:
            max_context_len = int(context_lens.max())
        ta.decode(*args, max_context_len=max_context_len, split_len=kv_split_len)
    else:
        ta.varlen(*args, max_query_len=max_query_len)
    return out
