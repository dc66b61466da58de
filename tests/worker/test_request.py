"""One request model: ``SamplingParams`` owns defaults and bounds; the reader, the client's
OpenAI mapping and the claimed job row only build it. Fuzzed with 10,000 cases each: every
input is a request or a clear error for its own line, never another exception."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import HealthCheck, example, given, settings, strategies as st

from engine.sampling_params import DEFAULT_MAX_TOKENS, SamplingParams
from worker.common.config import model_slug
from worker.ingest.parse import GOOD, INVALID, numbered_lines, parse_chunk
from worker.request.formats import MAX_CUSTOM_ID, BadLine, Request, parse_line
from worker.request.convert import (OPENAI_SAMPLING_FIELDS, line_sampling_params, openai_sampling_params, request_from_row,
                            with_seed)
from worker.store.sqltypes import escape_nul, stored_length, unescape_nul

FUZZ = settings(max_examples=10_000, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.filter_too_much, HealthCheck.large_base_example])
PARAM_NAMES = sorted(SamplingParams().to_dict())
BIG = 10 * 1024 * 1024


# ---- strategies ------------------------------------------------------------------------
def _numbers():
    extremes = st.sampled_from([0, -1, 1, 2, 3, 128, 129, 2**31, 2**63 - 1, 2**63, -(2**63) - 1, 10**30, -10**30,
                                0.0, -0.0, 1e-9, 0.5, 2.0, 2.0000001, 1e308, -1e308, math.nan, math.inf, -math.inf])
    return st.integers() | st.floats() | extremes


scalars = st.none() | st.booleans() | _numbers() | st.text(max_size=6)
# One level of nesting, not st.recursive: as wrong for the reader and several times cheaper to draw.
values = scalars | st.lists(scalars, max_size=3) | st.dictionaries(st.text(max_size=4), scalars, max_size=2)
param_dicts = st.dictionaries(st.sampled_from(PARAM_NAMES) | st.text(max_size=5), values, max_size=6)
openai_dicts = st.dictionaries(st.sampled_from(sorted(OPENAI_SAMPLING_FIELDS)), values, max_size=5)
nasty_text = st.text(alphabet=st.characters(codec="utf-8") | st.sampled_from(["\x00", "\x1b", "'", '"', "\\", ";"]),
                     max_size=12)
messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "bot", 1]),
                                           "content": nasty_text | values}), max_size=3)
body = st.fixed_dictionaries(
    {}, optional={"messages": messages | values, "prompt": nasty_text | st.lists(st.integers(-2, 300), max_size=4) | values,
                  "model": st.sampled_from(["tiny", "org/Tiny", "gpt-9-ultra", ""]) | values,
                  "user": nasty_text, "stream": st.booleans(), "frobnicate": values},
)
body = st.builds(lambda b, s: {**b, **s}, body, openai_dicts)
openai_lines = st.fixed_dictionaries(
    {"custom_id": nasty_text | values, "url": st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/x"]),
     "body": body | values},
    optional={"method": st.sampled_from(["POST", "GET"])},
)
plain_lines = st.builds(lambda b, c: {**b, **c}, body, st.fixed_dictionaries({}, optional={"custom_id": nasty_text | values}))
# Near-valid lines (each field plausible, some values out of range) so the fuzz reaches the
# sampling params and the model check, not only the first structural error.
near_params = st.fixed_dictionaries({}, optional={
    "max_tokens": st.integers(-1, 5000) | _numbers(), "max_completion_tokens": st.none() | st.integers(0, 5000),
    "temperature": st.floats(0, 2.2) | _numbers(), "top_p": st.floats(0, 1), "top_k": st.integers(-2, 100),
    "n": st.integers(0, 130), "seed": st.integers(-(2**64), 2**64), "min_tokens": st.integers(0, 10),
    "stop": st.none() | nasty_text | st.lists(nasty_text, max_size=3), "stop_token_ids": st.lists(st.integers(-1, 500)),
    "presence_penalty": st.floats(-3, 3), "ignore_eos": st.booleans(), "user": nasty_text,
})
near_messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]),
                                                "content": nasty_text}), min_size=1, max_size=3)
near_prompt = nasty_text.filter(bool) | st.lists(st.integers(0, 300), min_size=1, max_size=5)
near_model = st.fixed_dictionaries({}, optional={"model": st.sampled_from(["tiny", "org/Tiny", "gpt-9-ultra"])})
near_chat = st.builds(lambda m, p, mo: {"messages": m, **p, **mo}, near_messages, near_params, near_model)
near_completion = st.builds(lambda pr, p, mo: {"prompt": pr, **p, **mo}, near_prompt, near_params, near_model)
near_openai = st.one_of(
    st.builds(lambda cid, b: {"custom_id": cid, "url": "/v1/chat/completions", "body": b}, nasty_text, near_chat),
    st.builds(lambda cid, b: {"custom_id": cid, "url": "/v1/completions", "body": b}, nasty_text, near_completion),
)
near_plain = st.builds(lambda b, c: {**b, **c}, near_chat | near_completion,
                       st.fixed_dictionaries({}, optional={"custom_id": nasty_text}))
line_texts = st.one_of(
    near_openai.map(json.dumps), near_plain.map(json.dumps), near_openai.map(lambda d: json.dumps(d).encode()),
    openai_lines.map(json.dumps), plain_lines.map(json.dumps),  # json.dumps writes NaN and Infinity as such
    values.map(json.dumps), st.text(max_size=40),
    st.binary(max_size=40),  # not UTF-8, mostly
    (openai_lines | plain_lines).map(lambda d: json.dumps(d).encode("utf-8")),
    st.sampled_from(['{"prompt": "\\ud800"}', '{"custom_id": "\\udfff", "prompt": "x"}', "[" * 100_000,
                     '{"prompt": "x", "max_tokens": ' + "9" * 5000 + "}", "\ufeff{\"prompt\": \"bom\"}"]),
)


def _storable(text: str | None) -> bool:
    """What a UTF-8 file and both databases can hold."""
    if text is None:
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


# ---- SamplingParams --------------------------------------------------------------------
def test_defaults_and_bounds_live_in_sampling_params():
    assert SamplingParams().max_tokens == DEFAULT_MAX_TOKENS
    for field, bad in [("temperature", 2.5), ("temperature", math.nan), ("n", 129), ("n", 0), ("top_p", math.inf),
                       ("seed", 2**63), ("max_tokens", 0), ("skip_special_tokens", 1), ("min_p", -0.1)]:
        with pytest.raises(ValueError, match=f"^{field}"):
            SamplingParams.from_dict({field: bad})
    assert SamplingParams(temperature=2, n=128, seed=-(2**63)).n == 128
    with pytest.raises(ValueError, match="must be an object"):
        SamplingParams.from_dict(["max_tokens", 3])


@FUZZ
@given(param_dicts)
def test_fuzz_sampling_params_from_dict(data):
    try:
        params = SamplingParams.from_dict(data)
    except ValueError as exc:
        msg = str(exc)
        assert msg.split(" ", 1)[0] in data or msg.startswith(("unknown sampling parameter", "stop")), msg
        assert len(msg) < 400  # never echoes a huge value
        return
    assert 0 <= params.temperature <= 2 and 1 <= params.n <= 128 and params.max_tokens >= 1
    stored = json.dumps(params.to_dict(), allow_nan=False)  # storable as JSON, no NaN/inf
    assert SamplingParams.from_dict(json.loads(stored)) == params


# ---- OpenAI fields: max_tokens / max_completion_tokens -----------------------------------
def test_max_completion_tokens_is_max_tokens_and_wins_over_it():
    assert openai_sampling_params({"max_completion_tokens": 9}).max_tokens == 9
    assert openai_sampling_params({"max_completion_tokens": 9, "max_tokens": 9}).max_tokens == 9
    assert openai_sampling_params({"max_completion_tokens": None, "max_tokens": 5}).max_tokens == 5
    # Both given and different: the newer name wins (vLLM's rule), the line is not refused.
    assert openai_sampling_params({"max_completion_tokens": 9, "max_tokens": 5}).max_tokens == 9
    with pytest.raises(ValueError, match="^max_completion_tokens: max_tokens must be at least 1"):
        openai_sampling_params({"max_completion_tokens": 0})
    with pytest.raises(ValueError, match="^max_tokens must be"):  # the value it replaces is still checked
        openai_sampling_params({"max_completion_tokens": 9, "max_tokens": "many"})
    req = parse_line(json.dumps({"prompt": "x", "max_tokens": 5, "max_completion_tokens": 6}), 3)
    assert isinstance(req, Request) and req.params.max_tokens == 6


@FUZZ
@given(openai_dicts)
def test_fuzz_openai_fields(data):
    try:
        params = openai_sampling_params(data)
    except ValueError as exc:
        assert str(exc).split(" ", 1)[0].rstrip(":") in data or str(exc).startswith("stop"), str(exc)
        return
    given_limit = data.get("max_completion_tokens")
    given_limit = data.get("max_tokens") if given_limit is None else given_limit
    assert params.max_tokens == (DEFAULT_MAX_TOKENS if given_limit is None else given_limit)


@settings(FUZZ, max_examples=1_000)
@given(openai_dicts)
def test_fuzz_a_line_s_shared_params_equal_fresh_ones(data):
    """Bulk lines share the params built for equal scalar fields: each gets what building them
    afresh gives (or the same error), as its own object."""
    for endpoint in ("chat", "completions"):
        try:
            fresh = openai_sampling_params(dict(data), endpoint=endpoint)
        except ValueError as exc:
            with pytest.raises(ValueError) as again:
                line_sampling_params(dict(data), endpoint)
            assert str(again.value) == str(exc)
            continue
        first, second = line_sampling_params(dict(data), endpoint), line_sampling_params(dict(data), endpoint)
        assert first == fresh == second and first is not second
        first.seed = 7
        first.stop.append("zz")
        assert second.seed == fresh.seed and second.stop == fresh.stop


def test_shared_params_tell_ints_floats_and_bools_apart():
    assert line_sampling_params({"temperature": 1}, "chat").temperature == 1
    assert type(line_sampling_params({"temperature": 1.0}, "chat").temperature) is float
    assert type(line_sampling_params({"temperature": 1}, "chat").temperature) is int
    with pytest.raises(ValueError, match="bool"):
        line_sampling_params({"max_tokens": True}, "chat")
    assert line_sampling_params({"max_tokens": 1}, "chat").max_tokens == 1


def test_seeds_are_assigned_once_and_kept():
    a, b = with_seed(SamplingParams()), with_seed(SamplingParams())
    assert a.seed is not None and b.seed is not None and a.seed != b.seed
    assert with_seed(SamplingParams(seed=7)).seed == 7 and with_seed(a) is a


# ---- the reader ----------------------------------------------------------------------
def test_unknown_model_is_an_error_unless_it_is_the_batch_model():
    line = {"custom_id": "a", "url": "/v1/chat/completions",
            "body": {"model": "gpt-9-ultra", "messages": [{"role": "user", "content": "hi"}]}}
    bad = parse_line(json.dumps(line), 5, model="HuggingFaceTB/SmolLM2-135M-Instruct")
    assert isinstance(bad, BadLine) and bad.custom_id == "a"
    assert bad.message.startswith("line 5: model: 'gpt-9-ultra' is not this batch's model")
    assert "--served-model-name gpt-9-ultra" in bad.message  # the refusal names the way to run it
    served = parse_line(json.dumps(line), 5, model="HuggingFaceTB/SmolLM2-135M-Instruct", served=("gpt-9-ultra",))
    assert isinstance(served, Request) and served.model == "gpt-9-ultra"
    line["body"]["model"] = "smollm2-135m-instruct"  # the same slug: the batch's model
    assert isinstance(parse_line(json.dumps(line), 5, model="HuggingFaceTB/SmolLM2-135M-Instruct"), Request)
    assert isinstance(parse_line(json.dumps(line), 5), Request)  # no batch model: nothing to compare


def test_reader_lines_that_once_crashed_or_corrupted():
    cases = {
        b"\xff\xfe{}": "not UTF-8 text: byte 0xff at column 1",
        "[" * 100_000: "nested too deeply",
        '{"prompt": "x", "max_tokens": ' + "9" * 5000 + "}": "malformed JSON",
        '{"prompt": "\\ud800"}': "lone UTF-16 surrogate",
        '{"prompt": "x", "temperature": NaN}': "temperature must be a finite number",
        '{"prompt": "x", "n": 1000}': "n must be in [1, 128]",
        '{"prompt": "x", "temperature": 2.5}': "temperature must be in [0, 2]",
        '{"prompt": [1.0, 2]}': "prompt",
        '{"prompt": "x", "stream": true}': "stream",
        json.dumps({"custom_id": "\x00" * 200, "prompt": "x"}): "custom_id: longer than 255 characters as stored",
    }
    for text, needle in cases.items():
        bad = parse_line(text, 2)
        assert isinstance(bad, BadLine) and needle in bad.message and bad.message.startswith("line 2: "), (text[:40], bad)
    assert isinstance(parse_line(b'\xef\xbb\xbf{"prompt": "bom"}', 1), Request)  # a UTF-8 BOM on line 1
    # A file with one non-UTF-8 line still yields every other line (the ingest's parsing step).
    entries = parse_chunk(list(numbered_lines([b'{"prompt": "a"}', b'{"prompt": "\xff"}', b'{"prompt": "c"}'])),
                          model="m", priority=1)
    assert [(line_no, kind) for line_no, _cid, kind, _ in entries] == [(1, GOOD), (2, INVALID), (3, GOOD)]
    assert [row["prompt"] for _, _, kind, row in entries if kind == GOOD] == ["a", "c"]


@FUZZ
@given(line_texts, st.sampled_from([None, "org/Tiny"]))
@example(json.dumps({"custom_id": "big", "url": "/v1/completions", "body": {"prompt": "x" * BIG}}), None)
@example(json.dumps({"custom_id": "x" * BIG, "prompt": "y"}), None)
@example('{"prompt": "' + "\\u0000" * (BIG // 6) + '"}', "tiny")
@example(b"\xff" * BIG, None)
def test_fuzz_jsonl_reader(text, model):
    item = parse_line(text, 17, model=model)
    if isinstance(item, BadLine):
        assert item.message.startswith("line 17: ") and _storable(item.message) and len(item.message) < 1000
        assert item.custom_id is None or (_storable(item.custom_id) and 0 < stored_length(item.custom_id) <= MAX_CUSTOM_ID)
        return
    assert isinstance(item, Request) and isinstance(item.params, SamplingParams)
    assert 0 < stored_length(item.custom_id) <= MAX_CUSTOM_ID and _storable(item.custom_id)
    assert (item.prompt or item.prompt_token_ids or item.messages) and _storable(item.prompt)
    if model is not None and item.model is not None:
        assert model_slug(item.model) == model_slug(model)
    json.dumps(item.messages, ensure_ascii=False).encode("utf-8")  # storable as JSON


# ---- the claimed row ----------------------------------------------------------------
# A worker trusts its store: the params a row holds are the ones the producer validated
# (``SamplingParams.from_stored`` does not check them again). The prompt's shape, context and
# vocabulary stay the engine's own checks, as for any caller of ``make_request``.
stored_params = st.builds(lambda p: with_seed(p).to_dict(only_set=True), st.builds(
    lambda d: openai_sampling_params(d), st.fixed_dictionaries({}, optional={
        "max_tokens": st.integers(1, 5000), "temperature": st.floats(0, 2), "top_k": st.integers(-1, 50),
        "stop": st.lists(nasty_text.filter(bool), max_size=2), "seed": st.integers(0, 2**63 - 1),
        "logit_bias": st.dictionaries(st.integers(0, 300).map(str), st.floats(-100, 100), max_size=3)})))
rows = st.fixed_dictionaries(
    {}, optional={"id": values, "model": values, "endpoint": values,
                  "prompt": nasty_text | st.lists(st.integers(-5, 400), max_size=5) | values,
                  "prompt_token_ids_in": st.lists(st.integers(-5, 400) | values, max_size=5) | values,
                  "messages": messages | values, "params": stored_params},
)


@pytest.fixture(scope="module")
def tiny_engine(tiny_model_dir):
    from engine import LLMEngine
    from engine.config import EngineConfig

    return LLMEngine(EngineConfig(model=tiny_model_dir, device="cpu", max_model_len=64))


def _claimed(row: dict) -> dict:
    """A row as the claim returns it: the ``CLAIM_FIELDS`` of a row stored as JSON columns."""
    from worker.store.rows import CLAIM_FIELDS

    return json.loads(json.dumps({k: row.get(k) for k in CLAIM_FIELDS}))


@pytest.fixture(scope="module")
def worker_tokenizer(tiny_model_dir):
    from worker.run.runtime import prompt_tokenizer

    return prompt_tokenizer(tiny_model_dir)


def _engine_request(tiny_engine, claimed: dict, tokenizer=None):
    """The calls a worker's task makes: ``request_from_row``, its tokenizer (``tokenized``), then
    the engine's ``make_request``; the request the engine would have made of the row as it is
    must be the same, or both refused."""
    from worker.run.tasks import tokenized

    req = request_from_row(claimed)
    try:
        direct = tiny_engine.make_request(req.prompt, messages=req.messages, params=req.params, request_id="j#1")
    except ValueError as exc:
        direct = exc
    if tokenizer is not None:
        (_, req), = tokenized(tokenizer, [(0, req)])
    try:
        made = tiny_engine.make_request(req.prompt, messages=req.messages, params=req.params, request_id="j#1")
    except ValueError as exc:
        assert isinstance(direct, ValueError), (claimed, direct, exc)
        raise
    assert not isinstance(direct, Exception), (claimed, direct, made.prompt_token_ids)
    assert (made.prompt_token_ids, made.params) == (direct.prompt_token_ids, direct.params), claimed
    return made


@FUZZ
@given(line=near_openai | near_completion | near_chat)
def test_fuzz_every_line_the_producer_stores_is_an_engine_request_or_its_clear_error(tiny_engine, worker_tokenizer, line):
    """Any line the producer accepted and stored becomes an engine request, or fails with the
    engine's own clear error (a prompt over this engine's context, a token past its vocabulary)."""
    entries = parse_chunk([(1, json.dumps(line))], model="tiny", priority=1)
    if entries[0][2] != GOOD:
        return
    try:
        request = _engine_request(tiny_engine, _claimed(entries[0][3]), worker_tokenizer)
    except ValueError as exc:
        assert str(exc) and len(str(exc)) < 1000
        return
    assert 0 < len(request.prompt_token_ids) < 64
    # A limit past the context is clamped, never an error: the sample ends with "length".
    assert request.params.max_tokens <= 64 - len(request.prompt_token_ids)


@FUZZ
@given(row=rows)
def test_fuzz_claimed_row_to_engine_request(tiny_engine, worker_tokenizer, row):
    """Whatever prompt a row holds (another version's producer, a hand-written row), the engine
    takes it or refuses it with a clear error, never another exception."""
    try:
        request = _engine_request(tiny_engine, row, worker_tokenizer)
    except ValueError as exc:
        assert str(exc) and len(str(exc)) < 1000
        return
    assert 0 < len(request.prompt_token_ids) < 64
    assert request.params.max_tokens <= 64 - len(request.prompt_token_ids)


def test_stored_params_are_not_checked_again_but_must_be_an_object_of_known_fields():
    """The store's params are trusted (no second validation); a row whose params are not an
    object of ``SamplingParams``' fields is still refused with a clear error."""
    stored = with_seed(openai_sampling_params({"temperature": 0.5, "stop": "x", "logit_bias": {"7": 3}}))
    assert SamplingParams.from_stored(json.loads(json.dumps(stored.to_dict(only_set=True)))) == stored
    for bad, message in ((False, "must be an object"), ({"frobnicate": 1}, "unknown sampling parameter")):
        with pytest.raises(ValueError, match=message):
            SamplingParams.from_stored(bad)


def test_row_stored_by_the_producer_round_trips():
    params = with_seed(openai_sampling_params({"max_completion_tokens": 3, "temperature": 0.7}))
    row = json.loads(json.dumps({"prompt": "hi", "params": params.to_dict(only_set=True)}))  # a JSON column
    assert request_from_row(row).params == params
    with pytest.raises(ValueError, match="exactly one"):
        request_from_row({"prompt": "a", "messages": [{"role": "user", "content": "b"}]})


# ---- stored text -----------------------------------------------------------------------
@FUZZ
@given(st.text())
def test_nul_escape_round_trips(text):
    stored = escape_nul(text)
    assert "\x00" not in stored and unescape_nul(stored) == text
    if "\x00" not in text and not text.startswith("\ufdd0"):
        assert stored == text


# ---- the producer ------------------------------------------------------------------------
def test_producer_stores_full_params_with_a_seed(sqlite_url, redis_url, unique_queue):
    """Rows carry every default and a seed, so a retry elsewhere runs the same request; a line
    for another model is a failed row, not a job for this one."""
    import redis

    from worker.api.client import Client

    client = Client(broker_url=redis_url, database_url=sqlite_url, model="org/Tiny", queue=unique_queue)
    try:
        sub = client.submit_batch([
            {"custom_id": "unseeded", "prompt": "a", "temperature": 0.8},
            {"custom_id": "seeded", "prompt": "b", "seed": 5, "max_completion_tokens": 7},
            {"custom_id": "other-model", "prompt": "c", "model": "gpt-9-ultra"},
            {"custom_id": "same-model", "prompt": "d", "model": "tiny"},
        ])
        jobs = {j.custom_id: j for j in client.store.jobs(sub.batch_id)}
        # What the line set, and its seed: the defaults are the engine's (from_dict fills them).
        assert jobs["unseeded"].params == {"temperature": 0.8, "seed": jobs["unseeded"].params["seed"]}
        assert SamplingParams.from_dict(jobs["unseeded"].params) == SamplingParams(
            temperature=0.8, seed=jobs["unseeded"].params["seed"])
        assert isinstance(jobs["unseeded"].params["seed"], int)
        assert jobs["seeded"].params["seed"] == 5 and jobs["seeded"].params["max_tokens"] == 7
        assert jobs["other-model"].status == "failed" and "gpt-9-ultra" in jobs["other-model"].error
        assert jobs["same-model"].status == "queued"
        single = client.store.get_job(client.submit("e", params={"max_completion_tokens": 3}))
        assert single.params["max_tokens"] == 3 and single.params["seed"] is not None
        with pytest.raises(ValueError, match="^temperature"):
            client.submit("f", params={"temperature": 2.5})
        with pytest.raises(ValueError, match="^custom_id"):
            client.submit("g", custom_id="x" * 256)
    finally:
        redis.Redis.from_url(redis_url).delete(unique_queue)
