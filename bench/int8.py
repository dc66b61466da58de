"""int8 vs fp32 in one run: batch-1 speed (alternated), quality, and the kernels behind the choice.

Quality, as issue #17 asks: the mean token log-likelihood of a fixed held-out text (teacher
forced through the engine's own forward) under fp32 and int8, and greedy agreement over 32 chat
prompts (identical outputs, and the mean fraction of tokens before the first divergence).
The kernel table times one linear of each decoder-layer shape and the head at one row, for the
fp32 oneDNN linear, the int8 kernel used, and torch's weight-only int8/int4 kernels.

    python bench/int8.py
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
from bench.workload import long_tail_workload  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.model_hub import DEFAULT_MODEL, resolve_model  # noqa: E402
from engine.sequence import Sequence  # noqa: E402

# Held out: not a chat prompt of the workload, plain English prose (public domain: the opening of
# Jerome K. Jerome's "Three Men in a Boat", 1889, and of Lincoln's Gettysburg Address, 1863).
HELD_OUT = (
    "There were four of us - George, and William Samuel Harris, and myself, and Montmorency. We were "
    "sitting in my room, smoking, and talking about how bad we were - bad from a medical point of view "
    "I mean, of course. We were all feeling seedy, and we were getting quite nervous about it. Harris "
    "said he felt such extraordinary fits of giddiness come over him at times, that he hardly knew what "
    "he was doing; and then George said that he had fits of giddiness too, and hardly knew what he was "
    "doing. With me, it was my liver that was out of order. I knew it was my liver that was out of "
    "order, because I had just been reading a patent liver-pill circular, in which were detailed the "
    "various symptoms by which a man could tell when his liver was out of order. I had them all.\n\n"
    "Four score and seven years ago our fathers brought forth on this continent, a new nation, conceived "
    "in Liberty, and dedicated to the proposition that all men are created equal. Now we are engaged in "
    "a great civil war, testing whether that nation, or any nation so conceived and so dedicated, can "
    "long endure. We are met on a great battle-field of that war. We have come to dedicate a portion of "
    "that field, as a final resting place for those who here gave their lives that that nation might "
    "live. It is altogether fitting and proper that we should do this."
)


@torch.inference_mode()
def mean_loglik(engine: LLMEngine, text: str) -> tuple[float, int]:
    """Mean log p(token | prefix) over the text's tokens after the first, via the engine's forward."""
    ids = engine.tokenizer.encode(text)
    request = engine.make_request(ids, params=SamplingParams(max_tokens=1))
    seq = Sequence(request=request, index=0, token_ids=list(ids), num_prompt_tokens=len(ids))
    engine.block_manager.allocate(seq, len(ids))
    try:
        inputs = engine.runner.layout([(seq.block_table, ids, 0)], list(range(len(ids) - 1)), [])
        logits = engine.runner.forward(inputs)
    finally:
        engine.block_manager.free(seq)
    logp = torch.log_softmax(logits.float(), dim=-1)
    target = torch.tensor(ids[1:])
    return float(logp.gather(1, target[:, None]).mean()), len(ids) - 1


def greedy(llm: LLM, prompts, tokens: int) -> list[list[int]]:
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=tokens), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def agreement(a: list[list[int]], b: list[list[int]]) -> tuple[int, float]:
    same = sum(x == y for x, y in zip(a, b))
    fractions = []
    for x, y in zip(a, b):
        k = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
        fractions.append(k / max(len(x), len(y), 1))
    return same, statistics.mean(fractions)


def batch1_rate(llm: LLM, prompts, tokens: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    start = time.perf_counter()
    for p in prompts:
        llm.generate([p], params, use_tqdm=False)
    return len(prompts) * tokens / (time.perf_counter() - start)


def kernel_table() -> list[str]:
    """Microseconds per call at one row, one linear per shape (the reasons in engine.quantization)."""
    from engine.cpu_linear import PackedLinear
    from engine.quantization import Int8DynamicLinear

    def best(fn, n: int = 20) -> float:
        for _ in range(3):
            fn()
        times = []
        for _ in range(n):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return sorted(times)[n // 5] * 1e6

    lines = [f"{'shape (out x in)':<18}{'fp32 oneDNN':>12}{'int8 dynamic':>13}{'int8 w-only':>12}{'int4 w-only':>12}  (us, 1 row)"]
    for n, k in ((960, 576), (3072, 576), (576, 1536), (49152, 576)):
        lin = torch.nn.Linear(k, n, bias=False)
        x = torch.randn(1, k)
        packed, q8 = PackedLinear(lin), Int8DynamicLinear(lin)
        w8 = torch.randint(-127, 127, (n, k), dtype=torch.int8)
        s8 = torch.rand(n)
        w4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.randint(0, 16, (n, k), dtype=torch.int32), 1)
        sz = torch.rand(k // 64, n, 2)
        row = [best(lambda: packed(x)), best(lambda: q8(x)),
               best(lambda: torch.ops.aten._weight_int8pack_mm(x, w8, s8)),
               best(lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(x, w4, 64, sz))]
        lines.append(f"{f'{n} x {k}':<18}" + "".join(f"{v:12.0f} " for v in row))
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--compile-step", action=argparse.BooleanOptionalAction, default=True,
                        help="both engines through the compiled decode step (int8 by handle, as eager)")
    parser.add_argument("--speed-only", action="store_true", help="skip the quality sections and the kernel table")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    path = resolve_model(args.model)
    print(f"# python bench/int8.py {' '.join(sys.argv[1:])}")
    print(describe_machine())
    # float32 named: "auto" is bfloat16 on CPUs with native bf16, and int8 is measured against fp32.
    fp32 = LLM(path, device="cpu", max_num_seqs=64, dtype="float32", compile_step=args.compile_step)
    int8 = LLM(path, device="cpu", max_num_seqs=64, dtype="float32", quantization="int8",
               compile_step=args.compile_step)
    print(f"fp32: {fp32.engine.runner.describe()}\nint8: {int8.engine.runner.describe()}")
    convs, _ = long_tail_workload(args.num_prompts, 2)
    prompts = [fp32.engine.apply_chat_template(c) for c in convs]
    if not args.speed_only:
        quality(fp32, int8, prompts, args.tokens)
    speed(fp32, int8, prompts[:6], args)
    if not args.speed_only:
        print("kernels:")
        for line in kernel_table():
            print("  " + line)
    print(describe_machine().replace("machine:", "machine at the end:"))


def quality(fp32: LLM, int8: LLM, prompts, tokens: int) -> None:
    """Held-out log-likelihood, greedy agreement and batch coupling of int8 against fp32."""
    ll32, n = mean_loglik(fp32.engine, HELD_OUT)
    ll8, _ = mean_loglik(int8.engine, HELD_OUT)
    print(f"held-out text ({n} scored tokens): mean token log-likelihood fp32 {ll32:.4f}, int8 {ll8:.4f} "
          f"({(ll8 - ll32) / abs(ll32):+.2%}); perplexity {torch.tensor(-ll32).exp():.2f} vs {torch.tensor(-ll8).exp():.2f}")
    out32, out8 = greedy(fp32, prompts, tokens), greedy(int8, prompts, tokens)
    same, frac = agreement(out32, out8)
    print(f"greedy agreement over {len(prompts)} chat prompts, {tokens} tokens: {same}/{len(prompts)} identical; "
          f"mean {frac:.0%} of each output before the first differing token")
    alone = greedy(int8, prompts[:8], tokens)
    batched = out8[:8]
    print(f"int8 batch coupling: {sum(a == b for a, b in zip(alone, batched))}/8 outputs identical run in a "
          "batch of 32 vs 8 (fp32 is batch-invariant in these tests)")


def speed(fp32: LLM, int8: LLM, b1, args) -> None:
    """Batch-1 tok/s of both engines, alternated rounds, and the median ratio."""
    batch1_rate(fp32, b1[:1], 8), batch1_rate(int8, b1[:1], 8)  # warm-up
    ratios = []
    for r in range(args.rounds):
        order = [("fp32", fp32), ("int8", int8)] if r % 2 == 0 else [("int8", int8), ("fp32", fp32)]
        rates = {name: batch1_rate(llm, b1, args.tokens) for name, llm in order}
        ratios.append(rates["int8"] / rates["fp32"])
        print(f"round {r + 1} batch 1 (6 prompts x {args.tokens} tokens): fp32 {rates['fp32']:.1f} tok/s, "
              f"int8 {rates['int8']:.1f} tok/s, ratio {ratios[-1]:.2f}x", flush=True)
    print(f"batch 1 int8 / fp32: median {statistics.median(ratios):.2f}x over {args.rounds} rounds")


if __name__ == "__main__":
    main()
