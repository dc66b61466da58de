"""OpenAI and vLLM batch files run unchanged (issue #16).

The documented example lines of OpenAI's Batch guide and vLLM's ``run-batch`` go through the
real producer (``Client.submit_batch`` into a real store), a real engine on a tiny model and
the worker's result packing, and every output and error line validates against the ``openai``
SDK's own types. The README's field table is checked against the SDK's request types and
vLLM's request models, so a new upstream field fails here until it is classified.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from openai.types import BatchError, Completion
from openai.types.chat import ChatCompletion
from openai.types.chat import completion_create_params as chat_params
from openai.types import completion_create_params as completion_params
from openai.types.shared import ErrorObject
from pydantic import BaseModel, ConfigDict

from engine import LLM, SamplingParams
from tests.helpers.tiny_models import make_tiny_model
from worker.request.formats import BadLine, Request, error_param, output_line, parse_line
from worker.request.openai_fields import RULES, fields_for, render_table
from worker.request.convert import request_from_row
from worker.run.tasks import result_values

ROOT = Path(__file__).resolve().parents[2]

# The example input of OpenAI's Batch guide (platform.openai.com/docs/guides/batch), verbatim.
OPENAI_GUIDE = [
    '{"custom_id": "request-1", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "gpt-3.5-turbo-0125", "messages": [{"role": "system", "content": "You are a helpful assistant."},{"role": "user", "content": "Hello world!"}],"max_tokens": 1000}}',
    '{"custom_id": "request-2", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "gpt-3.5-turbo-0125", "messages": [{"role": "system", "content": "You are an unhelpful assistant."},{"role": "user", "content": "Hello world!"}],"max_tokens": 1000}}',
]
# vLLM's examples/offline_inference/openai_batch/openai_example_batch.jsonl, verbatim.
VLLM_EXAMPLE = [
    '{"custom_id": "request-1", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "meta-llama/Meta-Llama-3-8B-Instruct", "messages": [{"role": "system", "content": "You are a helpful assistant."},{"role": "user", "content": "Hello world!"}],"max_completion_tokens": 1000}}',
    '{"custom_id": "request-2", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "meta-llama/Meta-Llama-3-8B-Instruct", "messages": [{"role": "system", "content": "You are an unhelpful assistant."},{"role": "user", "content": "Hello world!"}],"max_completion_tokens": 1000}}',
]

# vLLM's request models, read from vllm/entrypoints/openai/protocol.py at commit 0052bed3
# (ChatCompletionRequest and CompletionRequest fields; vLLM is not installed for the tests).
VLLM_CHAT_FIELDS = """messages model frequency_penalty logit_bias logprobs top_logprobs max_tokens
max_completion_tokens n presence_penalty response_format seed stop stream stream_options temperature
top_p tools tool_choice reasoning_effort include_reasoning parallel_tool_calls user best_of
use_beam_search top_k min_p repetition_penalty length_penalty stop_token_ids include_stop_str_in_output
ignore_eos min_tokens skip_special_tokens spaces_between_special_tokens truncate_prompt_tokens
prompt_logprobs allowed_token_ids bad_words echo add_generation_prompt continue_final_message
add_special_tokens documents chat_template chat_template_kwargs mm_processor_kwargs guided_json
guided_regex guided_choice guided_grammar structural_tag guided_decoding_backend
guided_whitespace_pattern priority request_id logits_processors return_tokens_as_token_ids cache_salt
kv_transfer_params vllm_xargs""".split()
VLLM_COMPLETION_FIELDS = """model prompt prompt_embeds best_of echo frequency_penalty logit_bias logprobs
max_tokens n presence_penalty seed stop stream stream_options suffix temperature top_p user
use_beam_search top_k min_p repetition_penalty length_penalty stop_token_ids include_stop_str_in_output
ignore_eos min_tokens skip_special_tokens spaces_between_special_tokens truncate_prompt_tokens
allowed_token_ids prompt_logprobs add_special_tokens response_format guided_json guided_regex
guided_choice guided_grammar guided_decoding_backend guided_whitespace_pattern priority request_id
logits_processors return_tokens_as_token_ids cache_salt kv_transfer_params vllm_xargs""".split()


def sdk_fields(module) -> set[str]:
    """Every key of the SDK's request TypedDicts (streaming and not: ``stream`` lives there)."""
    keys: set[str] = set()
    for cls in (module.CompletionCreateParamsBase, module.CompletionCreateParamsNonStreaming,
                module.CompletionCreateParamsStreaming):
        keys |= set(cls.__required_keys__) | set(cls.__optional_keys__)
    return keys


UPSTREAM = {
    ("chat", "OpenAI"): sdk_fields(chat_params),
    ("completions", "OpenAI"): sdk_fields(completion_params),
    ("chat", "vLLM"): set(VLLM_CHAT_FIELDS),
    ("completions", "vLLM"): set(VLLM_COMPLETION_FIELDS),
}


# ---- the field table --------------------------------------------------------------------
def test_every_upstream_field_is_classified_for_its_endpoint():
    for (endpoint, source), names in UPSTREAM.items():
        missing = sorted(names - set(fields_for(endpoint)))
        assert not missing, f"{source} {endpoint} fields not classified in worker/request/openai_fields.py: {missing}"


def test_the_table_says_truly_where_each_field_comes_from():
    for name, rule in RULES.items():
        sources = {s for (e, s), names in UPSTREAM.items() if name in names}
        assert sources, f"{name} is in no upstream request model"
        assert set(rule.source.split(", ")) == sources, name
        upstream_endpoints = {e for (e, s), names in UPSTREAM.items() if name in names}
        assert upstream_endpoints <= set(rule.endpoints), name


def test_readme_field_table_is_the_rendered_table():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "## OpenAI and vLLM batch fields" in readme
    assert render_table() in readme, "README's field table is stale: paste worker.request.openai_fields.render_table()"


# ---- lines ------------------------------------------------------------------------------
def chat(cid="a", **body):
    body.setdefault("messages", [{"role": "user", "content": "hi"}])
    return json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": body})


def completion(cid="c", **body):
    body.setdefault("prompt", "once")
    return json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/completions", "body": body})


ACCEPTED = {  # accepted and ignored: the line parses and its params are the plain defaults
    "metadata": {"topic": "x"}, "store": True, "service_tier": "flex", "stream": False, "modalities": ["text"],
    "reasoning_effort": "high", "safety_identifier": "s", "prompt_cache_key": "k",
    "verbosity": "low", "parallel_tool_calls": True, "tool_choice": "none", "request_id": "r",
    "response_format": {"type": "text"}, "tools": [], "echo": False, "best_of": 1,
}
REFUSED = {  # refused: the line is bad and the error names the field
    "stream": True, "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "auto",
    "modalities": ["text", "audio"], "audio": {"voice": "alloy", "format": "mp3"},
    "functions": [{"name": "f"}], "prediction": {"type": "content", "content": "x"},
    "stream_options": {"include_usage": True}, "guided_decoding_backend": "outlines", "echo": True, "best_of": 3,
    "use_beam_search": True, "logits_processors": ["x.y"],
    "web_search_options": {"search_context_size": "low"}, "prompt_logprobs": 1,
}


@pytest.mark.parametrize("name", sorted(ACCEPTED))
def test_accepted_fields_are_ignored(name):
    req = parse_line(chat(**{name: ACCEPTED[name]}), 1)
    assert isinstance(req, Request), req
    assert req.params == SamplingParams()


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_refused_fields_fail_their_line_naming_the_field(name):
    bad = parse_line(chat(**{name: REFUSED[name]}), 3)
    assert isinstance(bad, BadLine)
    assert bad.message.startswith(f"line 3: {name}: refused ("), bad.message
    assert error_param(bad.message) == name


@pytest.mark.parametrize("salt, ok", [("tenant-a", True), ("", False), (7, False), ("x" * 256, False)])
def test_cache_salt_is_kept_with_the_request_or_its_line_fails_naming_it(salt, ok):
    """vLLM's ``cache_salt``: the job keeps it (it reaches the engine's prefix cache and the
    result cache's key); a value that is not a string of 1-255 characters fails its line."""
    got = parse_line(chat(cache_salt=salt), 3)
    if ok:
        assert isinstance(got, Request) and got.cache_salt == salt and got.params == SamplingParams()
    else:
        assert isinstance(got, BadLine) and got.message.startswith("line 3: cache_salt: must be a string"), got


def test_non_text_content_parts_are_refused():
    image = [{"type": "image_url", "image_url": {"url": "https://x/y.png"}}]
    bad = parse_line(chat(messages=[{"role": "user", "content": image}]), 2)
    assert isinstance(bad, BadLine) and "only text parts are supported" in bad.message
    assert error_param(bad.message) == "messages.0.content"


def test_logprobs_fields_per_endpoint():
    assert parse_line(chat(logprobs=True, top_logprobs=4), 1).params.logprobs == 4
    assert parse_line(chat(logprobs=True), 1).params.logprobs == 0
    assert parse_line(chat(logprobs=False), 1).params.logprobs is None
    assert "top_logprobs: needs logprobs: true" in parse_line(chat(top_logprobs=2), 1).message
    assert "logprobs must be true or false" in parse_line(chat(logprobs=3), 1).message
    assert parse_line(completion(logprobs=3), 1).params.logprobs == 3
    assert "logprobs must be int" in parse_line(completion(logprobs=True), 1).message
    assert "top_logprobs: not a field of /v1/completions" in parse_line(completion(top_logprobs=2), 1).message
    assert "logprobs must be in [0, 20]" in parse_line(chat(logprobs=True, top_logprobs=21), 1).message


def test_logit_bias_takes_json_string_keys_and_checks_bounds():
    req = parse_line(chat(logit_bias={"65": -100, "66": 2.5}), 1)
    assert req.params.logit_bias == {65: -100.0, 66: 2.5}
    assert SamplingParams.from_dict(req.params.to_dict()) == req.params  # the stored JSON round-trips
    for bias, needle in [({"65": 101}, "logit_bias[65] must be in [-100, 100]"), ({"x": 1}, "logit_bias keys"),
                         ({"-3": 1}, "logit_bias keys"), ({"5": "a"}, "logit_bias[5] must be int or float"),
                         ([1], "logit_bias must be an object")]:
        bad = parse_line(chat(logit_bias=bias), 1)
        assert isinstance(bad, BadLine) and needle in bad.message, (bias, bad)


# ---- the pipeline: producer -> store -> engine -> store -> output lines ------------------
class BatchOutputLine(BaseModel):
    """One line of OpenAI's batch output or error file (the SDK has no type for the line)."""

    model_config = ConfigDict(extra="allow")  # specbatch adds its metrics under "specbatch"
    id: str
    custom_id: str | None
    response: dict[str, Any] | None
    error: BatchError | None


def validate_line(row: dict[str, Any], endpoint: str | None):
    """The SDK's types accept the line; returns the parsed body (or error)."""
    line = BatchOutputLine.model_validate(row)
    assert (line.response is None) != (line.error is None), row
    if line.error is not None:
        assert line.error.code and line.error.message
        return line.error
    response = line.response
    assert set(response) == {"status_code", "request_id", "body"}
    if response["status_code"] == 400:
        assert set(response["body"]) == {"error"}
        err = ErrorObject.model_validate(response["body"]["error"])
        assert err.type == "invalid_request_error"
        return err
    assert response["status_code"] == 200
    kind = ChatCompletion if endpoint == "chat" else Completion
    body = kind.model_validate(response["body"])
    assert body.model_dump(mode="json", exclude_unset=True, by_alias=True) == response["body"]  # nothing lost
    return body


def run_batch_in_process(client, llm, batch_id: str) -> None:
    """What the worker task does for each job, in-process: claim, run on the engine, store."""
    store, engine = client.store, llm.engine
    jobs = store.jobs(batch_id, statuses=["queued"])
    started = []
    for job in jobs:
        claim = store.claim(job.id, worker="test", device="cpu", lease_s=60, max_attempts=3)
        attempt = claim.attempt
        req = request_from_row(claim.job)
        try:
            request = engine.make_request(req.prompt, messages=req.messages, params=req.params, request_id=job.id)
        except ValueError as exc:
            store.fail(job.id, attempt, str(exc), "invalid_request")
            continue
        engine.add(request)
        started.append((job.id, attempt, request, req.params))
    while engine.has_unfinished():
        engine.step()
    for job_id, attempt, request, params in started:
        values = result_values(engine.make_output(request), logprobs=params.logprobs, pieces=engine.token_bytes.pieces)
        assert store.finish(job_id, attempt, values)


@pytest.fixture
def client(sqlite_url, redis_url, unique_queue):
    from worker.api.client import Client
    from worker.store.store import Store

    return Client(broker_url=redis_url, database_url=sqlite_url, queue=unique_queue,
                  store=Store(sqlite_url, auto_upgrade=True))


# OpenAI's API reference example line (the batch request input object), verbatim: it names OpenAI's model.
OPENAI_REFERENCE = [
    '{"custom_id": "request-1", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "gpt-4o-mini", "messages": [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "What is 2+2?"}]}}',
]
EXAMPLES = {"openai-reference": (OPENAI_REFERENCE, "gpt-4o-mini"), "openai-guide": (OPENAI_GUIDE, "gpt-3.5-turbo-0125"),
            "vllm": (VLLM_EXAMPLE, "meta-llama/Meta-Llama-3-8B-Instruct")}


@pytest.mark.parametrize("example", sorted(EXAMPLES))
def test_documented_example_files_run_unchanged_under_a_served_model_name(example, tiny_model_dir, sqlite_url,
                                                                           redis_url, unique_queue, tmp_path):
    """The user's file as published, naming its own model, on our model with --served-model-name
    (the model is the suite's tiny one under its own folder name, not saved under the file's name)."""
    from worker.api.client import Client
    from worker.store.store import Store

    lines, name = EXAMPLES[example]
    assert name.split("/")[-1] not in tiny_model_dir
    path = tmp_path / "batch.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    store = Store(sqlite_url, auto_upgrade=True)
    refused = Client(broker_url=redis_url, database_url=sqlite_url, queue=unique_queue, store=store,
                     model=tiny_model_dir).submit_batch(path, name="without the flag")
    assert refused.num_good == 0 and refused.num_bad == len(lines)
    assert all(f"pass --served-model-name {name}" in b.message for b in refused.bad_lines), refused.bad_lines

    client = Client(broker_url=redis_url, database_url=sqlite_url, queue=unique_queue, store=store,
                    model=tiny_model_dir, served_model_names=[name])
    sub = client.submit_batch(path, name="with the flag")
    assert not sub.bad_lines and sub.num_good == len(lines)
    llm = LLM(tiny_model_dir, device="cpu", max_model_len=256)
    run_batch_in_process(client, llm, sub.batch_id)
    rows = client.results(sub.batch_id)
    assert [r["custom_id"] for r in rows] == [f"request-{i}" for i in range(1, len(lines) + 1)]
    for row, job in zip(rows, client.store.jobs(sub.batch_id)):
        assert job.status == "succeeded" and job.model == tiny_model_dir
        body = validate_line(row, "chat")
        assert isinstance(body, ChatCompletion) and body.choices[0].message.content == job.output_text
        assert body.model == tiny_model_dir  # the output names the model that ran
        assert body.usage.prompt_tokens == job.num_prompt_tokens
        assert body.usage.completion_tokens == job.num_output_tokens
        assert body.usage.prompt_tokens_details.cached_tokens == job.num_cached_tokens


def test_a_single_job_naming_a_served_name_runs_on_the_clients_model(tiny_model_dir, client):
    from worker.api.client import Client

    served = Client(broker_url=client.settings.broker_url, database_url=client.settings.database_url,
                    queue=client.settings.queue, store=client.store, model=tiny_model_dir,
                    served_model_names=["gpt-4o-mini"])
    job_id = served.submit(messages=[{"role": "user", "content": "hi"}], model="gpt-4o-mini")
    assert served.store.get_job(job_id).model == tiny_model_dir


MIXED = [
    chat("greedy-lp", messages=[{"role": "user", "content": "tell me"}], max_tokens=12, temperature=0,
         logprobs=True, top_logprobs=3, ignore_eos=True),
    completion("comp-lp", prompt="abc abc", max_tokens=10, temperature=0, logprobs=2, ignore_eos=True),
    chat("n3", max_tokens=6, temperature=1.0, seed=7, n=3, ignore_eos=True),
    completion("n3-comp", prompt="xyz", max_tokens=5, n=3, seed=1, logprobs=0, ignore_eos=True),
    chat("bad-stream", stream=True),
    chat("bad-tools", tools=[{"type": "function", "function": {"name": "f"}}]),
    chat("bad-bias-id", logit_bias={"99999": 5}, max_tokens=3),  # fails at the worker (vocabulary)
    "{not json",
    chat("shared-1", messages=[{"role": "system", "content": "S" * 80}, {"role": "user", "content": "a"}],
         max_tokens=2, temperature=0),
]


def test_every_output_and_error_line_validates_against_the_sdk(tiny_model_dir, client):
    sub = client.submit_batch(MIXED, model=tiny_model_dir)
    llm = LLM(tiny_model_dir, device="cpu", max_model_len=512)
    run_batch_in_process(client, llm, sub.batch_id)
    # A second batch sharing the long system prompt hits the prefix cache.
    shared = [chat("shared-2", messages=[{"role": "system", "content": "S" * 80}, {"role": "user", "content": "b"}],
                   max_tokens=2, temperature=0)]
    sub2 = client.submit_batch(shared, model=tiny_model_dir)
    run_batch_in_process(client, llm, sub2.batch_id)
    jobs = {j.custom_id or f"line-{j.line_no}": j for j in client.store.jobs(sub.batch_id) + client.store.jobs(sub2.batch_id)}
    rows = {r["custom_id"] or f"line-{r['specbatch']['line']}": r
            for r in client.results(sub.batch_id) + client.results(sub2.batch_id)}
    assert len(rows) == len(MIXED) + 1
    parsed = {cid: validate_line(row, jobs[cid].endpoint) for cid, row in rows.items()}

    # usage is the store's counts, cached tokens included (and the second prompt did hit the cache)
    for cid, job in jobs.items():
        if job.status == "succeeded":
            usage = parsed[cid].usage
            assert (usage.prompt_tokens, usage.completion_tokens) == (job.num_prompt_tokens, job.num_output_tokens)
            assert usage.total_tokens == job.num_prompt_tokens + job.num_output_tokens
            assert usage.prompt_tokens_details.cached_tokens == job.num_cached_tokens
    assert jobs["shared-2"].num_cached_tokens > 0

    # n = 3 returns three choices, each with its own text; usage counts all of them
    assert [c.index for c in parsed["n3"].choices] == [0, 1, 2]
    assert len({c.message.content for c in parsed["n3"].choices}) > 1
    assert parsed["n3"].usage.completion_tokens == 18
    assert len(parsed["n3-comp"].choices) == 3, parsed["n3-comp"]
    assert all(len(c.logprobs.tokens) == 5 for c in parsed["n3-comp"].choices), parsed["n3-comp"]

    # errors: invalid lines are 400 responses naming the field; the bad token id failed at the worker
    for cid, param in [("bad-stream", "stream"), ("bad-tools", "tools"), ("bad-bias-id", "logit_bias")]:
        err = parsed[cid]
        assert isinstance(err, ErrorObject) and err.param == param, (cid, err)
    assert "outside the vocabulary" in parsed["bad-bias-id"].message
    assert rows["line-8"]["response"]["status_code"] == 400 and parsed["line-8"].message.startswith("line 8: malformed JSON")

    # chat logprobs: token text, bytes that join back into the text, top-3 best first, top-1 is the token
    content = parsed["greedy-lp"].choices[0].logprobs.content
    assert len(content) == 12
    assert b"".join(bytes(t.bytes) for t in content).decode("utf-8", errors="replace") == parsed["greedy-lp"].choices[0].message.content
    for t in content:
        assert len(t.top_logprobs) == 3
        assert [a.logprob for a in t.top_logprobs] == sorted((a.logprob for a in t.top_logprobs), reverse=True)
        assert t.top_logprobs[0].token == t.token and t.top_logprobs[0].logprob == t.logprob
    # completions logprobs: tokens, logprobs, the alternatives with the token, offsets into the text
    lp = parsed["comp-lp"].choices[0].logprobs
    assert "".join(lp.tokens) == parsed["comp-lp"].choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    # (two ids with the same text, e.g. two partial UTF-8 bytes shown as U+FFFD, share one key)
    assert all(tok in top and len(top) <= 3 for tok, top in zip(lp.tokens, lp.top_logprobs))
    assert max(len(top) for top in lp.top_logprobs) == 2


def test_greedy_logprobs_equal_the_engines_own(tiny_model_dir, client):
    """The logprobs in the output line are the engine's, unchanged, and greedy's top-1 is the token."""
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=5)
    llm = LLM(tiny_model_dir, device="cpu", max_model_len=512)
    want = llm.generate(["the quick brown fox"], params, use_tqdm=False)[0].outputs[0]
    sub = client.submit_batch([completion("g", prompt="the quick brown fox", max_tokens=16, temperature=0,
                                          ignore_eos=True, logprobs=5)], model=tiny_model_dir)
    run_batch_in_process(client, LLM(tiny_model_dir, device="cpu", max_model_len=512), sub.batch_id)
    job = client.store.jobs(sub.batch_id)[0]
    sample = job.outputs[0]
    assert sample["token_ids"] == want.token_ids
    for token, (lp, top), engine_lp in zip(want.token_ids, sample["logprobs"], want.logprobs):
        assert lp == engine_lp[token]
        assert top[0][0] == token  # greedy: the chosen token is the most likely one
        assert {t: v for t, v in top} == {t: v for t, v in engine_lp.items() if t in dict(top)}
        assert len(top) == 5
    body = validate_line(output_line(job), "completions")
    assert body.choices[0].logprobs.token_logprobs == [e[t] for t, e in zip(want.token_ids, want.logprobs)]


def test_error_param_reads_the_field_back():
    assert error_param("line 3: top_p must be in (0, 1], got 2") == "top_p"
    assert error_param("line 3: invalid params: top_p must be in (0, 1], got 2") == "top_p"
    assert error_param("line 3: frobnicate: unknown field") == "frobnicate"
    assert error_param("line 3: prompt is 3000 tokens, over the model's context") is None
    assert error_param("line 9: malformed JSON: Expecting value at column 1") is None
    assert error_param("logit_bias: token id 99999 is outside the vocabulary [0, 259)") == "logit_bias"
    job = SimpleNamespace(id="j", custom_id="x", line_no=2, status="failed", error="model step failed: boom",
                          error_type="generation_error", attempts=1, worker="w", device="cpu", queue_wait_s=None,
                          ttft_s=None, tpot_s=None, tokens_per_s=None, enqueued_at=1.0, started_at=None,
                          first_token_at=None, finished_at=2.0, num_cached_tokens=None, num_draft_tokens=None,
                          num_accepted_tokens=None, max_batch_size=None, user=None, output_text=None)
    line = output_line(job)
    assert line["response"] is None and line["error"] == {"code": "generation_error", "message": "line 2: model step failed: boom"}
    assert isinstance(validate_line(line, None), BatchError)
