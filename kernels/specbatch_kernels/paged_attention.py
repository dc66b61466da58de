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

import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F


class _Workspace(threading.local):
    """Per-thread scratch buffers for the gathered K/V, reused by every layer of every step.

    A fresh multi-megabyte tensor per gather is mmapped and page-faulted anew on each call (at
    batch 64 that made the copy 6x slower than the copy itself); a reused buffer is not.
    """

    def __init__(self) -> None:
        self.buffers: dict[tuple, torch.Tensor] = {}

    def get(self, name: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        # A buffer made under inference mode cannot be written outside it (and vice versa).
        key = (name, dtype, device, torch.is_inference_mode_enabled())
        buf = self.buffers.get(key)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(max(numel, 2 * (buf.numel() if buf is not None else 0)), dtype=dtype, device=device)
            self.buffers[key] = buf
        return buf[:numel]


_workspace = _Workspace()


def _gather(cache: torch.Tensor, block_ids: torch.Tensor, batch: int, name: str) -> torch.Tensor:
    """``[B, kv_heads, num_blocks * block_size, head_dim]`` from flat block ids ``[B * num_blocks]``.

    ``index_select`` on the flattened cache copies whole blocks; advanced indexing is ~100x slower
    on the CPU. The result lives in a reused per-thread buffer (valid until the next gather).
    """
    n, bs, h, d = cache.shape
    flat = cache.view(n, -1)
    out = _workspace.get(name, block_ids.numel() * flat.shape[1], cache.dtype, cache.device)
    blocks = torch.index_select(flat, 0, block_ids, out=out.view(block_ids.numel(), flat.shape[1]))
    return blocks.view(batch, -1, h, d).transpose(1, 2)


def _allowed(
    q_pos: torch.Tensor, kv_len: int, ctx: torch.Tensor, sliding_window: int | None
) -> torch.Tensor:
    """Boolean mask ``[B, q, kv_len]``: kv position j is visible to a query at ``q_pos``."""
    kv_pos = torch.arange(kv_len, device=q_pos.device)
    mask = (kv_pos[None, None, :] <= q_pos[:, :, None]) & (kv_pos[None, None, :] < ctx[:, None, None])
    if sliding_window is not None:
        mask &= kv_pos[None, None, :] > q_pos[:, :, None] - sliding_window
    return mask


# Sequences with at most this many query tokens (decode, speculative verification) are attended
# in padded batches; longer ones (prefill chunks) one by one, so they never pad the short ones.
MAX_BATCHED_QUERY = 33


@dataclass(slots=True)
class _GroupPlan:
    """Everything about one padded SDPA call that does not depend on the layer."""

    batch: int
    q_max: int
    block_ids: torch.Tensor  # [batch * num_blocks] int64: blocks to gather, row after row
    query_rows: torch.Tensor  # [batch * q_max]: flat query row of each padded query slot
    out_rows: torch.Tensor  # flat output rows of the valid padded slots
    valid: torch.Tensor | None  # [batch, q_max] bool; None when every slot is valid (decode)
    mask: torch.Tensor  # [batch, 1, groups * q_max, L] additive float mask, grouped layout
    # The group is the whole step, one query token per sequence in order (a decode-only step):
    # its query and output rows are the step's own, with no gather or scatter.
    whole_step: bool = False


def _plan_group(
    block_tables: torch.Tensor,
    seqs: list[int],
    starts: list[int],
    q_lens: list[int],
    ctx_list: list[int],
    block_size: int,
    groups: int,
    sliding_window: int | None,
    dtype: torch.dtype,
) -> _GroupPlan:
    device = block_tables.device
    b = len(seqs)
    idx = torch.tensor(seqs, device=device)
    n = torch.tensor([q_lens[i] for i in seqs], device=device)
    ctx = torch.tensor([ctx_list[i] for i in seqs], device=device)
    q_max = max(q_lens[i] for i in seqs)
    nb = (max(ctx_list[i] for i in seqs) + block_size - 1) // block_size
    block_ids = block_tables.index_select(0, idx)[:, :nb].reshape(-1).long()
    j = torch.minimum(torch.arange(q_max, device=device)[None, :], (n - 1)[:, None])  # [B, q_max]
    rows = torch.tensor([starts[i] for i in seqs], device=device)[:, None] + j
    allowed = _allowed(ctx[:, None] - n[:, None] + j, nb * block_size, ctx, sliding_window)
    kv_len = allowed.shape[-1]
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, float("-inf"))
    mask = mask[:, None, None].expand(b, 1, groups, q_max, kv_len).reshape(b, 1, groups * q_max, kv_len)
    if q_max == 1:
        whole_step = len(seqs) == len(ctx_list)  # every sequence has one query token: row i is sequence i
        return _GroupPlan(b, q_max, block_ids, rows.reshape(-1), rows[:, 0], None, mask, whole_step)
    valid = torch.arange(q_max, device=device)[None, :] < n[:, None]
    return _GroupPlan(b, q_max, block_ids, rows.reshape(-1), rows[valid], valid, mask)


def _attend_group(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: _GroupPlan,
    scale: float,
) -> torch.Tensor:
    """One padded SDPA call: the attention of the group's valid query rows, ``[len(out_rows), H, D]``.

    Grouped-query attention without repeating K/V: the ``H / Hkv`` query heads that share a KV
    head are folded into the query-length axis, so one SDPA call per KV head serves them all
    (query head h reads KV head ``h // (H / Hkv)``, as transformers' repeat_kv). Query rows
    past a sequence's length are discarded. A ``whole_step`` group reads ``query`` as it lies.
    """
    b, n = plan.batch, plan.q_max
    h, d = query.shape[1:]
    k = _gather(k_cache, plan.block_ids, b, "k").to(query.dtype)
    v = _gather(v_cache, plan.block_ids, b, "v").to(query.dtype)
    hkv = k.shape[1]
    g = h // hkv
    if n == 1:
        rows = query if plan.whole_step else query.index_select(0, plan.query_rows)
        return F.scaled_dot_product_attention(rows.view(b, hkv, g, d), k, v, attn_mask=plan.mask, scale=scale).reshape(b, h, d)
    q = query.index_select(0, plan.query_rows).view(b, n, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(b, hkv, g * n, d)
    attended = F.scaled_dot_product_attention(q, k, v, attn_mask=plan.mask, scale=scale)
    attended = attended.view(b, hkv, g, n, d).permute(0, 3, 1, 2, 4)
    return attended[plan.valid].reshape(-1, h, d)


def plan_paged_attention_torch(
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    block_size: int,
    num_heads: int,
    num_kv_heads: int,
    sliding_window: int | None,
    dtype: torch.dtype,
) -> list[_GroupPlan]:
    """The layer-independent part of ``paged_attention_torch``: which sequences share an SDPA
    call, the blocks each gathers, the masks. Built once per step and reused by every layer."""
    starts = query_start_loc.tolist()
    ctx_list = context_lens.tolist()
    q_lens = [starts[i + 1] - starts[i] for i in range(len(ctx_list))]
    single = [i for i, n in enumerate(q_lens) if n == 1]
    short = [i for i, n in enumerate(q_lens) if 1 < n <= MAX_BATCHED_QUERY]
    long = [[i] for i, n in enumerate(q_lens) if n > MAX_BATCHED_QUERY]
    groups = num_heads // num_kv_heads
    return [
        _plan_group(block_tables, group, starts, q_lens, ctx_list, block_size, groups, sliding_window, dtype)
        for group in (single, short, *long)
        if group
    ]


def paged_attention_torch(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    *,
    plan_cache: dict | None = None,
) -> torch.Tensor:
    """Reference paged attention; returns ``[T, num_heads, head_dim]`` in ``query``'s dtype.

    Sequences with one query token are batched into one padded SDPA call (the decode case
    dominates a running batch), and so are those with 2..``MAX_BATCHED_QUERY`` (speculative
    verification: one call instead of one per sequence per layer); each longer sequence is
    attended on its own so that a long prefill chunk never pads the decodes.

    ``plan_cache``: a dict that lives as long as one step's metadata; the step's plan (groups,
    block ids, masks) is built on the first layer's call and reused by the others.
    """
    key = (sliding_window, query.shape[1], k_cache.shape[2], query.dtype)
    plan = plan_cache.get(key) if plan_cache is not None else None
    if plan is None:
        plan = plan_paged_attention_torch(
            block_tables, context_lens, query_start_loc, k_cache.shape[1],
            query.shape[1], k_cache.shape[2], sliding_window, query.dtype,
        )
        if plan_cache is not None:
            plan_cache[key] = plan
    if len(plan) == 1 and plan[0].whole_step:
        return _attend_group(query, k_cache, v_cache, plan[0], scale)
    out = torch.empty_like(query)
    for group in plan:
        out.index_copy_(0, group.out_rows, _attend_group(query, k_cache, v_cache, group, scale))
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
    from specbatch_kernels import _triton_attention as ta  # lazy: see the module docstring

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
