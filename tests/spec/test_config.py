"""SpeculativeConfig validation and its route into the engine."""

import pytest

from engine import LLM, SpeculativeConfig
from engine.config import EngineConfig


@pytest.mark.parametrize("k", [0, 33, -1, 2.5, True, "4", None])
def test_k_outside_1_to_32_is_a_value_error(k):
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpeculativeConfig(method="ngram", num_speculative_tokens=k)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"method": "medusa"}, "method"),
        ({"method": "draft"}, "draft_model"),
        ({"method": "ngram", "draft_model": "x"}, "draft_model"),
        ({"prompt_lookup_min": 0}, "prompt_lookup_min"),
        ({"prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_min"),
        ({"max_speculative_tokens": 40}, "max_speculative_tokens"),
        ({"suffix_max_depth": 0}, "suffix_max_depth"),
        ({"suffix_min_token_prob": 1.5}, "suffix_min_token_prob"),
    ],
)
def test_bad_fields_name_themselves(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SpeculativeConfig(**kwargs)


def test_dicts_are_accepted_and_unknown_keys_named():
    config = EngineConfig(model="m", device="cpu", speculative_config={"method": "suffix", "num_speculative_tokens": 3})
    assert isinstance(config.speculative_config, SpeculativeConfig)
    assert config.speculative_config.k_max == 3 and not config.speculative_config.adaptive
    with pytest.raises(ValueError, match="bogus"):
        EngineConfig(model="m", device="cpu", speculative_config={"method": "ngram", "bogus": 1})
    with pytest.raises(ValueError, match="speculative_config"):
        EngineConfig(model="m", device="cpu", speculative_config=3)


def test_a_draft_with_another_vocabulary_fails_at_start(tiny_model_dir, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "other")
    with pytest.raises(ValueError, match="vocabulary of 300"):
        LLM(tiny_model_dir, device="cpu", speculative_config=SpeculativeConfig(method="draft", draft_model=str(tmp_path / "other")))
