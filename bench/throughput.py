"""Throughput, side by side in one process: specbatch vs HF static batching vs HF continuous batching.

Workload: seeded chat prompts whose ``max_tokens`` follow a long tail (lognormal, median 64,
clipped to 16..512), greedy. Each peer's outputs are cut at EOS and at their own ``max_tokens``;
only those useful tokens are counted. Prints tokens/s of each, the ratios, specbatch's fraction
of the compute ceiling and batch-1 tokens/s against the bandwidth ceiling.

    python bench/throughput.py                 # default: 64 prompts, ~10 min on 2 CPU cores
    python bench/throughput.py --num-prompts 16 --skip-hf-static
"""

from __future__ import annotations

import argparse
import os
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
if sys.path and os.path.abspath(sys.path[0] or ".") == _HERE:
    sys.path.pop(0)  # bench/queue.py must not shadow the standard library's queue
sys.path.insert(0, os.path.dirname(_HERE))

import torch  # noqa: E402
from transformers import GenerationConfig  # noqa: E402

from bench.machine import matmul_flops, memory_bandwidth  # noqa: E402
from bench.workload import long_tail_workload  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from engine.model_hub import DEFAULT_MODEL, load_causal_lm, resolve_model  # noqa: E402


def useful(tokens: list[int], max_tokens: int, eos: set[int]) -> int:
    """Tokens up to and including the first EOS, at most ``max_tokens``."""
    for i, t in enumerate(tokens[:max_tokens]):
        if t in eos:
            return i + 1
    return min(len(tokens), max_tokens)


def run_specbatch(llm: LLM, prompts, max_tokens, eos) -> tuple[float, int]:
    params = [SamplingParams(temperature=0, max_tokens=m) for m in max_tokens]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return elapsed, sum(useful(o.outputs[0].token_ids, m, eos) for o, m in zip(outs, max_tokens))


def run_hf_static(model, prompts, max_tokens, eos, pad_id: int, batch: int) -> tuple[float, int, float]:
    """Fixed batches, left padding, each batch runs to its longest ``max_tokens``."""
    total_useful, computed_slots = 0, 0
    start = time.perf_counter()
    for i in range(0, len(prompts), batch):
        chunk, lims = prompts[i : i + batch], max_tokens[i : i + batch]
        width = max(len(p) for p in chunk)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        out = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=max(lims), do_sample=False, pad_token_id=pad_id
        )
        new = out[:, width:].tolist()
        computed_slots += len(chunk) * len(new[0])
        total_useful += sum(useful(row, m, eos) for row, m in zip(new, lims))
    return time.perf_counter() - start, total_useful, total_useful / max(computed_slots, 1)


def run_hf_continuous(model, prompts, max_tokens, eos) -> tuple[float, int]:
    """transformers' continuous batching manager, each request with its own max_new_tokens."""
    config = GenerationConfig(do_sample=False, max_new_tokens=max(max_tokens), eos_token_id=sorted(eos))
    start = time.perf_counter()
    results = {}
    with model.continuous_batching_context_manager(generation_config=config, block=True, timeout=5) as manager:
        ids = [manager.add_request(p, request_id=f"r{i}", max_new_tokens=m) for i, (p, m) in enumerate(zip(prompts, max_tokens))]
        while len(results) < len(ids):
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                results[result.request_id] = result
            elif result is None and not manager.is_running():
                raise RuntimeError("transformers continuous batching stopped early")
    elapsed = time.perf_counter() - start
    return elapsed, sum(useful(results[f"r{i}"].generated_tokens, m, eos) for i, m in enumerate(max_tokens))


def batch1(llm: LLM, model, prompt: list[int], n: int) -> tuple[float, float]:
    """tokens/s of one request alone: specbatch, then HF generate."""
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    llm.generate([prompt], params, use_tqdm=False)
    start = time.perf_counter()
    llm.generate([prompt], params, use_tqdm=False)
    ours = n / (time.perf_counter() - start)
    ids = torch.tensor([prompt])
    start = time.perf_counter()
    out = model.generate(input_ids=ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
    theirs = (out.shape[1] - ids.shape[1]) / (time.perf_counter() - start)
    return ours, theirs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--hf-batch", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None, help="float32 on CPU, bfloat16 on CUDA by default")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--skip-hf-static", action="store_true")
    parser.add_argument("--skip-hf-continuous", action="store_true")
    parser.add_argument("--batch1-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    path = resolve_model(args.model)
    llm = LLM(path, device=args.device, dtype=args.dtype, max_num_seqs=args.max_num_seqs)
    dtype = llm.engine.config.dtype
    tok = llm.tokenizer
    convs, max_tokens = long_tail_workload(args.num_prompts, args.seed)
    prompts = [llm.engine.apply_chat_template(c) for c in convs]
    eos = llm.engine.eos_ids
    hf = load_causal_lm(path, dtype=dtype).to(args.device).eval()
    params = sum(p.numel() for p in hf.parameters())
    weight_bytes = sum(p.numel() * p.element_size() for p in hf.parameters())
    print(f"model {args.model}: {params / 1e6:.1f}M params, {dtype}, device {args.device}, torch threads {torch.get_num_threads()}")
    print(f"workload: {len(prompts)} chat prompts, max_tokens median {sorted(max_tokens)[len(max_tokens) // 2]}, "
          f"min {min(max_tokens)}, max {max(max_tokens)}, sum {sum(max_tokens)}")

    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm-up
    results: dict[str, float] = {}
    t, n = run_specbatch(llm, prompts, max_tokens, eos)
    results["specbatch"] = n / t
    print(f"specbatch LLM.generate        : {n:6d} useful tokens in {t:7.1f}s = {n / t:7.1f} tok/s")
    if not args.skip_hf_static:
        t, n, frac = run_hf_static(hf, prompts, max_tokens, eos, tok.pad_token_id or 0, args.hf_batch)
        results["hf_static"] = n / t
        print(f"HF generate, static B={args.hf_batch:<3d}    : {n:6d} useful tokens in {t:7.1f}s = {n / t:7.1f} tok/s "
              f"({frac:.0%} of computed slots useful)")
    if not args.skip_hf_continuous:
        cb_model = load_causal_lm(path, dtype=dtype).to(args.device).eval()
        t, n = run_hf_continuous(cb_model, prompts, max_tokens, eos)
        results["hf_continuous"] = n / t
        print(f"HF continuous batching        : {n:6d} useful tokens in {t:7.1f}s = {n / t:7.1f} tok/s")
        del cb_model

    ours_b1, hf_b1 = batch1(llm, hf, prompts[0], args.batch1_tokens)
    flops = matmul_flops(dtype) if args.device == "cpu" else float("nan")
    bandwidth = memory_bandwidth() if args.device == "cpu" else float("nan")
    compute_ceiling = flops / (2 * params)
    bandwidth_ceiling = bandwidth / weight_bytes
    print()
    print(f"ratio specbatch / HF static        : {results['specbatch'] / results['hf_static']:.2f}x" if "hf_static" in results else "")
    print(f"ratio specbatch / HF continuous    : {results['specbatch'] / results['hf_continuous']:.2f}x" if "hf_continuous" in results else "")
    print(f"compute ceiling (matmul {flops / 1e9:.0f} GFLOP/s / 2*params): {compute_ceiling:.0f} tok/s; "
          f"specbatch reaches {results['specbatch'] / compute_ceiling:.0%}")
    print(f"batch 1: specbatch {ours_b1:.1f} tok/s, HF generate {hf_b1:.1f} tok/s ({ours_b1 / hf_b1:.2f}x); "
          f"bandwidth ceiling ({bandwidth / 1e9:.1f} GB/s / {weight_bytes / 1e6:.0f} MB) {bandwidth_ceiling:.0f} tok/s, "
          f"specbatch reaches {ours_b1 / bandwidth_ceiling:.0%}")


if __name__ == "__main__":
    main()
