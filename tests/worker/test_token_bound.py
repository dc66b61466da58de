"""The byte bound on prompt tokens (``worker.request.token_bound``) holds where it is claimed, is not
claimed where it could fail, and checking prompts with it gives the same verdicts as counting
every one exactly."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from tokenizers import normalizers, pre_tokenizers

from worker.request.formats import length_error, parse_line
from worker.request.token_bound import byte_bounded, surely_fits
from worker.request.validate import TokenCounter

SPECIAL_TEXTS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<repo_name>", "<|im_", "im_end|>"]
texts = st.lists(st.one_of(st.text(max_size=40), st.sampled_from(SPECIAL_TEXTS),
                           st.sampled_from([" ", "\n\n", "  \t", "é", "中文", "🙂", "ﷺ", "\u0301"])),
                 max_size=12).map("".join)


@pytest.fixture(scope="module")
def smol_counter(smollm2_dir) -> TokenCounter:
    return TokenCounter(smollm2_dir)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=texts)
def test_a_prompt_never_has_more_tokens_than_bytes_on_smollm2(smol_counter, text):
    tokenizer = smol_counter.tokenizer
    assert smol_counter.byte_bounded
    n_bytes = len(text.encode("utf-8"))
    assert len(tokenizer.encode(text)) <= n_bytes + tokenizer.num_special_tokens_to_add(pair=False)
    rendered = smol_counter.renderer.render_many([[{"role": "user", "content": text}]])[0]
    assert len(tokenizer.backend_tokenizer.encode(rendered, add_special_tokens=False).ids) <= len(rendered.encode("utf-8"))


def test_only_tokenizers_that_only_split_are_bounded(tiny_model_dir):
    from transformers import AutoTokenizer

    def backend():
        return AutoTokenizer.from_pretrained(tiny_model_dir).backend_tokenizer

    assert byte_bounded(backend())
    normalized = backend()
    normalized.normalizer = normalizers.NFKC()  # "ﷺ" becomes 18 characters
    assert not byte_bounded(normalized)
    prefixed = backend()
    prefixed.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    assert not byte_bounded(prefixed)
    metaspace = backend()
    metaspace.pre_tokenizer = pre_tokenizers.Metaspace()  # prepends "▁": a token for no byte
    assert not byte_bounded(metaspace)
    split = backend()
    split.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(), pre_tokenizers.ByteLevel(
        add_prefix_space=False, use_regex=True)])
    assert byte_bounded(split)


def test_surely_fits_is_exact_at_the_limit_for_a_byte_tokenizer():
    assert surely_fits("a" * 9, 10) and not surely_fits("a" * 10, 10)
    assert surely_fits("é" * 4, 10) and not surely_fits("é" * 5, 10)  # two bytes each
    assert surely_fits("a" * 8, 10, extra=1) and not surely_fits("a" * 9, 10, extra=1)


@pytest.mark.parametrize("limit", [12, 40, 60, 2048])
def test_lengths_give_the_verdicts_of_exact_counts(tiny_model_dir, smollm2_dir, limit):
    lines = [{"prompt": "x" * k} for k in (1, 9, 10, 11, 12, 13, 38, 39, 40, 41, 59, 60, 61)]
    lines += [{"messages": [{"role": "user", "content": "y" * k}]} for k in (0, 1, 5, 20, 30, 40)]
    lines += [{"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "é" * 15}]},
              {"prompt": [1, 2, 3]}, {"prompt": [1, 2, 10**6]}, {"prompt": "<|im_end|>" * 8}]
    reqs = [parse_line(json.dumps(r), n) for n, r in enumerate(lines, start=1)]
    for model_dir in (tiny_model_dir, smollm2_dir):
        counter = TokenCounter(model_dir)
        exact = [length_error(n, limit) for n in counter.count_many(reqs)]
        assert [length_error(n, limit) for n in counter.lengths(reqs, limit)] == exact
        assert any(e is None for e in exact) and any(e is not None for e in exact) or limit == 2048


def test_an_unbounded_tokenizer_counts_every_prompt(tiny_model_dir):
    counter = TokenCounter(tiny_model_dir)
    counter.tokenizer.backend_tokenizer.normalizer = normalizers.NFKC()
    counter.byte_bounded = byte_bounded(counter.tokenizer.backend_tokenizer)
    reqs = [parse_line(json.dumps({"prompt": "ﷺ"}), 1), parse_line(json.dumps({"prompt": "ab"}), 2)]
    assert not counter.byte_bounded
    assert counter.lengths(reqs, 10) == counter.count_many(reqs) == [33, 2]  # 33 tokens from 3 bytes


def test_the_counter_loads_what_autotokenizer_and_autoconfig_load(tiny_model_dir, smollm2_dir):
    """The counter reads the generic tokenizer and config.json without transformers' Auto classes
    (their import pulls torch: seconds of every run's start); it must see the same model."""
    from transformers import AutoConfig, AutoTokenizer

    conversation = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi <|im_end|> é"}]
    for model_dir in (tiny_model_dir, smollm2_dir):
        counter, auto = TokenCounter(model_dir), AutoTokenizer.from_pretrained(model_dir)
        config = AutoConfig.from_pretrained(model_dir).get_text_config()
        assert (counter.max_model_len, counter.vocab_size) == (config.max_position_embeddings, config.vocab_size)
        for text in ("hello there", "<|im_start|>x", "  spaced\n\ttext 中文"):
            assert counter.tokenizer.encode(text) == auto.encode(text)
        assert (counter.tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
                == auto.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True))
