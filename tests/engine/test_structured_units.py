"""Structured output's parts on a tiny model and its byte tokenizer (fast): the request model,
the batched mask with drafts and its rollback, forced rows, and every constraint kind end to end."""

from __future__ import annotations

import json
import re

import pytest
import torch

from engine import LLM, SamplingParams, StructuredOutputsParams
from engine.sampler import SampleRow
from engine.structured.compiler import GrammarCompiler
from engine.structured.mask import fill_bitmask
from engine.structured.state import GrammarState, unpack
from tests.helpers.tiny_models import make_byte_tokenizer


# ---- the request model ------------------------------------------------------------------
def test_params_take_exactly_one_constraint_and_round_trip_as_json():
    spec = StructuredOutputsParams(json='{"type": "object"}')
    assert spec.json == {"type": "object"} and spec.kind == "json"
    params = SamplingParams(structured_outputs={"choice": ["a", "b"]})
    assert isinstance(params.structured_outputs, StructuredOutputsParams)
    stored = json.loads(json.dumps(params.to_dict()))
    assert stored["structured_outputs"] == {"choice": ["a", "b"]}
    assert SamplingParams.from_dict(stored) == params
    assert StructuredOutputsParams(json={"b": 1, "a": 2}).key() == StructuredOutputsParams(json={"a": 2, "b": 1}).key()
    for bad, needle in [
        ({}, "needs exactly one of"),
        ({"json": {"type": "object"}, "regex": "a"}, "got json, regex"),
        ({"json": "[1, 2]"}, "must be a JSON schema object"),
        ({"json": "{nope"}, "not valid JSON text"),
        ({"json": {"maximum": float("nan")}}, "must be plain JSON"),
        ({"choice": []}, "non-empty list"),
        ({"regex": ""}, "non-empty string"),
        ({"json_object": False}, "needs exactly one of"),
        ({"structural_tag": "x"}, "unsupported field(s): structural_tag"),
    ]:
        with pytest.raises(ValueError, match=re.escape(needle)):
            SamplingParams(structured_outputs=bad)


# ---- compiler, state, mask --------------------------------------------------------------
@pytest.fixture(scope="module")
def byte_tok():
    return make_byte_tokenizer()


def compiled(tok, **spec):
    compiler = GrammarCompiler(tok, len(tok), {tok.eos_token_id}, timeout_s=30)
    entry = compiler.submit(StructuredOutputsParams(**spec))
    entry.done.wait(30)
    assert entry.poll() and not entry.failed, entry.error
    return entry.compiled


class FakeSeq:
    """Only what the mask reads of a sequence."""

    def __init__(self, seq_id: int, grammar: GrammarState | None) -> None:
        self.seq_id, self.grammar = seq_id, grammar


def state_for(tok, **spec) -> GrammarState:
    encode = lambda text: tuple(tok.encode(text, add_special_tokens=False))  # noqa: E731
    return GrammarState(compiled(tok, **spec), encode, {tok.eos_token_id}, -(-len(tok) // 32))


def allowed(bitmask: torch.Tensor, row: int, vocab: int) -> set[int]:
    return set(unpack(bitmask[row : row + 1])[0, :vocab].nonzero().flatten().tolist())


def test_mask_rows_after_drafts_then_the_state_is_rolled_back(byte_tok):
    tok, vocab = byte_tok, len(byte_tok)
    a, b, c, x = (tok.convert_tokens_to_ids(ch) for ch in "abcx")
    digits = {tok.convert_tokens_to_ids(str(d)) for d in range(10)}
    state = state_for(tok, regex="ab[0-9]c")
    seq, free = FakeSeq(1, state), FakeSeq(2, None)
    rows = [SampleRow(seq, []), SampleRow(free, []), SampleRow(seq, [a]), SampleRow(seq, [a, b]),
            SampleRow(seq, [a, b, x]), SampleRow(seq, [a, b, x, c])]
    bitmask, forced = fill_bitmask(rows, [0, 2, 3, 4, 5], -(-vocab // 32))
    assert forced == {0: a, 2: b}  # forced text: one-hot rows
    assert allowed(bitmask, 0, vocab) == {a} and allowed(bitmask, 2, vocab) == {b}
    assert allowed(bitmask, 3, vocab) == digits  # a choice: the grammar's mask
    assert len(allowed(bitmask, 1, vocab)) == vocab  # no grammar: untouched
    # Draft x is refused at row 3 (its mask excludes x), so the rows behind it are unmasked.
    assert len(allowed(bitmask, 4, vocab)) == vocab and len(allowed(bitmask, 5, vocab)) == vocab
    # Nothing stayed pushed: the state still starts at the beginning.
    assert state.forced_tokens(5) == [a, b]
    assert state.valid_prefix([a, b, x]) == 2 and state.forced_next() == a


def test_commit_must_stop_and_forced_tokens(byte_tok):
    tok = byte_tok
    state = state_for(tok, json={"type": "object", "properties": {"k": {"enum": ["yes", "no"]}},
                                 "required": ["k"], "additionalProperties": False})
    assert bytes(tok.decode(state.forced_tokens(32)), "utf-8") == b'{"k": "'
    for token in tok.encode('{"k": "y', add_special_tokens=False):
        assert state.commit(token)
    assert tok.decode(state.forced_tokens(32)) == 'es"}'
    assert not state.must_stop()
    for token in tok.encode('es"}', add_special_tokens=False):
        assert state.commit(token)
    assert state.must_stop()
    assert not state.commit(tok.convert_tokens_to_ids("x"))


def test_compile_errors_are_per_grammar_and_cached(byte_tok):
    tok = byte_tok
    compiler = GrammarCompiler(tok, len(tok), {tok.eos_token_id}, timeout_s=30)
    bad = compiler.submit(StructuredOutputsParams(grammar="root ::= undefined_rule"))
    bad.done.wait(30)
    assert bad.poll() and bad.failed and bad.error.startswith("structured_outputs: the grammar does not compile")
    assert compiler.submit(StructuredOutputsParams(grammar="root ::= undefined_rule")) is bad
    good = compiler.submit(StructuredOutputsParams(choice=["x"]))
    good.done.wait(30)
    assert good.poll() and not good.failed


# ---- every constraint kind through the engine (tiny random model) ------------------------
@pytest.mark.parametrize("spec, check", [
    ({"choice": ["red", "green", "blue"]}, lambda t: t in ("red", "green", "blue")),
    ({"regex": "[0-9]{3}-[a-z]{2}"}, lambda t: re.fullmatch("[0-9]{3}-[a-z]{2}", t)),
    ({"grammar": 'root ::= "(" ("x" | "y")+ ")"'}, lambda t: re.fullmatch(r"\([xy]+\)", t)),
    ({"json": {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
               "required": ["ok", "n"]}},
     lambda t: isinstance(json.loads(t)["ok"], bool) and json.loads(t)["n"] in (1, 2, 3)),
], ids=["choice", "regex", "grammar", "json"])
def test_every_constraint_kind_is_honoured(flat_model_dir, spec, check):
    llm = LLM(flat_model_dir, device="cpu", max_model_len=256)
    params = SamplingParams(temperature=1.0, max_tokens=40, seed=3, n=4, structured_outputs=spec)
    out = llm.generate(["hello there"], params, use_tqdm=False)[0]
    assert out.error is None
    for sample in out.outputs:
        assert sample.finish_reason == "stop", sample
        assert check(sample.text), sample.text
    # Seeded: the same samples again, alone or in another batch.
    again = llm.generate(["other prompt", "hello there"], [SamplingParams(max_tokens=5), params], use_tqdm=False)[1]
    assert [s.token_ids for s in again.outputs] == [s.token_ids for s in out.outputs]


@pytest.mark.parametrize("speculative", [
    {"method": "draft", "num_speculative_tokens": 3},  # the draft model samples under the mask too
    {"method": "ngram", "num_speculative_tokens": 4, "acceptance": "rejection"},
], ids=["draft-model", "ngram-rejection"])
def test_constrained_under_every_verifier(flat_model_dir, speculative):
    if speculative["method"] == "draft":
        speculative = dict(speculative, draft_model=flat_model_dir)
    llm = LLM(flat_model_dir, device="cpu", max_model_len=256, speculative_config=speculative)
    spec = {"json": {"type": "object", "properties": {"a": {"enum": ["xy", "zw"]}, "b": {"type": "boolean"}},
                     "required": ["a", "b"], "additionalProperties": False}}
    params = SamplingParams(temperature=1.0, max_tokens=40, seed=5, n=3, structured_outputs=spec)
    out = llm.generate(["some prompt"], params, use_tqdm=False)[0]
    assert out.error is None
    for sample in out.outputs:
        record = json.loads(sample.text)
        assert record["a"] in ("xy", "zw") and isinstance(record["b"], bool), sample.text
    assert llm.engine.stats["spec_forced_accepted"] == llm.engine.stats["spec_forced_tokens"] > 0


@pytest.mark.parametrize("bounds", [{"maxLength": 8}, {"minLength": 1}, {"minLength": 1, "maxLength": 3}],
                         ids=["max", "min", "min-max"])
def test_a_length_bounded_string_never_admits_a_raw_control_character(byte_tok, bounds):
    """xgrammar 0.2.9 lets U+0000-U+001F into length-bounded strings; a sampled record then failed json.loads."""
    tok, vocab = byte_tok, len(byte_tok)
    schema = {"type": "object", "properties": {"name": {"type": "string", **bounds}},
              "required": ["name"], "additionalProperties": False}
    state = state_for(tok, json=schema)
    for token in tok.encode('{"name": "a', add_special_tokens=False):
        assert state.commit(token)
    bitmask = torch.zeros(1, -(-vocab // 32), dtype=torch.int32)
    state.fill(bitmask, 0)
    admitted = allowed(bitmask, 0, vocab)
    byte_token = lambda text: tok.encode(text, add_special_tokens=False)[0]  # noqa: E731
    controls = {byte_token(chr(code)) for code in range(0x20)}
    assert len(controls) == 0x20 and not admitted & controls
    assert {byte_token("b"), byte_token("~")} <= admitted  # ordinary characters still are
