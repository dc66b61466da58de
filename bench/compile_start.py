"""Start-up cost of the compiled decode step (``compile_step=True``): cold and warm.

Each start runs in a fresh process over one new project cache (the machine's converted models
and C++ ops linked in, built beforehand): the first finds no graph and empty inductor caches
(cold: dynamo traces, inductor compiles the C++ of the graph, the graph is saved), the next
ones load the saved graph (warm). ``traced`` starts (``SPECBATCH_COMPILE_SAVE=0``, the path
before) are timed alternately with them: dynamo traces again, inductor's caches hit.

    python bench/compile_start.py                 # one cold start, two warm and two traced ones
    python bench/compile_start.py --warm 4 --threads 1
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
if sys.path and os.path.abspath(sys.path[0] or ".") == _HERE:
    sys.path.pop(0)  # bench/kernels.py must not shadow the kernels package transformers imports

_CHILD = """
import json, sys, time
start = time.perf_counter()
import torch
if {threads}:
    torch.set_num_threads({threads})
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model_hub import resolve_model
imported = time.perf_counter()
engine = LLMEngine(EngineConfig(model=resolve_model({model!r}), device="cpu", max_num_seqs=8, compile_step=True))
compiled = engine.runner.compiled
print(json.dumps({{"ok": compiled is not None, "import_s": imported - start,
                   "engine_s": time.perf_counter() - imported,
                   "compile_s": compiled.warmup_s if compiled is not None else None}}))
"""


def start_once(model: str, cache: str, threads: int, save: bool = True) -> dict:
    env = dict(os.environ, SPECBATCH_CACHE_DIR=cache, TORCHINDUCTOR_CACHE_DIR=os.path.join(cache, "inductor"),
               SPECBATCH_COMPILE_SAVE="1" if save else "0")
    env["PYTHONPATH"] = os.pathsep.join([_ROOT, os.path.join(_ROOT, "kernels"), env.get("PYTHONPATH", "")])
    wall = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", _CHILD.format(model=model, threads=threads)], env=env,
                         capture_output=True, text=True, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["process_s"] = time.perf_counter() - wall
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--warm", type=int, default=2, help="warm starts after the cold one")
    parser.add_argument("--threads", type=int, default=0, help="torch threads in the children (0: torch's choice)")
    args = parser.parse_args()
    from bench.machine import describe_machine
    from engine.model_hub import cache_dir
    from specbatch_kernels.cpu_ops import load_cpu_ops

    print(describe_machine())
    print(f"CPU ops built: {load_cpu_ops(cache_dir())}")
    with tempfile.TemporaryDirectory(prefix="specbatch-cache-") as cache:
        for entry in os.listdir(cache_dir()):  # converted models, C++ ops: not what is measured
            if entry not in ("inductor", "compiled_step"):
                os.symlink(os.path.join(cache_dir(), entry), os.path.join(cache, entry))
        runs = [("cold", True)] + [kind for _ in range(args.warm) for kind in (("warm", True), ("traced", False))]
        for kind, save in runs:
            r = start_once(args.model, cache, args.threads, save)
            print(f"{kind}: decode step compiled in {r['compile_s']:.1f} s; engine built in {r['engine_s']:.1f} s "
                  f"(imports {r['import_s']:.1f} s, whole process {r['process_s']:.1f} s); compiled: {r['ok']}")
    print(f"load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    sys.path.insert(0, _ROOT)
    sys.path.insert(1, os.path.join(_ROOT, "kernels"))
    main()
