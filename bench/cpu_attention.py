"""The CPU decode-attention op (``specbatch::paged_decode_attention``) against the torch reference.

One decode step's attention for every layer of a SmolLM2-shaped model (9 query heads, 3 KV
heads, head size 64, 30 layers, 16-token blocks), each layer with its own cache, so the KV read
comes from memory as in a real step (the caches together are larger than L3), blocks placed at
random as the block manager leaves them. Alternated rounds, medians; prints ms per step and the
KV bytes read per second. The reference (``paged_attention_torch``) gathers K/V and runs SDPA.

    python bench/cpu_attention.py
    python bench/cpu_attention.py --cases 64x100,8x300,1x400 --dtype float32
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
if sys.path and os.path.abspath(sys.path[0] or ".") == _HERE:
    sys.path.pop(0)  # bench/queue.py must not shadow the standard library's queue
sys.path.insert(0, os.path.dirname(_HERE))

import torch  # noqa: E402

from bench.machine import describe_machine  # noqa: E402
from specbatch_kernels.cpu_ops import load_cpu_ops, paged_decode_attention  # noqa: E402
from specbatch_kernels.paged_attention import paged_attention_torch  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, LAYERS, BLOCK = 9, 3, 64, 30, 16


def step_inputs(batch: int, ctx: int, dtype: torch.dtype, gen: torch.Generator):
    """Per-layer caches, a shuffled block table, the query and the step's metadata."""
    per_seq = -(-ctx // BLOCK)
    blocks = batch * per_seq + 1
    caches = [tuple(torch.randn(blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=gen).to(dtype) for _ in range(2))
              for _ in range(LAYERS)]
    tables = torch.randperm(blocks, generator=gen)[: batch * per_seq].view(batch, per_seq).to(torch.int32)
    context_lens = torch.full((batch,), ctx, dtype=torch.int32)
    query = torch.randn(batch, HEADS, HEAD_DIM, generator=gen).to(dtype)
    starts = torch.arange(batch + 1, dtype=torch.int32)
    return caches, tables, context_lens, query, starts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default="64x100,8x300,2x300,1x400", help="batch x context, comma separated")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if not load_cpu_ops():
        raise SystemExit("the specbatch CPU ops did not build here (see the log above)")
    dtype = getattr(torch, args.dtype)
    scale = HEAD_DIM**-0.5
    print(f"# python bench/cpu_attention.py {' '.join(sys.argv[1:])}")
    print(describe_machine())
    print(f"{LAYERS} layers, {HEADS} query / {KV_HEADS} KV heads of {HEAD_DIM}, {args.dtype}; ms per step (GB/s of KV)")
    gen = torch.Generator().manual_seed(0)
    for case in args.cases.split(","):
        batch, ctx = (int(x) for x in case.split("x"))
        caches, tables, context_lens, query, starts = step_inputs(batch, ctx, dtype, gen)
        runs = {
            "op": lambda k, v: paged_decode_attention(query, k, v, tables, context_lens, scale),
            "reference": lambda k, v: paged_attention_torch(query, k, v, tables, context_lens, starts, scale, None),
        }
        times: dict[str, list[float]] = {name: [] for name in runs}
        for r in range(args.rounds + 1):  # round 0 warms both
            for name in (list(runs) if r % 2 == 0 else list(reversed(runs))):
                start = time.perf_counter()
                for k, v in caches:
                    runs[name](k, v)
                if r:
                    times[name].append(time.perf_counter() - start)
        kv_bytes = batch * ctx * KV_HEADS * HEAD_DIM * 2 * query.element_size() * LAYERS
        med = {name: statistics.median(t) for name, t in times.items()}
        print(f"batch {batch:3d} x {ctx:4d} tokens: " + ", ".join(
            f"{name} {1e3 * med[name]:7.2f} ms ({kv_bytes / med[name] / 1e9:5.1f} GB/s)" for name in runs)
            + f"; op {med['reference'] / med['op']:.2f}x the reference")
    print(describe_machine().replace("machine:", "machine at the end:"))


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
