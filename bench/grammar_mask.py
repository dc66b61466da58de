"""Which grammar library: mask time per token for xgrammar and llguidance on this machine.

Both compile the same nested JSON schema for SmolLM2's tokenizer, then walk the tokens of a
valid record, computing the full next-token bitmask before each one (what the sampler needs
every step). Prints compile time and the median / p90 mask time per token.
Run: ``python -m bench.grammar_mask`` (llguidance comes with ``pip install -e ".[bench]"``).

Measured 2026-12-01 on the 2-core CPU: xgrammar compile 4-8 ms, mask median 1 us / p90 4 us;
llguidance matcher 1 ms, mask median 8-9 us / p90 20-33 us (fixed and flexible whitespace).
"""

from __future__ import annotations

import json
import statistics
import time

import torch

from bench.machine import describe_machine
from engine.model_hub import resolve_model

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "role": {"enum": ["engineer", "teacher", "nurse", "chef"]},
        "scores": {"type": "array", "items": {"type": "number"}, "maxItems": 4},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "role", "scores", "address"],
    "additionalProperties": False,
}
RECORD = {"name": "Maya Patel", "age": 34, "role": "nurse", "scores": [1.5, 2, 3.25],
          "address": {"city": "Lisbon", "zip": "1000-001"}}


def _stats(times: list[float]) -> str:
    times = sorted(times)
    return f"median {statistics.median(times) * 1e6:.0f} us, p90 {times[int(0.9 * len(times))] * 1e6:.0f} us"


def main() -> None:
    from transformers import AutoConfig, AutoTokenizer

    path = resolve_model("SmolLM2-135M-Instruct")
    tok = AutoTokenizer.from_pretrained(path)
    vocab = AutoConfig.from_pretrained(path).vocab_size
    tokens = tok.encode(json.dumps(RECORD, separators=(", ", ": ")))
    print(describe_machine())
    print(f"schema: nested (object, array, enum, numbers); record of {len(tokens)} tokens; vocab {vocab}")

    import xgrammar as xgr

    start = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab, stop_token_ids=[tok.eos_token_id])
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    t_info = time.perf_counter() - start
    start = time.perf_counter()
    print(f"xgrammar: tokenizer info {t_info:.2f} s")
    for flexible in (False, True):
        start = time.perf_counter()
        compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=flexible)
        t_compile = time.perf_counter() - start
        bitmask = xgr.allocate_token_bitmask(1, vocab)
        times = []
        for _ in range(3):
            matcher = xgr.GrammarMatcher(compiled)
            for token in tokens:
                start = time.perf_counter()
                matcher.fill_next_token_bitmask(bitmask, 0)
                times.append(time.perf_counter() - start)
                assert matcher.accept_token(token), token
        print(f"  xgrammar, whitespace {'flexible' if flexible else 'fixed   '}: compile {t_compile * 1e3:.0f} ms, "
              f"mask {_stats(times)}")

    import llguidance
    import llguidance.hf
    import llguidance.torch

    start = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab)
    t_info = time.perf_counter() - start
    print(f"llguidance: tokenizer {t_info:.2f} s")
    for flexible in (False, True):
        options = {"whitespace_flexible": flexible, "item_separator": ", ", "key_separator": ": "}
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA), defaults=options)
        start = time.perf_counter()
        matcher = llguidance.LLMatcher(lltok, grammar)
        t_compile = time.perf_counter() - start
        assert not matcher.is_error(), matcher.get_error()
        bitmask = llguidance.torch.allocate_token_bitmask(1, vocab)
        times = []
        for _ in range(3):
            matcher = llguidance.LLMatcher(lltok, grammar)
            for token in tokens:
                start = time.perf_counter()
                llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)
                times.append(time.perf_counter() - start)
                assert matcher.consume_token(token), (token, matcher.get_error())
        print(f"  llguidance, whitespace {'flexible' if flexible else 'fixed   '}: matcher (compile) "
              f"{t_compile * 1e3:.0f} ms, mask {_stats(times)}")

    logits = torch.randn(16, vocab)
    mask = torch.full((16, (vocab + 31) // 32), -1, dtype=torch.int32)
    start = time.perf_counter()
    for _ in range(20):
        xgr.apply_token_bitmask_inplace(logits, mask)
    print(f"xgrammar apply_token_bitmask_inplace, 16 rows: {(time.perf_counter() - start) / 20 * 1e6:.0f} us")


if __name__ == "__main__":
    main()
