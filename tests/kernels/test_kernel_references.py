"""Independent checks of the torch references themselves, against naive per-token loops."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from specbatch_kernels.cache_ops import write_kv_torch
from specbatch_kernels.paged_attention import paged_attention_torch
from paged_cases import make_case


def naive_attention(case) -> torch.Tensor:
    """Softmax attention one query token and one head at a time, in float64."""
    block_size = case.k_cache.shape[1]
    group = case.query.shape[1] // case.k_cache.shape[2]
    starts = case.query_start_loc.tolist()
    out = torch.zeros(case.query.shape, dtype=torch.float64)
    for s, ctx in enumerate(case.context_lens.tolist()):
        q_len = starts[s + 1] - starts[s]
        table = case.block_tables[s].tolist()
        for i in range(q_len):
            t = starts[s] + i
            pos = ctx - q_len + i
            seen = [j for j in range(pos + 1)
                    if case.sliding_window is None or j > pos - case.sliding_window]
            for h in range(case.query.shape[1]):
                q = case.query[t, h].double()
                ks = torch.stack([case.k_cache[table[j // block_size], j % block_size, h // group]
                                  for j in seen]).double()
                vs = torch.stack([case.v_cache[table[j // block_size], j % block_size, h // group]
                                  for j in seen]).double()
                weights = torch.softmax(ks @ q * case.scale, dim=0)
                out[t, h] = weights @ vs
    return out


@pytest.mark.parametrize(
    "ctx, q, window, group",
    [
        ([5, 16, 17], [1, 1, 1], None, 2),  # decode, around a block boundary
        ([5, 33, 20], [5, 4, 1], None, 3),  # prefill, chunk over a cached prefix, decode
        ([30, 40], [1, 6], 7, 1),  # sliding window
        ([1], [1], 1, 4),
    ],
)
def test_reference_matches_naive_attention(ctx, q, window, group):
    case = make_case(ctx, q, group=group, head_dim=16, sliding_window=window, seed=3, device="cpu")
    got = paged_attention_torch(*case.args())
    torch.testing.assert_close(got.double(), naive_attention(case), atol=1e-5, rtol=1e-5)


def test_cache_references_match_loops():
    gen = torch.Generator().manual_seed(0)
    k_cache = torch.randn(4, 16, 2, 8, generator=gen)
    v_cache = torch.randn(4, 16, 2, 8, generator=gen)
    key, value = torch.randn(3, 2, 8, generator=gen), torch.randn(3, 2, 8, generator=gen)
    slots = torch.tensor([17, -1, 63])
    k_want, v_want = k_cache.clone(), v_cache.clone()
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            k_want[slot // 16, slot % 16] = key[t]
            v_want[slot // 16, slot % 16] = value[t]
    write_kv_torch(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, k_want) and torch.equal(v_cache, v_want)


def test_a_plan_cache_is_reused_across_layers_of_one_step():
    """One step's plan (groups, gathered blocks, masks) serves every layer: another layer's
    query and caches over the same layout give what a fresh call gives, and the plan is built once."""
    first = make_case([5, 33, 20], [5, 4, 1], group=3, head_dim=16, sliding_window=None, seed=3, device="cpu")
    gen = torch.Generator().manual_seed(4)
    second = dataclasses.replace(
        first, **{name: torch.randn(getattr(first, name).shape, generator=gen) for name in ("query", "k_cache", "v_cache")}
    )
    plan_cache: dict = {}
    got_first = paged_attention_torch(*first.args(), plan_cache=plan_cache)
    assert len(plan_cache) == 1
    plan = next(iter(plan_cache.values()))
    got_second = paged_attention_torch(*second.args(), plan_cache=plan_cache)
    assert next(iter(plan_cache.values())) is plan
    torch.testing.assert_close(got_first, paged_attention_torch(*first.args()))
    torch.testing.assert_close(got_second.double(), naive_attention(second), atol=1e-5, rtol=1e-5)


def test_reference_runs_in_and_out_of_inference_mode_on_one_thread():
    """Scratch buffers made under inference mode (the engine) must not leak into plain calls."""
    case = make_case([20, 33], [1, 1], group=2, head_dim=16, seed=5, device="cpu")
    with torch.inference_mode():
        inside = paged_attention_torch(*case.args())
    outside = paged_attention_torch(*case.args())
    torch.testing.assert_close(inside.clone(), outside)


def test_a_decode_only_step_attends_its_rows_in_place():
    """A step of one query token per sequence reads its query rows as they lie (here a strided
    slice, as the fused layers pass ``qk[:, :H]``) and returns the attention itself; a step that
    also holds a prefill chunk gathers and scatters its decode rows. Both match the naive loops."""
    decode = make_case([5, 16, 17, 40], [1, 1, 1, 1], group=3, head_dim=16, seed=6, device="cpu")
    wider = torch.cat([decode.query, torch.randn(decode.query.shape[0], 2, 16)], dim=1)
    strided = dataclasses.replace(decode, query=wider[:, : decode.query.shape[1]])
    assert not strided.query.is_contiguous()
    plan_cache: dict = {}
    got = paged_attention_torch(*strided.args(), plan_cache=plan_cache)
    (plan,) = plan_cache.values()
    assert [group.whole_step for group in plan] == [True]
    torch.testing.assert_close(got.double(), naive_attention(decode), atol=1e-5, rtol=1e-5)

    mixed = make_case([9, 30, 12], [1, 7, 1], group=3, head_dim=16, seed=7, device="cpu")
    plan_cache = {}
    got = paged_attention_torch(*mixed.args(), plan_cache=plan_cache)
    (plan,) = plan_cache.values()
    assert [group.whole_step for group in plan] == [False, False]
    torch.testing.assert_close(got.double(), naive_attention(mixed), atol=1e-5, rtol=1e-5)


def test_a_write_told_every_slot_is_valid_skips_no_row():
    gen = torch.Generator().manual_seed(1)
    k_cache, v_cache = torch.zeros(4, 16, 2, 8), torch.zeros(4, 16, 2, 8)
    key, value = torch.randn(3, 2, 8, generator=gen), torch.randn(3, 2, 8, generator=gen)
    slots = torch.tensor([17, 5, 63])
    write_kv_torch(key, value, k_cache, v_cache, slots, all_valid=True)
    for t, slot in enumerate(slots.tolist()):
        assert torch.equal(k_cache[slot // 16, slot % 16], key[t]) and torch.equal(v_cache[slot // 16, slot % 16], value[t])
