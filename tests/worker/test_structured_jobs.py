"""Structured output through the real queue: batch lines with ``response_format`` go from the
producer into SQLite and Redis, a real worker process generates them, and the store keeps
only complete, valid records as successes (issue #13)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from worker.common.config import Settings
from worker.request.formats import output_line
from worker.store.models import FAILED, SUCCEEDED

from tests.worker.test_integration import start_worker

pytestmark = pytest.mark.integration

SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no", "maybe"]},
                                           "sure": {"type": "boolean"}},
          "required": ["answer", "sure"], "additionalProperties": False}


def line(cid: str, max_tokens: int = 40, **body) -> dict:
    body = {"model": "m", "messages": [{"role": "user", "content": f"question {cid}"}], "max_tokens": max_tokens,
            "temperature": 1.0, **body}
    return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": body}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from tests.helpers.tiny_models import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("tiny") / "m"))


def test_response_format_lines_through_a_real_worker(sqlite_url, redis_url, unique_queue, tiny_model, tmp_path):
    from worker.api.client import Client

    schema_format = {"type": "json_schema", "json_schema": {"name": "answer", "strict": True, "schema": SCHEMA}}
    lines = [line(f"s{i}", response_format=schema_format) for i in range(6)] + [
        line("cut", max_tokens=3, response_format=schema_format),  # cut mid-record by max_tokens
        line("bad-schema", response_format={"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}),
        line("plain", max_tokens=5),
    ]
    client = Client(broker_url=redis_url, database_url=sqlite_url, model=tiny_model, queue=unique_queue)
    settings = Settings(broker_url=redis_url, database_url=sqlite_url, model=tiny_model, device="cpu",
                        queue=unique_queue)
    sub = client.submit_batch(lines, model=tiny_model)
    assert not sub.bad_lines
    worker = start_worker(client, settings, tmp_path, seqs=8)
    try:
        counts = client.wait(sub.batch_id, timeout=120)
    finally:
        worker.stop()
    jobs = {j.custom_id: j for j in client.store.jobs(sub.batch_id)}
    assert counts["succeeded"] == 7 and counts["failed"] == 2, counts
    for i in range(6):
        job = jobs[f"s{i}"]
        assert job.status == SUCCEEDED and job.finish_reason == "stop"
        content = output_line(job)["response"]["body"]["choices"][0]["message"]["content"]
        jsonschema.validate(json.loads(content), SCHEMA)
    cut = jobs["cut"]
    assert cut.status == FAILED and cut.error_type == "structured_output_incomplete"
    assert cut.finish_reason == "length" and cut.num_output_tokens == 3 and cut.output_text  # kept for inspection
    assert "cut by max_tokens after 3 tokens" in cut.error
    assert output_line(cut)["error"]["code"] == "structured_output_incomplete"
    from click.testing import CliRunner

    from worker.api.cli import cli

    for command in ("status", "export"):  # both show what the cut job generated
        res = CliRunner().invoke(cli, ["--database-url", sqlite_url, command, cut.id])
        assert res.exit_code == 0, res.output
        shown = json.loads(res.stdout)["specbatch"]
        assert shown["partial_text"] == cut.output_text, command
    bad = jobs["bad-schema"]
    assert bad.status == FAILED and bad.error_type == "invalid_request"
    assert bad.error.startswith("structured_outputs: the json does not compile") and "nope" in bad.error
    assert output_line(bad)["response"]["status_code"] == 400
    assert jobs["plain"].status == SUCCEEDED and jobs["plain"].num_output_tokens <= 5


def test_submit_json_schema_file_stores_the_constraint(sqlite_url, redis_url, unique_queue, tiny_model, tmp_path):
    from click.testing import CliRunner

    from worker.api.cli import cli
    from worker.store.store import Store

    path = tmp_path / "schema.json"
    path.write_text(json.dumps(SCHEMA))
    servers = ["--broker-url", redis_url, "--database-url", sqlite_url]
    env = {"SPECBATCH_QUEUE": unique_queue}
    res = CliRunner().invoke(cli, [*servers, "submit", "Is it?", "--chat", "--model", tiny_model,
                                   "--json-schema", str(path)], env=env)
    assert res.exit_code == 0, res.output
    job = Store(sqlite_url).get_job(res.output.strip().splitlines()[-1])
    assert job.params["structured_outputs"] == {"json": SCHEMA}
    path.write_text("{not json")
    res = CliRunner().invoke(cli, [*servers, "submit", "x", "--model", tiny_model, "--json-schema", str(path)], env=env)
    assert res.exit_code == 2 and "not a JSON file" in res.output
