"""Input parsing (OpenAI Batch + plain lines) and output lines."""

from __future__ import annotations

import json
from types import SimpleNamespace

from engine.sampling_params import DEFAULT_MAX_TOKENS, SamplingParams
from worker.request.formats import BadLine, Request, output_line, parse_line


def chat_line(cid="a", **body):
    body.setdefault("messages", [{"role": "user", "content": "hi"}])
    return json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": body})


def test_openai_chat_line():
    req = parse_line(chat_line(max_tokens=5, temperature=0, stop="\n", seed=3, model="x"), 1)
    assert isinstance(req, Request)
    assert req.endpoint == "chat" and req.custom_id == "a"
    assert req.params == SamplingParams(max_tokens=5, temperature=0, stop=["\n"], seed=3)
    assert req.messages == [{"role": "user", "content": "hi"}]


def test_openai_completion_line_and_token_prompt():
    line = json.dumps({"custom_id": "c", "method": "POST", "url": "/v1/completions",
                       "body": {"prompt": "Once", "max_completion_tokens": 7, "n": 2}})
    req = parse_line(line, 2)
    assert req.endpoint == "completions" and req.prompt == "Once"
    assert req.params == SamplingParams(max_tokens=7, n=2)
    line = json.dumps({"custom_id": "t", "url": "/v1/completions", "body": {"prompt": [1, 2, 3]}})
    assert parse_line(line, 3).prompt_token_ids == [1, 2, 3]


def test_plain_lines():
    req = parse_line('{"prompt": "hello", "max_tokens": 4}', 7)
    assert req.custom_id == "line-7" and req.prompt == "hello" and req.params.max_tokens == 4
    req = parse_line('{"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}]}', 8)
    assert req.endpoint == "chat" and req.messages[0]["content"] == "x"
    assert req.params.max_tokens == DEFAULT_MAX_TOKENS


def test_bad_lines_name_the_cause():
    cases = {
        "{not json": "malformed JSON",
        "[1, 2]": "expected a JSON object",
        chat_line(max_tokens="many"): "max_tokens",
        chat_line(frobnicate=1): "frobnicate: unknown field",
        chat_line(temperature=-1): "temperature",
        json.dumps({"custom_id": "x", "url": "/v1/embeddings", "body": {}}): "url",
        json.dumps({"custom_id": "x", "url": "/v1/completions", "body": {"prompt": ""}}): "prompt",
        '{"prompt": "a", "messages": [{"role": "user", "content": "b"}]}': "exactly one",
        chat_line(min_tokens=9, max_tokens=2): "invalid params: min_tokens",
        chat_line(messages=[]): "messages",
    }
    for text, needle in cases.items():
        bad = parse_line(text, 4)
        assert isinstance(bad, BadLine), text
        assert needle in bad.message and bad.message.startswith("line 4:"), (text, bad.message)


def test_a_truncated_line_says_so_and_names_its_custom_id():
    """A file cut mid-line: the line is called truncated and keeps the custom_id it shows, not
    "malformed JSON at column 1" with custom_id None."""
    full = chat_line("req-7")
    cut = parse_line(full[: len(full) // 2], 12)
    assert cut.message.startswith("line 12: truncated JSON: the line ends before its object does (")
    assert cut.custom_id == "req-7"
    split = parse_line('{"custom_id": "req-8", "body": {', 13)
    assert "truncated JSON" in split.message and split.custom_id == "req-8"
    wrong = parse_line('{"custom_id": "req-9" "body": {}}', 14)  # not cut: a missing comma
    assert wrong.message == "line 14: malformed JSON: Expecting ',' delimiter at column 23"
    assert wrong.custom_id == "req-9"


def _job(**kw):
    base = dict(id="j1", custom_id="a", line_no=1, status="succeeded", endpoint="chat", model="m",
                output_text="hey", outputs=None, finish_reason="stop", num_prompt_tokens=3,
                num_output_tokens=2, num_cached_tokens=0, num_draft_tokens=0, num_accepted_tokens=0,
                error=None, error_type=None, attempts=1, worker="w", device="cpu", queue_wait_s=0.1,
                ttft_s=0.2, tpot_s=0.01, tokens_per_s=50.0, enqueued_at=1.0, started_at=1.1,
                first_token_at=1.3, finished_at=1.4, max_batch_size=3, user=None)
    base.update(kw)
    return SimpleNamespace(**base)


def test_output_lines():
    ok = output_line(_job())
    assert ok["response"]["status_code"] == 200 and ok["error"] is None
    body = ok["response"]["body"]
    assert body["object"] == "chat.completion" and body["choices"][0]["message"]["content"] == "hey"
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    assert ok["specbatch"]["ttft_s"] == 0.2
    comp = output_line(_job(endpoint="completions"))["response"]["body"]
    assert comp["object"] == "text_completion" and comp["choices"][0]["text"] == "hey"
    bad = output_line(_job(status="failed", error="malformed JSON", error_type="invalid_input", line_no=9))
    assert bad["error"] is None and bad["response"] == {
        "status_code": 400, "request_id": "j1",
        "body": {"error": {"message": "line 9: malformed JSON", "type": "invalid_request_error", "param": None,
                           "code": "invalid_input"}}}
    failed = output_line(_job(status="failed", error="model step failed: x", error_type="generation_error", line_no=9))
    assert failed["response"] is None
    assert failed["error"] == {"code": "generation_error", "message": "line 9: model step failed: x"}


from hypothesis import given, settings, strategies as st

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(
        ["custom_id", "url", "body", "prompt", "messages", "max_tokens", "role", "content", "n", "x"]), inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.text(max_size=40), json_values.map(json.dumps)))
def test_any_line_parses_or_names_its_line(text):
    """Whatever a line holds, parsing never raises: a request, or an error naming the line."""
    item = parse_line(text, 12)
    assert isinstance(item, (Request, BadLine))
    if isinstance(item, BadLine):
        assert item.message.startswith("line 12: ")
