"""Structured output on the real SmolLM2-135M-Instruct (issue #13).

Every sampled record parses and validates, with and without speculation; forced-token drafting
changes no greedy output; a grammar that does not compile, or not in time, fails its own request
while the others in the same batch succeed.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from engine import LLM, LLMEngine, SamplingParams
from engine.config import EngineConfig

pytestmark = pytest.mark.slow

#: Nested: objects, an array, enums, integers and a number, every key required. Compact enough
#: that a record is ~40 tokens, bounded so that no sample can run past max_tokens.
SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "name": {"type": "string", "maxLength": 8},
        "kind": {"enum": ["cat", "dog", "bird"]},
        "weight": {"type": "number", "minimum": 0, "maximum": 100},
        "tags": {"type": "array", "items": {"enum": ["small", "big", "old", "new"]}, "maxItems": 2},
        "pos": {
            "type": "object",
            "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9},
                           "y": {"type": "integer", "minimum": -9, "maximum": 9}},
            "required": ["x", "y"],
            "additionalProperties": False,
        },
    },
    "required": ["id", "name", "kind", "weight", "tags", "pos"],
    "additionalProperties": False,
}
NUM_RECORDS = 200
MAX_TOKENS = 96  # a record of SCHEMA is at most ~70 tokens
NEAR_TIE = 1e-4


def engine_like(smol_llm: LLM, **config) -> LLM:
    """An engine of its own (config) sharing the session's loaded SmolLM2 weights."""
    base = smol_llm.engine
    engine_config = EngineConfig(model=base.config.model, device="cpu", dtype=base.config.dtype, max_num_seqs=64, **config)
    return LLM.from_engine(LLMEngine(engine_config, model=base.model, tokenizer=base.tokenizer))


@pytest.fixture(scope="module")
def prompts(smol_llm):
    engine = smol_llm.engine
    return [engine.apply_chat_template([{"role": "user", "content": f"Animal number {i}, as a JSON record."}])
            for i in range(NUM_RECORDS)]


def check_records(outputs) -> None:
    for out in outputs:
        assert out.error is None, out.error
        sample = out.outputs[0]
        assert sample.finish_reason == "stop", (sample.finish_reason, sample.text)
        jsonschema.validate(json.loads(sample.text), SCHEMA)


@pytest.mark.parametrize("speculative", [None, {"method": "ngram"}, {"method": "suffix"}],
                         ids=["no-speculation", "ngram", "suffix"])
def test_sampled_records_all_parse_and_validate(smol_llm, prompts, speculative):
    llm = engine_like(smol_llm, speculative_config=speculative)
    params = SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, structured_outputs={"json": SCHEMA})
    outputs = llm.generate(prompts, params, use_tqdm=False)
    check_records(outputs)  # 200 of 200
    stats = llm.engine.stats
    assert len({o.outputs[0].text for o in outputs}) > NUM_RECORDS // 2  # sampled, not one record
    assert stats["spec_forced_tokens"] > 0 and stats["spec_forced_accepted"] == stats["spec_forced_tokens"]
    if speculative is not None:
        # The proposer's drafts were used too (after the forced ones, or alone).
        assert stats["spec_draft_tokens"] > stats["spec_forced_tokens"]


def test_greedy_is_the_same_with_and_without_forced_drafts(smol_llm, prompts):
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured_outputs={"json": SCHEMA})
    few = prompts[:16]
    plain = engine_like(smol_llm, forced_token_drafts=False)
    # A fixed k: with "auto", how many forced tokens are drafted follows measured step times
    # (the cost model), and the count asserted below varied from run to run on a shared machine.
    drafted = engine_like(smol_llm, forced_token_drafts=True,
                          speculative_config={"method": "suffix", "num_speculative_tokens": 4})
    want = plain.generate(few, params, use_tqdm=False)
    got = drafted.generate(few, params, use_tqdm=False)
    assert "spec_forced_tokens" not in plain.engine.stats
    assert drafted.engine.stats["spec_forced_accepted"] > 10 * len(few)
    check_records(want)
    for prompt, a, b in zip(few, want, got):
        ta, tb = a.outputs[0].token_ids, b.outputs[0].token_ids
        if ta == tb:
            continue
        # Only a near-tie may differ (batched verification sums in another order than decode).
        at = next(i for i, (x, y) in enumerate(zip(ta, tb)) if x != y)
        with torch.no_grad():
            logits = smol_llm.engine.model(input_ids=torch.tensor([prompt + ta[:at]])).logits[0, -1]
        top = logits.topk(2).values
        assert float(top[0] - top[1]) < NEAR_TIE, (at, a.outputs[0].text, b.outputs[0].text)


def slow_schema(prefix: str, n: int) -> dict:
    """A schema xgrammar takes seconds to compile (n patterned string properties; ~1.7 s for 100)."""
    return {"type": "object", "required": [f"{prefix}{i}" for i in range(n)],
            "properties": {f"{prefix}{i}": {"type": "string", "pattern": f"^w{i}[a-z]{{3,40}}$"} for i in range(n)}}


def test_a_grammar_that_fails_or_times_out_fails_alone(smol_llm, prompts):
    # (No forced drafting here: the speculator it builds calibrates for ~1 s at the first
    # grammar, and the timings below are about compilation.)
    llm = engine_like(smol_llm, structured_outputs_timeout_s=2.0, forced_token_drafts=False)
    # Hundreds of patterned properties take xgrammar seconds to compile: ~5 s here with 0.2.8 and
    # 0.2.9 alike (0.2.9 compiles bounded string lengths, the schema used before, in milliseconds).
    slow = slow_schema("k", 300)
    good = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured_outputs={"json": SCHEMA})
    params = [
        good,
        SamplingParams(max_tokens=8, structured_outputs={"json": {"type": "no-such-type"}}),
        SamplingParams(max_tokens=8, structured_outputs={"json": slow}),
        SamplingParams(max_tokens=8, structured_outputs={"regex": "(unclosed"}),
        good,
        SamplingParams(temperature=0, max_tokens=8),  # unconstrained, in the same batch
    ]
    outs = llm.generate(prompts[: len(params)], params, use_tqdm=False)
    check_records([outs[0], outs[4]])
    assert outs[5].error is None and len(outs[5].outputs[0].token_ids) == 8
    assert outs[1].error.startswith("structured_outputs: the json does not compile"), outs[1].error
    assert "no-such-type" in outs[1].error
    assert "took longer than its 2 s limit" in outs[2].error, outs[2].error
    assert outs[3].error.startswith("structured_outputs: the regex does not compile"), outs[3].error
    for out in (outs[1], outs[2], outs[3]):
        assert out.outputs[0].finish_reason == "error" and out.outputs[0].token_ids == []
    # The loop never waited for the slow compilation: the unconstrained request, which waits for
    # no grammar, had its first token before the slow one failed. (Not the good grammars' first
    # tokens: they wait for their own compilation, which on a loaded machine took 1.7 s once,
    # past the slow one's limit, in CI.)
    assert outs[5].metrics.first_token_time < outs[2].metrics.finished_time, (
        outs[5].metrics, outs[2].metrics)
    # The failure is cached: the same slow schema fails at once, without compiling again.
    again = llm.generate(prompts[:1], params[2], use_tqdm=False)[0]
    assert "took longer" in again.error


def test_exiting_during_a_compilation_is_clean(smollm2_dir, tmp_path):
    """xgrammar aborts a process that exits during a compilation's last phase (exit code 134);
    the compiler waits for running compilations at exit instead."""
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "exit_while_compiling.py"
    script.write_text(f"""
import json
import time
from transformers import AutoTokenizer
from engine.structured.compiler import GrammarCompiler
from engine.structured.params import StructuredOutputsParams
tok = AutoTokenizer.from_pretrained({smollm2_dir!r})
compiler = GrammarCompiler(tok, 49152, {{tok.eos_token_id}}, timeout_s=0.5)
def slow(name):
    return {{"type": "object", "required": [f"{{name}}{{i}}" for i in range(100)],
            "properties": {{f"{{name}}{{i}}": {{"type": "string", "pattern": f"^w{{i}}[a-z]{{{{3,40}}}}$"}}
                           for i in range(100)}}}}
xgr_compiler = compiler._compiler()
start = time.monotonic()  # how long one such compilation takes on this machine now
xgr_compiler.compile_json_schema(json.dumps(slow("a")))
seconds = time.monotonic() - start
entry = compiler.submit(StructuredOutputsParams(json=slow("b")))
start = time.monotonic()
while not entry.poll():
    time.sleep(0.01)
print("gave up after", round(time.monotonic() - start, 1), "s:", entry.error)
time.sleep(max(0.0, 0.88 * seconds - (time.monotonic() - start)))  # exit in its last phase
""")
    root = Path(__file__).resolve().parents[2]
    res = subprocess.run([sys.executable, str(script)], cwd=root, capture_output=True, text=True, timeout=300,
                         env={**__import__("os").environ, "PYTHONPATH": str(root)})
    assert res.returncode == 0, res.stderr[-2000:]
    assert "took longer than its 0.5 s limit" in res.stdout
