"""Start-up timing of a few synthetic steps, so adaptive k has costs before the first request.

Each layout is ``B`` sequences of ``q`` query tokens over a short context, laid out exactly like
a verification step (logits at every query position). The synthetic sequences use the first
blocks of the KV cache, which no request holds yet: every block is fully rewritten by its next
owner before being read, and none of them enters the prefix cache.
"""

from __future__ import annotations

import time

import torch

from engine.attention import PagedMetadata
from engine.model_runner import ModelRunner
from engine.step_inputs import StepInputs

CONTEXT = 64
TARGET_LAYOUTS = ((1, 1), (1, 2), (1, 8), (4, 1), (4, 4), (16, 1))
DRAFT_LAYOUTS = ((1, 1), (4, 1), (16, 1), (1, 8))


def synthetic_inputs(runner: ModelRunner, batch: int, q: int, context: int = CONTEXT) -> StepInputs | None:
    bs = runner.block_size
    per_seq = -(-context // bs)
    if batch * per_seq > runner.num_blocks:
        return None
    tables = torch.arange(batch * per_seq, dtype=torch.int64).view(batch, per_seq)
    pos = torch.arange(context - q, context)
    slots = torch.cat([tables[i][pos // bs] * bs + pos % bs for i in range(batch)])
    dev = runner.device
    metadata = PagedMetadata(
        kv_caches=runner.kv_caches,
        slot_mapping=slots.to(dev),
        block_tables=tables.to(torch.int32).to(dev),
        context_lens=torch.full((batch,), context, dtype=torch.int32, device=dev),
        query_start_loc=torch.arange(0, batch * q + 1, q, dtype=torch.int32, device=dev),
        backend=runner.backend,
        max_query_len=q,
        max_context_len=context,
    )
    return StepInputs(
        input_ids=torch.zeros(batch * q, dtype=torch.long, device=dev),
        positions=pos.repeat(batch).to(dev),
        metadata=metadata,
        logits_indices=torch.arange(batch * q, dtype=torch.long, device=dev),
        sample_rows=[],
    )


def time_layouts(runner: ModelRunner, layouts, repeats: int = 2) -> list[tuple[int, int, float]]:
    """``(scheduled tokens, batch, best seconds)`` for each layout that fits the cache."""
    results = []
    warm = False
    for batch, q in layouts:
        inputs = synthetic_inputs(runner, batch, q)
        if inputs is None:
            continue
        if not warm:
            runner.forward(inputs)
            warm = True
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            runner.forward(inputs)
            best = min(best, time.perf_counter() - start)
        results.append((batch * q, batch, best))
    return results
