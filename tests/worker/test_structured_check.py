"""The store's second check of a structured job's output (``worker.request.structured``) and the batch
fields that ask for structured output (``response_format``, vLLM's ``guided_*``)."""

from __future__ import annotations

import json

from engine import SamplingParams, StructuredOutputsParams
from worker.request.formats import BadLine, error_param, parse_line
from worker.request.structured import INCOMPLETE, INVALID, check_samples

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 5}, "s": {"type": "string"}},
          "required": ["n"]}


def chat(**body):
    body.setdefault("messages", [{"role": "user", "content": "hi"}])
    return json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": body})


def test_check_samples():
    spec = StructuredOutputsParams(json=SCHEMA)
    assert check_samples(spec, [('{"n": 3}', "stop", 5)]) is None
    kind, message = check_samples(spec, [('{"n": 3', "length", 4)])
    assert kind == INCOMPLETE and "cut by max_tokens after 4 tokens" in message
    kind, message = check_samples(spec, [('{"n": 9}', "stop", 5)])
    assert kind == INVALID and "at $.n" in message and "maximum" in message
    kind, message = check_samples(spec, [('{"n": 1}', "stop", 5), ("{", "stop", 1)])
    assert kind == INVALID and message.startswith("sample 1: output is not valid JSON")
    assert check_samples(StructuredOutputsParams(json_object=True), [("[1]", "stop", 3)])[0] == INVALID
    assert check_samples(StructuredOutputsParams(choice=["a", "b"]), [("b", "stop", 1)]) is None
    assert check_samples(StructuredOutputsParams(choice=["a", "b"]), [("c", "stop", 1)])[0] == INVALID
    assert check_samples(StructuredOutputsParams(regex="[0-9]+"), [("12x", "stop", 2)])[0] == INVALID
    bad_schema = StructuredOutputsParams(json={"type": 12})
    assert "schema itself is invalid" in check_samples(bad_schema, [("{}", "stop", 1)])[1]


def test_response_format_and_guided_fields_become_structured_outputs():
    schema_format = {"type": "json_schema", "json_schema": {"name": "x", "strict": True, "schema": SCHEMA}}
    assert parse_line(chat(response_format=schema_format), 1).params.structured_outputs == \
        StructuredOutputsParams(json=SCHEMA)
    assert parse_line(chat(response_format={"type": "json_object"}), 1).params.structured_outputs.json_object
    assert parse_line(chat(response_format={"type": "text"}), 1).params == SamplingParams()
    assert parse_line(chat(guided_json=SCHEMA), 1).params.structured_outputs.json == SCHEMA
    assert parse_line(chat(guided_regex="a+"), 1).params.structured_outputs.regex == "a+"
    assert parse_line(chat(guided_choice=["x", "y"]), 1).params.structured_outputs.choice == ["x", "y"]
    assert parse_line(chat(guided_grammar='root ::= "a"'), 1).params.structured_outputs.grammar == 'root ::= "a"'
    for body, needle, param in [
        ({"response_format": {"type": "json_schema"}}, "response_format:", "response_format"),
        ({"response_format": {"type": "yaml"}}, "type must be text, json_object or json_schema", "response_format"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "give one structured output constraint",
         "guided_regex"),
        ({"guided_choice": []}, "choice must be a non-empty list", "guided_choice"),
        ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern: refused", "guided_whitespace_pattern"),
    ]:
        bad = parse_line(chat(**body), 4)
        assert isinstance(bad, BadLine) and needle in bad.message, (body, bad)
        assert error_param(bad.message) == param, bad.message
