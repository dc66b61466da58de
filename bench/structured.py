"""Structured output, side by side in one run on SmolLM2-135M-Instruct (CPU by default).

64 JSON-extraction requests (``bench.spec_workloads.extraction_workload``: a short bio in, a
record with five keys out) with one schema, greedy, at batch 1 (``max_num_seqs=1``: one request
after another) and at batch 16:

- unconstrained: the same prompts, no grammar (the baseline of every ratio);
- constrained, ``forced_token_drafts=False``: the grammar's mask every step, forced positions
  decided by the grammar (no noise drawn for them), one token per step;
- constrained with forced-token drafting: where the grammar forces the text that follows, its
  tokens are proposed as drafts and verified in one forward (adaptive k decides how many);
- the peer: Hugging Face ``generate`` with xgrammar's own logits processor
  (``xgrammar.contrib.hf.LogitsProcessor``) on the same compiled schema, batches of the same size.

tokens/s = output tokens / wall seconds of the whole 64-request run. Goals (issue #13):
constrained >= 0.9x unconstrained; with forced drafting >= 1.3x unconstrained at batch 1 and
>= 1.1x at batch 16. Every constrained record is also parsed and validated (jsonschema).

    python -m bench.structured                 # ~10 min on 2 CPU cores
    python -m bench.structured --batches 16 --requests 32
"""

from __future__ import annotations

import argparse
import json
import time

import jsonschema
import torch

from bench.machine import describe_machine
from bench.spec_workloads import extraction_workload
from engine import LLM, LLMEngine, SamplingParams
from engine.config import EngineConfig
from engine.model_hub import DEFAULT_MODEL, load_causal_lm, resolve_model

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"type": "string"},
        "occupation": {"type": "string"},
        "hobby": {"type": "string"},
    },
    "required": ["name", "age", "city", "occupation", "hobby"],
    "additionalProperties": False,
}
KV_BYTES = 1 << 30


def engine_like(base: LLM, **overrides) -> LLM:
    """Another engine over the already-loaded weights."""
    overrides.setdefault("kv_cache_memory_bytes", KV_BYTES)
    config = EngineConfig(model=base.engine.config.model, device=base.engine.config.device, **overrides)
    return LLM.from_engine(LLMEngine(config, model=base.engine.model, tokenizer=base.engine.tokenizer))


def run_engine(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[float, int, list]:
    """(seconds, output tokens, outputs) of one ``generate`` over every prompt, after a warm-up
    that also compiles the schema and builds the forced-token drafter (not timed)."""
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4,
                                             structured_outputs=params.structured_outputs), use_tqdm=False)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return seconds, sum(len(o.outputs[0].token_ids) for o in outs), outs


def valid_records(outs) -> int:
    ok = 0
    for out in outs:
        try:
            jsonschema.validate(json.loads(out.outputs[0].text), SCHEMA)
            ok += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    return ok


def run_hf(model, tokenizer, compiled, prompts: list[list[int]], batch: int, max_tokens: int,
           eos: set[int]) -> tuple[float, int, int]:
    """HF ``generate`` + xgrammar's logits processor, greedy, ``batch`` prompts at a time (left
    padding): (seconds, output tokens up to EOS, valid records)."""
    import xgrammar as xgr

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos)

    def generate(chunk: list[list[int]]):
        width = max(len(p) for p in chunk)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk], device=model.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device=model.device)
        processor = xgr.contrib.hf.LogitsProcessor([compiled] * len(chunk))
        out = model.generate(ids, attention_mask=mask, max_new_tokens=max_tokens, do_sample=False,
                             logits_processor=[processor], eos_token_id=sorted(eos), pad_token_id=pad)
        return out[:, width:].tolist()

    generate(prompts[:1])  # warm-up
    start = time.perf_counter()
    rows = []
    for i in range(0, len(prompts), batch):
        rows.extend(generate(prompts[i : i + batch]))
    seconds = time.perf_counter() - start
    tokens, ok = 0, 0
    for row in rows:
        n = next((j + 1 for j, t in enumerate(row) if t in eos), len(row))
        tokens += n
        text = tokenizer.decode(row[:n], skip_special_tokens=True)
        try:
            jsonschema.validate(json.loads(text), SCHEMA)
            ok += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    return seconds, tokens, ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--no-hf", action="store_true", help="skip the HF generate peer")
    parser.add_argument("--repeats", type=int, choices=(1, 2), default=2,
                        help="2: each engine mode runs twice (A B C C B A), the faster run counts")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()

    print(f"# python -m bench.structured --requests {args.requests} --max-tokens {args.max_tokens} "
          f"--batches {args.batches} --repeats {args.repeats} --device {args.device}")
    print(f"# {describe_machine()}")
    path = resolve_model(args.model)
    base = LLM(path, device=args.device, kv_cache_memory_bytes=KV_BYTES)
    engine = base.engine
    prompts = [engine.apply_chat_template([{"role": "user", "content": p}])
               for p in extraction_workload(args.requests)]
    print(f"model {args.model} on {args.device}; {len(prompts)} extraction requests, one schema "
          f"({len(SCHEMA['properties'])} keys), greedy, max_tokens {args.max_tokens}", flush=True)
    plain = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    constrained = SamplingParams(temperature=0, max_tokens=args.max_tokens, structured_outputs={"json": SCHEMA})

    hf = tokenizer = compiled = None
    if not args.no_hf:

        import xgrammar as xgr

        hf = load_causal_lm(path, dtype=engine.config.dtype).to(args.device).eval()
        tokenizer = engine.tokenizer
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=engine.vocab_size,
                                                  stop_token_ids=sorted(engine.eos_ids))
        compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)

    for batch in [int(b) for b in args.batches.split(",")]:
        print(f"\n== batch {batch} (max_num_seqs={batch}) ==", flush=True)
        rates: dict[str, float] = {}
        modes = [
            ("unconstrained", {}, plain),
            ("constrained, no forced drafts", {"forced_token_drafts": False}, constrained),
            ("constrained + forced-token drafts", {"forced_token_drafts": True}, constrained),
        ]
        # The cores are shared: run A B C, then C B A, and keep each mode's faster run, so load
        # that comes and goes hits every mode alike (both runs are printed).
        order = modes + modes[::-1] if args.repeats == 2 else modes
        for label, config, params in order:
            llm = engine_like(base, max_num_seqs=batch, **config)
            seconds, tokens, outs = run_engine(llm, prompts, params)
            rates[label] = max(rates.get(label, 0.0), tokens / seconds)
            extra = ""
            if params.structured_outputs is not None:
                extra = f", valid records {valid_records(outs)}/{len(outs)}"
                stats = llm.engine.stats
                if stats.get("spec_forced_tokens"):
                    extra += (f", forced drafts {stats['spec_forced_tokens']} "
                              f"(accepted {stats['spec_forced_accepted']}), steps {stats['steps']}")
                else:
                    extra += f", steps {stats['steps']}"
            print(f"{label:36s} {tokens:6d} tokens in {seconds:6.1f}s = {tokens / seconds:6.1f} tok/s{extra}", flush=True)
            del llm, outs
        if hf is not None:
            seconds, tokens, ok = run_hf(hf, tokenizer, compiled, prompts, batch, args.max_tokens, engine.eos_ids)
            rates["hf"] = tokens / seconds
            print(f"{'HF generate + xgrammar processor':36s} {tokens:6d} tokens in {seconds:6.1f}s = "
                  f"{rates['hf']:6.1f} tok/s, valid records {ok}/{len(prompts)}", flush=True)
        base_rate = rates["unconstrained"]
        goal = 1.3 if batch == 1 else 1.1
        no_forced = rates["constrained, no forced drafts"] / base_rate
        forced = rates["constrained + forced-token drafts"] / base_rate
        print("best of each mode: " + ", ".join(f"{k} {v:.1f} tok/s" for k, v in rates.items()))
        print(f"ratio constrained (no forced drafts) / unconstrained: {no_forced:.2f}x (goal >= 0.90x)")
        print(f"ratio constrained + forced drafts / unconstrained:    {forced:.2f}x (goal >= {goal:.2f}x)")
        if "hf" in rates:
            print(f"ratio constrained + forced drafts / HF peer:          "
                  f"{rates['constrained + forced-token drafts'] / rates['hf']:.2f}x")


if __name__ == "__main__":
    main()
