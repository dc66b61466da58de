"""The CPU linear kernels side by side: every linear of SmolLM2-135M once, as a decode step runs
them (30 layers' QKV, O, gate-up and down projections, then the 49152-row head: 538 MB of fp32
weights, far more than the caches, so they stream from memory), at 1-1024 rows.

- ``small_linear``: ours (``kernels/specbatch_kernels/csrc/small_gemm.cpp``), what
  ``engine.cpu_linear.PackedLinear`` runs where our CPU ops build;
- ``onednn``: oneDNN-prepacked weights through ``mkldnn._linear_pointwise`` (what it ran before,
  and still runs where the ops do not build);
- ``F.linear``: torch's default (MKL/oneDNN on the plain weight, repacked per call).

Random weights of the real shapes; rounds alternate the kernels (the cores are shared) and the
median of the rounds after the first is reported, with each kernel's ratio to oneDNN.

    python bench/linear_kernels.py --dtype bfloat16 --rows 1,2,4,8,16,32,64,256,1024
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
from engine.model_hub import cache_dir  # noqa: E402
from specbatch_kernels.cpu_ops import load_cpu_ops  # noqa: E402

#: SmolLM2-135M's linears, (out, in), in a decode step's order.
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--rows", default="1,2,4,8,16,32,64,256")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if not load_cpu_ops(cache_dir()):
        raise SystemExit("the specbatch CPU ops did not build: nothing to compare")
    dtype = getattr(torch, args.dtype)
    print(f"# python bench/linear_kernels.py {' '.join(sys.argv[1:])}")
    print(describe_machine())
    torch.manual_seed(0)
    dense = [torch.randn(n, k).to(dtype) for n, k in SHAPES]
    small = [torch.ops.specbatch.pack_small_linear(w) for w in dense]
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w, 64) for w in dense]
    kernels = {
        "small_linear": lambda x, i: torch.ops.specbatch.small_linear(x, small[i], SHAPES[i][0]),
        "onednn": lambda x, i: torch.ops.mkldnn._linear_pointwise(x, onednn[i], None, "none", [], ""),
        "F.linear": lambda x, i: torch.nn.functional.linear(x, dense[i]),
    }
    weight_bytes = sum(w.numel() * w.element_size() for w in dense)
    print(f"{len(SHAPES)} linears, {weight_bytes / 1e6:.0f} MB of {args.dtype} weights; ms per pass (GB/s of weights)")
    with torch.inference_mode():
        for rows in (int(r) for r in args.rows.split(",")):
            inputs = {k: torch.randn(rows, k).to(dtype) for k in (576, 1536)}
            times: dict[str, list[float]] = {name: [] for name in kernels}
            for round_ in range(args.rounds):
                order = list(kernels) if round_ % 2 == 0 else list(reversed(kernels))
                for name in order:
                    start = time.perf_counter()
                    for i, (_, k) in enumerate(SHAPES):
                        kernels[name](inputs[k], i)
                    times[name].append(time.perf_counter() - start)
            med = {name: statistics.median(t[1:] or t) for name, t in times.items()}
            cells = [f"{name} {m * 1e3:7.2f} ({weight_bytes / m / 1e9:4.1f})" for name, m in med.items()]
            ratio = med["onednn"] / med["small_linear"]
            print(f"rows {rows:4}: " + "  ".join(cells) + f"  small_linear/onednn speed {ratio:.2f}x", flush=True)
    print(describe_machine().replace("machine:", "machine at the end:"))


if __name__ == "__main__":
    main()
