"""The fused decoder layers compute what transformers' layers compute, family by family.

Each tiny random model (Llama; Qwen2 with QKV bias and sliding-window layers; Mistral with a
window shorter than the prompts) runs through the engine, where its layers are swapped for
``FusedDecoderLayer``; the logits the engine samples at must match an unmodified transformers
model's full forward (eager attention) over the same tokens, in prefill, chunked prefill and decode.
A family we do not fuse (Qwen3: per-head q/k norms) is left to transformers' code and still matches.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, MistralConfig, Qwen2Config, Qwen3Config

from engine import LLM, SamplingParams
from engine.fused_layers import FusedDecoderLayer
from engine.model_hub import load_causal_lm
from tests.helpers.tiny_models import make_byte_tokenizer, make_tiny_model
from tests.engine.test_parity import assert_teacher_forced_match, capture_logits

COMMON = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=512, tie_word_embeddings=False,
)


def save_family(path, family: str) -> str:
    tokenizer = make_byte_tokenizer()
    ids = dict(vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    if family == "llama":
        return str(make_tiny_model(path, num_layers=3, logit_scale=4.0))
    if family == "qwen2":
        config = Qwen2Config(
            **COMMON, **ids, use_sliding_window=True, sliding_window=12, max_window_layers=1,
            layer_types=["full_attention", "sliding_attention", "sliding_attention"],
        )
    elif family == "mistral":
        config = MistralConfig(**COMMON, **ids, sliding_window=12)
    elif family == "qwen3":
        config = Qwen3Config(**COMMON, **ids)
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(config).to(torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0, 0.5)  # Qwen2's QKV biases start at zero: make them matter
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.mark.parametrize(
    "family,fused,switch",
    [("llama", True, True), ("qwen2", True, True), ("mistral", True, True), ("qwen3", False, True),
     ("qwen2", False, False), ("mistral", False, False)],  # fuse_layers=False: transformers' own layers, our attention
)
def test_engine_logits_match_transformers(tmp_path, family, fused, switch):
    path = save_family(tmp_path, family)
    llm = LLM(path, device="cpu", dtype="float32", max_num_batched_tokens=16, block_size=16, fuse_layers=switch)
    layers = llm.engine.model.model.layers
    assert all(isinstance(layer, FusedDecoderLayer) for layer in layers) is fused
    assert any(isinstance(layer, FusedDecoderLayer) for layer in layers) is fused

    records = capture_logits(llm)
    prompts = [list(range(40, 40 + n)) for n in (5, 23, 37)]  # longer than the window, chunked by 16
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)

    reference = load_causal_lm(path, dtype=torch.float32, attn_implementation="eager").eval()
    assert assert_teacher_forced_match(reference, outs, records, tol=1e-4) == 3 * 12
