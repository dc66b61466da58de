"""Where one decode step goes, at batch 1, 8 and 64: scheduler, prepare, forward, sampler,
detokenizer and the loop around them, so the overhead left outside the forward is a number.

Two passes per batch size over the real code path of ``LLMEngine.step``:
1. phases: the engine's own methods are wrapped with timers (scheduler.schedule, runner.prepare,
   runner.forward, _sample, _append_tokens); "loop" is what ``step()`` and the caller's output
   handling cost besides them;
2. forward split (eager only): timers around every linear, norm, rotary and attention call
   inside the decoder layers, plus embedding and head; "other" is the forward's remaining Python
   and glue. The timers themselves cost a few microseconds each, so pass 2's forward is a bit
   slower than pass 1's; its shares are what matter.

    python bench/step_profile.py                       # batch 1, 8, 64: eager vs compiled (CUDA: vs captured)
    python bench/step_profile.py --rounds 3 --no-split # alternated rounds, medians and ratios
    python bench/step_profile.py --batches 1 --steps 64 --quantization int8
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Callable, Iterator

_HERE = os.path.dirname(os.path.abspath(__file__))
if sys.path and os.path.abspath(sys.path[0] or ".") == _HERE:
    sys.path.pop(0)  # bench/queue.py must not shadow the standard library's queue
sys.path.insert(0, os.path.dirname(_HERE))

import torch  # noqa: E402

from bench.machine import describe_machine  # noqa: E402
from engine import SamplingParams  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.quantization import Int8DynamicLinear  # noqa: E402
from engine.model_hub import DEFAULT_MODEL, resolve_model  # noqa: E402

PHASES = ("scheduler", "prepare", "forward", "sampler", "detokenizer", "loop")


class Timers:
    """Accumulated seconds per name."""

    def __init__(self) -> None:
        self.total: dict[str, float] = defaultdict(float)

    def wrap(self, name: str, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.total[name] += time.perf_counter() - start

        return timed


@contextmanager
def patched(obj, attr: str, value) -> Iterator[None]:
    had = attr in vars(obj) if hasattr(obj, "__dict__") else False
    old = getattr(obj, attr)
    setattr(obj, attr, value)
    try:
        yield
    finally:
        if had or not hasattr(obj, "__dict__"):
            setattr(obj, attr, old)
        else:
            delattr(obj, attr)


def start_batch(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> None:
    """Admit ``prompts`` and step until every one has finished its prefill (all decoding)."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add(engine.make_request(prompt, params=params, request_id=f"profile-{time.monotonic_ns()}-{i}"))
    while any(seq.num_computed_tokens < seq.num_prompt_tokens for seq in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()


def drain(engine: LLMEngine) -> None:
    for request_id in list(engine.requests):
        engine.abort(request_id)


def run_steps(engine: LLMEngine, steps: int) -> float:
    """``steps`` decode steps, each followed by what ``LLM.generate`` does with the outputs."""
    start = time.perf_counter()
    for _ in range(steps):
        for request in engine.step():
            if request.is_finished:
                engine.make_output(request)
    if engine.runner.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def profile_phases(engine: LLMEngine, prompts, steps: int) -> dict[str, float]:
    """Seconds per step of each phase (pass 1)."""
    timers = Timers()
    start_batch(engine, prompts, steps + 8)
    run_steps(engine, 2)  # warm-up (capture, allocator)
    with (
        patched(engine.scheduler, "schedule", timers.wrap("scheduler", engine.scheduler.schedule)),
        patched(engine.runner, "prepare", timers.wrap("prepare", engine.runner.prepare)),
        patched(engine.runner, "forward", timers.wrap("forward", engine.runner.forward)),
        patched(engine, "_sample", timers.wrap("sampler", engine._sample)),
        patched(engine, "_append_tokens", timers.wrap("detokenizer", engine._append_tokens)),
    ):
        wall = run_steps(engine, steps)
    drain(engine)
    result = {name: timers.total[name] / steps for name in PHASES if name != "loop"}
    result["loop"] = wall / steps - sum(result.values())
    result["step"] = wall / steps
    return result


def profile_forward(engine: LLMEngine, prompts, steps: int) -> dict[str, float]:
    """Seconds per step inside the forward, by kind of op (pass 2, eager fused layers only)."""
    from engine import fused_layers

    model = engine.model
    layers = [m for m in model.modules() if isinstance(m, fused_layers.FusedDecoderLayer)]
    if not layers:
        return {}
    timers = Timers()
    handles = []

    def hook_module(module: torch.nn.Module, name: str) -> None:
        state = {}

        def pre(_m, _a):
            state["t"] = time.perf_counter()

        def post(_m, _a, _o):
            timers.total[name] += time.perf_counter() - state["t"]

        handles.append(module.register_forward_pre_hook(pre))
        handles.append(module.register_forward_hook(post))

    for layer in layers:
        for attr in ("qkv_proj", "gate_up_proj"):  # o_proj and down_proj: timed with their residual add below
            hook_module(getattr(layer, attr), "linears")
    hook_module(model.get_input_embeddings(), "embedding")
    hook_module(model.get_output_embeddings(), "lm_head")
    inner = model.model if hasattr(model, "model") else model
    if hasattr(inner, "norm"):
        hook_module(inner.norm, "norms")
    if hasattr(inner, "rotary_emb"):
        hook_module(inner.rotary_emb, "rotary")
    start_batch(engine, prompts, steps + 8)
    run_steps(engine, 2)
    forward = engine.runner.forward
    with (
        patched(fused_layers, "_rms_norm", timers.wrap("norms", fused_layers._rms_norm)),
        patched(fused_layers, "_rotate", timers.wrap("rotary", fused_layers._rotate)),
        patched(fused_layers, "_add_linear", timers.wrap("linears", fused_layers._add_linear)),
        patched(fused_layers, "paged_attention_flat", timers.wrap("attention", fused_layers.paged_attention_flat)),
        patched(engine.runner, "forward", timers.wrap("forward", forward)),
        patched(engine.runner, "graphs", None),  # the split needs the eager ops
    ):
        run_steps(engine, steps)
    for handle in handles:
        handle.remove()
    drain(engine)
    result = {name: value / steps for name, value in timers.total.items()}
    result["other"] = result["forward"] - sum(v for k, v in result.items() if k != "forward")
    return result


def weight_floor(engine: LLMEngine, batch: int, passes: int = 10) -> tuple[float, int]:
    """Seconds for every linear of the model (the head included) run once, in order, on ``batch``
    rows and nothing else, and the bytes of weights they read: the floor of a decode step.

    This is the time the weights take to stream through the CPU with the kernels the engine
    uses; a step can only beat it by reading fewer bytes (quantization), not by less overhead.
    """
    linears = [m for m in engine.model.modules()
               if hasattr(m, "in_features") and hasattr(m, "out_features") and not list(m.children())]
    dtype = engine.runner.config.dtype
    inputs = {m.in_features: torch.randn(batch, m.in_features, dtype=dtype) for m in linears}
    float_bytes = torch.empty(0, dtype=dtype).element_size()
    weight_bytes = sum(m.in_features * m.out_features * (1 if isinstance(m, Int8DynamicLinear) else float_bytes)
                       for m in linears)
    with torch.inference_mode():
        for _ in range(2):
            for m in linears:
                m(inputs[m.in_features])
        start = time.perf_counter()
        for _ in range(passes):
            for m in linears:
                m(inputs[m.in_features])
    return (time.perf_counter() - start) / passes, weight_bytes


def print_floor(batch: int, step: float, floor: float, weight_bytes: int) -> None:
    print(f"  weight floor at batch {batch}: {floor * 1e3:.2f} ms ({weight_bytes / 1e6:.0f} MB of weights at "
          f"{weight_bytes / floor / 1e9:.1f} GB/s) = {batch / floor:.1f} tok/s at most; "
          f"the step is {step / floor:.2f}x the floor")


def fmt_ms(seconds: float) -> str:
    return f"{seconds * 1e3:8.2f}"


def print_phases(label: str, batch: int, phases: dict[str, float]) -> None:
    step = phases["step"]
    overhead = step - phases["forward"]
    print(f"\n{label}, batch {batch}: {step * 1e3:.2f} ms/step = {batch / step:.1f} tok/s")
    print(f"  {'phase':<12}{'ms/step':>8}  share")
    for name in PHASES:
        print(f"  {name:<12}{fmt_ms(phases[name])}  {phases[name] / step:5.1%}")
    print(f"  non-forward overhead: {overhead * 1e3:.2f} ms = {overhead / step:.1%} of the step")


def print_forward(batch: int, split: dict[str, float]) -> None:
    if not split:
        print("  (no fused decoder layers: forward split not available)")
        return
    fwd = split["forward"]
    print(f"  forward split at batch {batch} (timed pass, {fwd * 1e3:.2f} ms):")
    for name in ("embedding", "norms", "rotary", "linears", "attention", "lm_head", "other"):
        if name in split:
            print(f"    {name:<10}{fmt_ms(split[name])}  {split[name] / fwd:5.1%}")


def build_engines(args, modes: list[str], max_batch: int) -> dict[str, LLMEngine]:
    """One engine per mode over the same loaded weights; prints each one's start-up time (the
    compiled one's includes compiling its decode step, or loading it from inductor's cache)."""
    from engine.config import EngineConfig

    path = resolve_model(args.model)
    engines: dict[str, LLMEngine] = {}
    base: LLMEngine | None = None
    for mode in modes:
        start = time.perf_counter()
        config = EngineConfig(model=path, device=args.device, dtype=args.dtype, max_num_seqs=max_batch,
                              quantization=args.quantization, decode_capture=(mode == "captured"),
                              compile_step=(mode == "compiled"))
        engine = LLMEngine(config, model=base.model if base else None, tokenizer=base.tokenizer if base else None)
        base = base or engine
        engines[mode] = engine
        compiled = engine.runner.compiled
        extra = f"; decode step compiled in {compiled.warmup_s:.1f} s" if compiled is not None else ""
        print(f"=== {mode}: {engine.runner.describe()}; engine start {time.perf_counter() - start:.1f} s{extra}")
    return engines


def median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--batches", default="1,8,64")
    parser.add_argument("--steps", type=int, default=32, help="decode steps timed per batch size")
    parser.add_argument("--rounds", type=int, default=1, help="alternated rounds over the modes (medians reported)")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--modes", default=None,
                        help="comma list of eager, captured, compiled (default: eager,captured on CUDA; eager,compiled on the CPU)")
    parser.add_argument("--no-split", action="store_true", help="skip the eager forward split (faster)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None, help="float32 on CPU, bfloat16 on CUDA by default")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    modes = (args.modes or ("eager,captured" if args.device.startswith("cuda") else "eager,compiled")).split(",")
    print(describe_machine())
    print(f"model {args.model}, quantization {args.quantization or 'none'}, {args.steps} decode steps per batch, "
          f"prompts of {args.prompt_len} tokens, {args.rounds} alternated rounds, {torch.get_num_threads()} threads")
    torch.manual_seed(0)
    engines = build_engines(args, modes, max(batches))
    vocab = engines[modes[0]].vocab_size
    steps: dict[tuple[str, int], list[float]] = defaultdict(list)
    floors: dict[int, list[float]] = defaultdict(list)
    weight_bytes = 0
    for round_ in range(args.rounds):
        for batch in batches:
            prompts = [torch.randint(100, vocab - 100, (args.prompt_len,)).tolist() for _ in range(batch)]
            for mode in modes:
                phases = profile_phases(engines[mode], prompts, args.steps)
                steps[(mode, batch)].append(phases["step"])
                if round_ == args.rounds - 1:
                    print_phases(f"{mode} (round {round_ + 1})", batch, phases)
                    if mode == "eager" and args.device == "cpu" and not args.no_split:
                        print_forward(batch, profile_forward(engines[mode], prompts, args.steps))
            if args.device == "cpu":
                floor, weight_bytes = weight_floor(engines[modes[0]], batch)
                floors[batch].append(floor)
    print(f"\n=== medians of {args.rounds} alternated rounds (ms/step; ratio = {modes[0]} / other, > 1 is faster)")
    header = f"{'batch':>5}" + "".join(f"{m:>11}" for m in modes) + "".join(f"{m + ' x':>13}" for m in modes[1:])
    if floors:
        header += f"{'floor':>9}" + "".join(f"{m + '/floor':>15}" for m in modes)
    print(header)
    for batch in batches:
        med = {m: median(steps[(m, batch)]) for m in modes}
        row = f"{batch:>5}" + "".join(f"{med[m] * 1e3:>11.2f}" for m in modes)
        row += "".join(f"{med[modes[0]] / med[m]:>12.2f}x" for m in modes[1:])
        if floors:
            floor = median(floors[batch])
            row += f"{floor * 1e3:>9.2f}" + "".join(f"{med[m] / floor:>14.2f}x" for m in modes)
        print(row)
    if floors:
        print(f"(floor: every linear once on the batch's rows, {weight_bytes / 1e6:.0f} MB of weights, with the engine's own kernels)")
    for batch in batches:  # the spread behind each median (the cores are shared)
        print(f"batch {batch} rounds (ms/step): " + "; ".join(
            f"{m} " + " ".join(f"{v * 1e3:.1f}" for v in steps[(m, batch)]) for m in modes))
    print(f"load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
