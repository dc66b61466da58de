"""The GPU check's stages: each measures one thing against the hardware and records every figure.

Each stage is a function of a ``Stage`` (its name, its deadline, the figures so far). It runs
in a process of its own (``bench/gpu_check.py`` forks one per stage and kills it at its limit),
saves its figures after every measurement so a killed stage keeps what it measured, and adds a
few lines to ``summary`` for the final table. In dry mode the same functions run on the CPU
over tiny shapes with the Triton kernels interpreted: the figures are meaningless, the code
path is the one the GPU runs.
"""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from bench.gpu_models import DRY_SHAPES, ROOT, SHAPES, Shape, engine_over, random_model, word_tokenizer


@dataclass
class Stage:
    name: str
    dry: bool
    device: str
    deadline: float  # time.time() at which the driver kills this stage
    partial: Path  # figures so far, rewritten after every measurement
    meta: dict  # what earlier stages found: machine, rates, the real model's directory
    figures: dict = field(default_factory=dict)
    started: float = field(default_factory=time.time)

    def put(self, key: str, value: Any) -> None:
        self.figures[key] = value
        self.save()

    def add(self, group: str, key: str, value: Any) -> None:
        self.figures.setdefault(group, {})[key] = value
        self.save()

    def summary(self, line: str) -> None:
        self.figures.setdefault("summary", []).append(line)
        self.log(line)
        self.save()

    def save(self) -> None:
        tmp = self.partial.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.figures, indent=1, default=str))
        os.replace(tmp, self.partial)

    def left(self) -> float:
        return self.deadline - time.time()

    def log(self, message: str) -> None:
        print(f"  [{self.name} +{time.time() - self.started:5.1f}s] {message}", flush=True)

    @property
    def shapes(self) -> dict[str, Shape]:
        return DRY_SHAPES if self.dry else SHAPES

    @property
    def dtype(self) -> torch.dtype:
        """The production dtype: bf16 on the GPU; fp32 in dry mode (the CPU interpreter's bf16 dot is wrong)."""
        return torch.float32 if self.dry else torch.bfloat16

    def sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()


def free_memory(stage: Stage) -> None:
    import gc

    gc.collect()
    if stage.device == "cuda":
        torch.cuda.empty_cache()


def random_prompts(n: int, length: int, vocab: int, seed: int, vary: int = 0) -> list[list[int]]:
    """``n`` prompts of ``length`` (+ up to ``vary``) token ids, away from EOS and pad."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(length, length + vary + 1, (n,), generator=gen).tolist()
    return [torch.randint(1, vocab - 2, (m,), generator=gen).tolist() for m in lengths]


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of distinct parameters (tied embeddings once): what a decode step must read."""
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


# ------------------------------------------------------------------------------ probe
def probe(stage: Stage) -> None:
    """The machine and its two ceilings: HBM copy rate and dense bf16 matmul rate."""
    import transformers
    import triton

    stage.put("versions", {"python": sys.version.split()[0], "torch": torch.__version__,
                           "triton": triton.__version__, "transformers": transformers.__version__})
    if stage.device == "cuda":
        props = torch.cuda.get_device_properties(0)
        stage.put("device", {"name": props.name, "sms": props.multi_processor_count,
                             "total_gib": props.total_memory / 2**30, "capability": f"{props.major}.{props.minor}"})
        nbytes, reps = 1 << 30, 20
        src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        n, dtype = 8192, torch.bfloat16
    else:
        stage.put("device", {"name": "cpu (dry run)", "cpus": os.cpu_count()})
        nbytes, reps = 32 << 20, 5
        src = torch.ones(nbytes, dtype=torch.uint8)
        dst = torch.empty_like(src)
        n, dtype = 256, torch.float32
    copy_s = timed(stage, lambda: dst.copy_(src), reps)
    rate = 2 * nbytes / copy_s  # read + write
    stage.put("hbm_copy_bytes_per_s", rate)
    stage.summary(f"memory copy {rate / 1e12:.2f} TB/s (read + write of {nbytes >> 20} MiB buffers)")
    a = torch.randn(n, n, dtype=dtype, device=stage.device)
    b = torch.randn(n, n, dtype=dtype, device=stage.device)
    mm_s = timed(stage, lambda: a @ b, 10)
    flops = 2 * n**3 / mm_s
    stage.put("matmul_flops", flops)
    stage.summary(f"{str(dtype).removeprefix('torch.')} matmul {n}^3: {flops / 1e12:.1f} TFLOP/s")


def timed(stage: Stage, fn: Callable[[], Any], reps: int) -> float:
    """Seconds per call after two warm-up calls (device synchronised)."""
    for _ in range(2):
        fn()
    stage.sync()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    stage.sync()
    return (time.perf_counter() - start) / reps


# ---------------------------------------------------------------------------- kernels
def kernels(stage: Stage) -> None:
    """The kernel tests and the decode-graph test, Triton compiled for the GPU (no interpreter)."""
    env = dict(os.environ)
    env.pop("SPECBATCH_KERNEL_BACKEND", None)  # the tests choose their kernels themselves
    if stage.dry:
        env["TRITON_INTERPRET"] = "1"
        targets = ["tests/kernels/test_kernel_dispatch.py"]
    else:
        env.pop("TRITON_INTERPRET", None)
        env["SPECBATCH_TEST_DEVICE"] = "cuda"
        env.setdefault("SPECBATCH_KERNEL_EXAMPLES", "15")
        targets = ["tests/kernels", "tests/engine/test_decode_graphs.py"]
    # The sm_90 cubin compile test is for machines without a GPU: here every kernel compiles for real.
    cmd = [sys.executable, "-m", "pytest", *targets, "-q", "-p", "no:cacheprovider", "-rfEs",
           "-k", "not compile_to_cubin", "--durations=5"]
    stage.put("command", " ".join(cmd[1:]))
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=max(5.0, stage.left() - 5))
        out, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        rc = "timed out"
    print(out[-12000:], flush=True)
    counts = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", out)}
    stage.put("counts", counts)
    stage.put("returncode", rc)
    stage.summary(f"pytest {' '.join(targets)}: " + ", ".join(f"{v} {k}" for k, v in counts.items())
                  + ("" if rc == 0 else f" (exit {rc})"))
    if rc != 0:
        raise RuntimeError(f"kernel tests failed (exit {rc})")


# ----------------------------------------------------------------------------- parity
NEAR_TIE = {torch.float32: 1e-3, torch.bfloat16: 0.05}
"""A divergence from HF is a near-tie iff HF's top-2 logit gap at that step is below this
fraction of the standard deviation of HF's logits there. fp32 (TF32 off, our kernels in IEEE
fp32) differs from HF by reduction order only, ~1e-6 of the spread: 1e-3 is strict. bf16
rounds every op to ~0.4%; ~30 layers of it leave logits off by ~1-2% of their spread: 5%."""
NEAR_TIE_ULPS = {torch.float32: 0, torch.bfloat16: 2}
"""...or, in bf16, iff the gap is at most this many bf16 steps at the top logit's magnitude: the
logits are bf16 numbers themselves, so a gap of one or two steps (0.25 at 32..64) is a rounding
of either side. The first H200 run (2026-12-04) saw gaps of 0, 0.0625, 0.1875 and 0.25 at
top logits of 20-40: all one step or less, which the sigma rule alone (0.15-0.22) called failures."""


def near_tie_threshold(dtype: torch.dtype, top: float, sigma: float) -> float:
    """The largest top-2 gap that counts as a near-tie (see ``NEAR_TIE`` and ``NEAR_TIE_ULPS``)."""
    import math

    ulp = 2.0 ** (math.floor(math.log2(abs(top))) - 7) if top else 0.0  # bf16: 8 significant bits
    return max(NEAR_TIE[dtype] * sigma, NEAR_TIE_ULPS[dtype] * ulp)


def parity(stage: Stage) -> None:
    """Greedy tokens of our engine (all prompts in one batch) vs HF ``generate`` one prompt at a time."""
    real = stage.meta.get("smollm2_dir")
    runs = [("smollm2-135m", torch.float32), ("smollm2-135m", torch.bfloat16), ("llama-1b", torch.bfloat16),
            ("llama-8b", torch.bfloat16)]
    if stage.dry:  # one run per code path: tied fp32, untied bf16
        runs = [runs[0], runs[3]]
    n_prompts, new_tokens = (3, 5) if stage.dry else (8, 32)
    failures = []
    for shape_name, dtype in runs:
        if stage.left() < (10 if stage.dry else 25):
            stage.summary(f"{shape_name} {dtype}: skipped (out of time)")
            continue
        shape = stage.shapes[shape_name]
        use_real = real is not None and shape_name == "smollm2-135m"
        if use_real:
            from transformers import AutoTokenizer

            from engine.model_hub import load_causal_lm

            tokenizer = AutoTokenizer.from_pretrained(real)
            hf = load_causal_lm(real, dtype=dtype).to(stage.device).eval()
            questions = ["What is the capital of France?", "Write a haiku about the sea.", "Who wrote Hamlet?",
                         "List three prime numbers.", "What causes rain?", "Why is the sky blue?",
                         "Name a famous painter.", "How do magnets work?"][:n_prompts]
            prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                     tokenize=True) for q in questions]
            prompts = [list(p["input_ids"]) if isinstance(p, dict) or hasattr(p, "input_ids") else list(p)
                       for p in prompts]
        else:
            tokenizer = word_tokenizer(shape.vocab)
            hf = random_model(shape, dtype, stage.device, seed=1)
            prompts = random_prompts(n_prompts, 8 if stage.dry else 24, shape.vocab, seed=3, vary=8)
        ours = engine_over(copy.deepcopy(hf), tokenizer, stage.device, max_num_seqs=max(16, n_prompts),
                           kv_cache_memory_bytes=64 << 20 if stage.dry else 4 << 30)
        from engine import SamplingParams

        outs = ours.generate(prompts, SamplingParams(temperature=0, max_tokens=new_tokens), use_tqdm=False)
        label = f"{shape_name}{' (real weights)' if use_real else ''} {str(dtype).removeprefix('torch.')}"
        record = compare_greedy(stage, hf, prompts, [o.outputs[0].token_ids for o in outs], new_tokens, dtype)
        if dtype != torch.float32:
            record["hf_eager_attention"] = hf_against_itself(stage, hf, prompts, new_tokens, dtype)
        stage.add("runs", label, record)
        unexplained = [d for d in record["divergences"] if not d["near_tie"]]
        noise = record.get("hf_eager_attention")
        baseline = "" if noise is None else (
            f"; HF itself with eager attention: {noise['identical']}/{len(prompts)} identical, largest gap "
            f"{max((d['gap'] for d in noise['divergences']), default=0.0):.4g}")
        stage.summary(f"{label}: {record['identical']}/{len(prompts)} identical x {new_tokens} tokens, "
                      f"{len(record['divergences']) - len(unexplained)} near-tie divergence(s), "
                      f"{len(unexplained)} not near-ties (rule: gap <= max({NEAR_TIE[dtype]} sigma, "
                      f"{NEAR_TIE_ULPS[dtype]} bf16 steps)){baseline}")
        if unexplained:
            failures.append(label)
        del hf, ours, outs
        free_memory(stage)
    if failures:
        raise RuntimeError(f"greedy parity failed beyond near-ties: {failures}")


def hf_against_itself(stage: Stage, hf, prompts: list[list[int]], new_tokens: int, dtype: torch.dtype) -> dict:
    """bf16's own noise floor: HF with eager attention against HF with its default (SDPA), the
    same weights. Divergences of ours no larger than these are rounding, not a defect of ours."""
    eager = copy.deepcopy(hf)
    eager.set_attn_implementation("eager")
    tokens = []
    for prompt in prompts:
        ids = torch.tensor([prompt], device=stage.device)
        out = eager.generate(ids, max_new_tokens=new_tokens, do_sample=False, disable_compile=True)
        tokens.append(out[0, ids.shape[1]:].tolist())
    del eager
    return compare_greedy(stage, hf, prompts, tokens, new_tokens, dtype, who="HF eager attention")


def compare_greedy(stage: Stage, hf, prompts: list[list[int]], got: list[list[int]], new_tokens: int,
                   dtype: torch.dtype, who: str = "ours") -> dict:
    """HF ``generate`` per prompt; every divergence with HF's top-2 gap and logit spread there."""
    divergences, identical = [], 0
    for i, (prompt, ours) in enumerate(zip(prompts, got)):
        ids = torch.tensor([prompt], device=stage.device)
        ref = hf.generate(ids, max_new_tokens=new_tokens, do_sample=False, output_logits=True,
                          return_dict_in_generate=True, disable_compile=True)
        want = ref.sequences[0, ids.shape[1]:].tolist()
        step = next((j for j, (a, b) in enumerate(zip(ours, want)) if a != b), None)
        if step is None and len(ours) == len(want):
            identical += 1
            continue
        step = step if step is not None else min(len(ours), len(want))
        row = ref.logits[min(step, len(ref.logits) - 1)][0].float()
        top2 = row.topk(2).values
        gap, sigma = float(top2[0] - top2[1]), float(row.std())
        threshold = near_tie_threshold(dtype, float(top2[0]), sigma)
        entry = {"prompt": i, "step": step, "ours": ours[step] if step < len(ours) else None,
                 "hf": want[step] if step < len(want) else None, "gap": gap, "sigma": sigma,
                 "top": float(top2[0]), "threshold": threshold, "near_tie": gap <= threshold}
        divergences.append(entry)
        stage.log(f"divergence: prompt {i} step {step}: {who} {entry['ours']} vs HF {entry['hf']}, "
                  f"HF top-2 gap {gap:.4g} (sigma {sigma:.3g}, near-tie below {entry['threshold']:.3g}): "
                  f"{'near-tie' if entry['near_tie'] else 'NOT a near-tie'}")
    return {"identical": identical, "prompts": len(prompts), "new_tokens": new_tokens, "divergences": divergences}


# ------------------------------------------------------------------------- throughput
def throughput(stage: Stage) -> None:
    """Decode ms/step at batch 1/8/64/256, CUDA graphs on and off, beside HF static-cache
    ``generate``, each also as a multiple of the weight floor (weight bytes / copy rate)."""
    batches = [1, 3] if stage.dry else [1, 8, 64, 256]
    steps, prompt_len = (2, 8) if stage.dry else (32, 128)
    rate = stage.meta.get("hbm_copy_bytes_per_s")
    flops = stage.meta.get("matmul_flops")
    for shape_name in ("smollm2-135m", "llama-8b") if stage.dry else ("smollm2-135m", "llama-8b", "llama-1b"):
        if stage.left() < (10 if stage.dry else 30):
            stage.summary(f"{shape_name}: skipped (out of time)")
            continue
        shape = stage.shapes[shape_name]
        model = random_model(shape, stage.dtype, stage.device, seed=2)
        wbytes = weight_bytes(model)
        floor_ms = wbytes / rate * 1e3 if rate else None
        record: dict[str, Any] = {"weight_bytes": wbytes, "floor_ms": floor_ms, "params": shape.params(),
                                  "compute_floor_ms": {b: 2 * shape.params() * b / flops * 1e3 for b in batches}
                                  if flops else None}
        stage.add("models", shape_name, record)
        for b in batches:
            if stage.left() < 8:
                break
            record.setdefault("hf_static", {})[b] = hf_static_ms(stage, model, shape, b, prompt_len, steps)
            stage.save()
        tokenizer = word_tokenizer(shape.vocab)
        kv = shape.kv_bytes_per_token(torch.empty(0, dtype=stage.dtype).element_size())
        llm = engine_over(model, tokenizer, stage.device, max_num_seqs=max(batches),
                          max_num_batched_tokens=8192 if not stage.dry else 2048,
                          kv_cache_memory_bytes=kv * max(batches) * (prompt_len + steps + 32) * 2)
        engine = llm.engine
        captured = engine.runner.graphs
        if captured is None:  # the CPU never captures: run the same padded path eagerly (dry mode)
            from engine.decode_graphs import DecodeGraphs

            captured = DecodeGraphs(engine.runner, max(batches), engine.max_model_len, static=True)
        held = True
        for mode, graphs in (("graphs", captured), ("eager", None)):
            engine.runner.graphs = graphs
            for b in batches:
                if stage.left() < (5 if stage.dry else 10):
                    break
                ms = decode_ms(engine, random_prompts(b, prompt_len, shape.vocab, seed=b), steps)
                record.setdefault(mode, {})[b] = ms
                stage.save()
            held = held and (graphs is None or engine.runner.graphs is graphs)
        # A failed capture drops the graphs for good (and logs why): then "graphs" figures were eager.
        record["graphs_held"] = held
        engine.runner.graphs = captured
        if not record["graphs_held"]:
            stage.summary(f"{shape_name}: CUDA graphs were dropped (capture failed; see the log): 'graphs' ran eagerly")
        for b in batches:
            cells = [f"{m} {record[m][b]:.2f} ms ({record[m][b] / floor_ms:.1f}x)" if floor_ms else f"{m} {record[m][b]:.2f} ms"
                     for m in ("graphs", "eager", "hf_static") if b in record.get(m, {})]
            compute = f", compute floor {record['compute_floor_ms'][b]:.2f} ms" if record["compute_floor_ms"] else ""
            stage.summary(f"{shape_name} batch {b}{compute}: " + ", ".join(cells))
        stage.summary(f"{shape_name}: weights {wbytes / 1e9:.2f} GB, floor {floor_ms:.3f} ms/step" if floor_ms
                      else f"{shape_name}: weights {wbytes / 1e9:.2f} GB")
        del llm, engine, model, captured
        free_memory(stage)


def decode_ms(engine, prompts: list[list[int]], steps: int) -> float:
    """Milliseconds per engine decode step with every prompt decoding (prefill done, 3 warm-up steps)."""
    from bench.step_profile import drain, run_steps, start_batch

    start_batch(engine, prompts, steps + 8)
    run_steps(engine, 3)  # capture for this size, allocator warm
    seconds = run_steps(engine, steps)
    drain(engine)
    return seconds / steps * 1e3


def hf_static_ms(stage: Stage, model, shape: Shape, batch: int, prompt_len: int, steps: int) -> float:
    """HF ``generate`` with a static cache (compile off): ms per decode step, prefill subtracted."""
    ids = torch.tensor(random_prompts(batch, prompt_len, shape.vocab, seed=batch), device=stage.device)
    kwargs = dict(do_sample=False, cache_implementation="static", disable_compile=True,
                  pad_token_id=shape.vocab - 2, eos_token_id=None)

    def run(n: int) -> float:
        stage.sync()
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kwargs)
        stage.sync()
        return time.perf_counter() - start

    run(2)  # warm-up
    prefill = run(1)
    return (run(steps + 1) - prefill) / steps * 1e3


# -------------------------------------------------------------------------- attention
def attention(stage: Stage) -> None:
    """Our paged decode attention kernel (and SDPA on contiguous K/V) vs the measured copy rate."""
    from bench.kernels import kv_bytes, make_inputs

    rate = stage.meta.get("hbm_copy_bytes_per_s")
    if stage.dry:
        cases, heads, kv_heads, head_dim, dtype = [(1, 17), (3, 64)], 4, 2, 32, torch.float32
    else:
        cases = [(b, c) for b in (1, 16, 64, 256) for c in (512, 2048, 8192)]
        heads, kv_heads, head_dim, dtype = 32, 8, 128, torch.bfloat16
    import torch.nn.functional as F

    from specbatch_kernels.paged_attention import paged_attention_triton

    for batch, ctx in cases:
        if stage.left() < 3:
            stage.summary(f"batch {batch} ctx {ctx}: skipped (out of time)")
            continue
        inp = make_inputs(batch, ctx, heads, kv_heads, head_dim, 16, dtype, stage.device)
        args = (inp["query"], inp["k_cache"], inp["v_cache"], inp["block_tables"], inp["context_lens"],
                inp["query_start_loc"], inp["scale"])
        ours = lambda: paged_attention_triton(*args, max_query_len=1, max_context_len=ctx)  # noqa: E731
        k = inp["k_cache"][inp["block_tables"].long()].flatten(1, 2)[:, :ctx].transpose(1, 2).contiguous()
        v = inp["v_cache"][inp["block_tables"].long()].flatten(1, 2)[:, :ctx].transpose(1, 2).contiguous()
        sdpa = lambda: F.scaled_dot_product_attention(inp["query"][:, :, None], k, v, scale=inp["scale"],  # noqa: E731
                                                      enable_gqa=True)[:, :, 0]
        err = float((ours().float() - sdpa().float()).abs().max())
        reps = 2 if stage.dry else 50
        ms = {name: timed(stage, fn, reps) * 1e3 for name, fn in (("triton", ours), ("sdpa", sdpa))}
        nbytes = kv_bytes(inp, ctx)
        record = {"kv_bytes": nbytes, "ms": ms, "max_abs_err_vs_sdpa": err,
                  "fraction_of_copy_rate": {n: nbytes / (t * 1e-3) / rate for n, t in ms.items()} if rate else None}
        stage.add("cases", f"b{batch}_ctx{ctx}", record)
        frac = record["fraction_of_copy_rate"]
        stage.summary(f"batch {batch:3d} ctx {ctx:5d}: triton {ms['triton']:.4f} ms"
                      + (f" = {frac['triton']:.0%} of copy rate" if frac else "")
                      + f", sdpa (contiguous) {ms['sdpa']:.4f} ms; max|err| {err:.1e}")
        del inp, k, v
        free_memory(stage)
        if err > (1e-4 if dtype == torch.float32 else 3e-2):
            raise RuntimeError(f"paged attention differs from SDPA by {err} at batch {batch} ctx {ctx}")


def precapture(llm) -> None:
    """Capture every decode size now, so no capture lands inside a timed window (a batch that
    shrinks as requests end would otherwise capture each smaller size while being timed)."""
    graphs = llm.engine.runner.graphs
    if graphs is None or graphs.static:
        return
    with torch.inference_mode():  # as when the engine's forward captures
        for size in graphs.sizes:
            if size not in graphs.graphs:
                graphs._capture(size)


# ------------------------------------------------------------------------ speculation
def smollm2_for(stage: Stage):
    """(model, tokenizer, prompts-maker, label): the real SmolLM2 where present, else its shape."""
    real = stage.meta.get("smollm2_dir")
    if real is not None:
        from transformers import AutoTokenizer

        from engine.model_hub import load_causal_lm

        return load_causal_lm(real, dtype=stage.dtype).to(stage.device), AutoTokenizer.from_pretrained(real), True
    shape = stage.shapes["smollm2-135m"]
    return random_model(shape, stage.dtype, stage.device, seed=4), word_tokenizer(shape.vocab), False


def variant(base, **overrides):
    """Another engine over the same prepared weights (own KV cache, own graphs)."""
    from engine import LLM
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    cfg = base.engine.config
    config = EngineConfig(model=cfg.model, device=cfg.device, dtype=cfg.dtype,
                          kv_cache_memory_bytes=cfg.kv_cache_memory_bytes, **overrides)
    return LLM.from_engine(LLMEngine(config, model=base.engine.model, tokenizer=base.engine.tokenizer))


def speculation(stage: Stage) -> None:
    """Batch 64: n-gram and suffix speculation (adaptive k and fixed k) vs none, same outputs."""
    from engine import SamplingParams

    model, tokenizer, real = smollm2_for(stage)
    num, max_tokens = (4, 6) if stage.dry else (64, 128)
    base = engine_over(model, tokenizer, stage.device, max_num_seqs=num,
                       kv_cache_memory_bytes=(64 << 20) if stage.dry else (4 << 30))
    if real:
        from bench.spec_workloads import extraction_workload

        prompts = [base.engine.apply_chat_template([{"role": "user", "content": p}]) for p in extraction_workload(num)]
    else:  # a record template with varying fields, so the random model's prompts repeat structure
        vocab = stage.shapes["smollm2-135m"].vocab
        template = random_prompts(1, 12, vocab, seed=5)[0]
        prompts = [template + random_prompts(1, 4, vocab, seed=100 + i)[0] + template for i in range(num)]
    stage.put("workload", f"{num} requests, max_tokens {max_tokens}, greedy; "
                          + ("extraction prompts, real SmolLM2" if real else "random SmolLM2-shape model "
                             "(acceptance reflects its repetitive outputs, not a real model's)"))
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    configs = [("none", None), ("ngram auto", {"method": "ngram"}), ("suffix auto", {"method": "suffix"}),
               ("ngram k=4", {"method": "ngram", "num_speculative_tokens": 4}),
               ("suffix k=8", {"method": "suffix", "num_speculative_tokens": 8})]
    if stage.dry:  # each proposer once, adaptive and fixed k once
        configs = [configs[0], configs[2], configs[3]]
    reference, base_rate = None, None
    for name, cfg in configs:
        if stage.left() < (5 if stage.dry else 12):
            stage.summary(f"{name}: skipped (out of time)")
            continue
        llm = base if cfg is None else variant(base, max_num_seqs=num, speculative_config=cfg)
        llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm-up
        precapture(llm)
        stats = llm.engine.stats
        for key in list(stats):
            stats[key] = 0
        stage.sync()
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        stage.sync()
        seconds = time.perf_counter() - start
        tokens = [o.outputs[0].token_ids for o in outs]
        total = sum(len(t) for t in tokens)
        reference = reference or tokens
        rate = total / seconds
        base_rate = base_rate or rate
        drafted, accepted = stats.get("spec_draft_tokens", 0), stats.get("spec_accepted_tokens", 0)
        record = {"tok_s": rate, "vs_none": rate / base_rate, "tokens": total, "seconds": seconds,
                  "draft_tokens": drafted, "accepted_tokens": accepted, "steps": stats.get("steps", 0),
                  "identical_to_none": sum(a == b for a, b in zip(tokens, reference))}
        stage.add("runs", name, record)
        stage.summary(f"{name}: {rate:.0f} tok/s = {record['vs_none']:.2f}x none; accepted {accepted}/{drafted} "
                      f"drafts; {record['identical_to_none']}/{num} outputs identical to none")
        if llm is not base:
            del llm
        free_memory(stage)


# --------------------------------------------------------------------------- priority
def priority(stage: Stage) -> None:
    """Interactive requests arriving while bulk work fills the batch, in shared steps (engine
    level, no Redis): interactive latency vs an idle engine, bulk tokens/s vs bulk alone."""
    from engine import SamplingParams

    model, tokenizer, real = smollm2_for(stage)
    seqs = 8 if stage.dry else 64
    n_inter, inter_tokens, bulk_tokens = (3, 4, 16) if stage.dry else (16, 32, 256)
    gap_s, window_s = (0.2, 0.5) if stage.dry else (0.25, 3.0)
    llm = engine_over(model, tokenizer, stage.device, max_num_seqs=seqs, scheduling_policy="priority",
                      reserved_seqs=max(1, seqs // 16), urgent_only_steps=0,
                      kv_cache_memory_bytes=(64 << 20) if stage.dry else (8 << 30))
    engine = llm.engine
    vocab = engine.vocab_size
    inter_params = SamplingParams(temperature=0, max_tokens=inter_tokens, ignore_eos=True)
    bulk_params = SamplingParams(temperature=0, max_tokens=bulk_tokens, ignore_eos=True)
    inter_prompts = random_prompts(n_inter, 8 if stage.dry else 64, vocab, seed=7)
    bulk: list = []

    def top_up() -> None:
        running = sum(1 for r in bulk if not r.is_finished)
        for i in range(seqs - running):
            request = engine.make_request(random_prompts(1, 8 if stage.dry else 128, vocab, seed=len(bulk))[0],
                                          params=bulk_params, request_id=f"bulk-{len(bulk)}", priority=1)
            engine.add(request)
            bulk.append(request)

    def bulk_done() -> int:
        return sum(r.metrics.num_output_tokens for r in bulk)

    def wave(with_bulk: bool, tag: str) -> list[float]:
        """Interactive arrivals every ``gap_s``; their latencies (arrival to last token)."""
        pending = list(enumerate(inter_prompts))
        start, live, latencies = time.perf_counter(), [], []
        while pending or live:
            now = time.perf_counter()
            while pending and now - start >= pending[0][0] * gap_s:
                i, prompt = pending.pop(0)
                request = engine.make_request(prompt, params=inter_params, request_id=f"{tag}-{i}", priority=0)
                live.append((request, time.perf_counter()))
                engine.add(request)
            if with_bulk:
                top_up()
            if engine.has_unfinished():
                engine.step()
            else:
                time.sleep(0.001)
            for request, arrived in [x for x in live if x[0].is_finished]:
                latencies.append(time.perf_counter() - arrived)
                live.remove((request, arrived))
        return latencies

    def bulk_alone(seconds: float) -> float:
        t0, n0 = time.perf_counter(), bulk_done()
        while time.perf_counter() - t0 < seconds:
            top_up()
            engine.step()
        return (bulk_done() - n0) / (time.perf_counter() - t0)

    precapture(llm)
    wave(False, "warm")
    idle = wave(False, "idle")
    stage.put("idle_latency_s", idle)
    alone_before = bulk_alone(window_s)
    t0, n0 = time.perf_counter(), bulk_done()
    loaded = wave(True, "loaded")
    mixed = (bulk_done() - n0) / (time.perf_counter() - t0)
    alone_after = bulk_alone(window_s)
    for request in bulk:
        if not request.is_finished:
            engine.abort(request.request_id)
    alone = (alone_before + alone_after) / 2
    p = lambda xs, q: sorted(xs)[min(len(xs) - 1, round(q * (len(xs) - 1)))]  # noqa: E731
    record = {"model": "real SmolLM2" if real else "random SmolLM2 shape", "max_num_seqs": seqs,
              "interactive": f"{n_inter} x {inter_tokens} tokens, one every {gap_s}s",
              "idle_p50_s": p(idle, 0.5), "idle_p99_s": p(idle, 0.99), "loaded_p50_s": p(loaded, 0.5),
              "loaded_p99_s": p(loaded, 0.99), "loaded_latency_s": loaded,
              "bulk_alone_tok_s": alone, "bulk_before_tok_s": alone_before, "bulk_after_tok_s": alone_after,
              "bulk_mixed_tok_s": mixed}
    record["latency_ratio_p50"] = record["loaded_p50_s"] / record["idle_p50_s"]
    record["latency_ratio_p99"] = record["loaded_p99_s"] / record["idle_p99_s"]
    record["bulk_ratio"] = mixed / alone
    for key, value in record.items():
        stage.put(key, value)
    stage.summary(f"interactive p50 {record['loaded_p50_s'] * 1e3:.0f} ms / p99 {record['loaded_p99_s'] * 1e3:.0f} ms "
                  f"under bulk = {record['latency_ratio_p50']:.2f}x / {record['latency_ratio_p99']:.2f}x idle "
                  f"(goal <= 1.5x)")
    stage.summary(f"bulk {mixed:.0f} tok/s with interactive = {record['bulk_ratio']:.2f}x bulk alone "
                  f"({alone:.0f} tok/s; goal >= 0.9x)")


# ------------------------------------------------------------------------- KV memory
def kv_memory(stage: Stage) -> None:
    """KV-cache capacity at the default gpu_memory_utilization, and peak memory over a full batch."""
    from engine import SamplingParams

    seqs, prompt_len, new_tokens = (4, 16, 4) if stage.dry else (256, 512, 16)
    for shape_name in ("llama-8b",) if stage.dry else ("llama-8b", "smollm2-135m", "llama-1b"):
        if stage.left() < (5 if stage.dry else 12):
            stage.summary(f"{shape_name}: skipped (out of time)")
            continue
        shape = stage.shapes[shape_name]
        if stage.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        model = random_model(shape, stage.dtype, stage.device, seed=6)
        llm = engine_over(model, word_tokenizer(shape.vocab), stage.device, max_num_seqs=seqs)
        engine = llm.engine
        mem = engine.memory
        useful = seqs * (-(-engine.max_model_len // engine.config.block_size) + 1)
        record = {"gpu_memory_utilization": engine.config.gpu_memory_utilization, "weights_bytes": mem.weights_bytes,
                  "kv_bytes": mem.kv_cache_bytes, "kv_blocks": mem.num_blocks, "kv_tokens": mem.num_blocks * mem.block_size,
                  "capped_at_max_num_seqs_x_context": mem.num_blocks == useful, "max_model_len": engine.max_model_len}
        stage.add("models", shape_name, record)
        outs = llm.generate(random_prompts(seqs, prompt_len, shape.vocab, seed=8),
                            SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True), use_tqdm=False)
        record["full_batch_ok"] = all(len(o.outputs[0].token_ids) == new_tokens for o in outs)
        if stage.device == "cuda":
            free, total = torch.cuda.mem_get_info()
            record.update(peak_allocated=torch.cuda.max_memory_allocated(), peak_reserved=torch.cuda.max_memory_reserved(),
                          total=total, free_after=free)
            record["peak_reserved_fraction"] = record["peak_reserved"] / total
        stage.save()
        gib = 2**30
        stage.summary(f"{shape_name}: weights {mem.weights_bytes / gib:.1f} GiB, KV {mem.kv_cache_bytes / gib:.1f} GiB = "
                      f"{record['kv_tokens']:,} tokens ({record['kv_tokens'] // max(engine.max_model_len, 1)} full "
                      f"{engine.max_model_len}-token contexts)"
                      + (", capped by max_num_seqs x context" if record["capped_at_max_num_seqs_x_context"] else "")
                      + (f"; peak reserved {record['peak_reserved'] / gib:.1f} of {record['total'] / gib:.1f} GiB "
                         f"({record['peak_reserved_fraction']:.0%}) over a batch of {seqs}" if "total" in record else ""))
        del llm, engine, model, outs
        free_memory(stage)


STAGES: dict[str, Callable[[Stage], None]] = {
    "probe": probe, "kernels": kernels, "parity": parity, "throughput": throughput, "attention": attention,
    "speculation": speculation, "priority": priority, "kv_memory": kv_memory,
}
