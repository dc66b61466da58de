"""Greedy speculation on the real SmolLM2-135M-Instruct equals greedy decoding without it.

A divergence is accepted only at a near-tie: where the non-speculative run's two top logits at
that step differ by less than 1e-4 (batched verification sums in another order than decode).
"""

from __future__ import annotations

import pytest
import torch

from engine import LLM, LLMEngine, SamplingParams
from engine.config import EngineConfig
from engine.model_hub import load_causal_lm

pytestmark = pytest.mark.slow

MESSAGES = [
    "Repeat exactly: the cat sat on the mat, the cat sat on the mat.",
    "Write the numbers from one to ten in words, separated by commas.",
    "What is the capital of France?",
    'Return this as JSON with keys name and age: "Alice is 31 years old."',
]
NEAR_TIE = 1e-4


def with_spec(smol_llm: LLM, config: dict) -> LLM:
    base = smol_llm.engine
    engine_config = EngineConfig(model=base.config.model, device="cpu", dtype=base.config.dtype, speculative_config=config)
    return LLM.from_engine(LLMEngine(engine_config, model=base.model, tokenizer=base.tokenizer))


@pytest.fixture(scope="module")
def prompts(smol_llm):
    return [smol_llm.engine.apply_chat_template([{"role": "user", "content": m}]) for m in MESSAGES]


@pytest.fixture(scope="module")
def reference(smol_llm, prompts):
    params = SamplingParams(temperature=0, max_tokens=32)
    return [o.outputs[0].token_ids for o in smol_llm.generate(prompts, params, use_tqdm=False)]


def top2_gap(model, ids: list[int]) -> float:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
    top = logits.topk(2).values
    return float(top[0] - top[1])


@pytest.mark.parametrize(
    "config",
    [
        {"method": "ngram", "num_speculative_tokens": 8},
        {"method": "suffix", "num_speculative_tokens": 6},
        {"method": "draft", "num_speculative_tokens": 4},  # the target drafting for itself
        {"method": "ngram"},
    ],
    ids=["ngram", "suffix", "draft", "ngram-auto"],
)
def test_greedy_equals_non_speculative(smol_llm, smollm2_dir, prompts, reference, config):

    if config["method"] == "draft":
        config = {**config, "draft_model": smollm2_dir}
    llm = with_spec(smol_llm, config)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    hf = None
    for prompt, out, want in zip(prompts, outs, reference):
        got = out.outputs[0].token_ids
        if got == want:
            continue
        i = next(j for j, (a, b) in enumerate(zip(got, want)) if a != b)
        if hf is None:
            hf = load_causal_lm(smollm2_dir, dtype=torch.float32).eval()
        gap = top2_gap(hf, prompt + want[:i])
        assert gap < NEAR_TIE, f"diverged at output token {i} where the top-2 logit gap is {gap:.2e}"
    if "num_speculative_tokens" in config:
        assert llm.engine.stats["spec_accepted_tokens"] > 0
