"""What a new user meets in the first hour, each on the real CLI: ``submit --wait`` with nobody
consuming starts a worker (or says which to start), ``export JOB``, ``cancel`` of an unknown id
fails, ``status`` lists single jobs on stdout within 80 columns, error columns are right.

(A line naming an unknown model is a clear error for that line, already: see
``tests/worker/test_request.py::test_unknown_model_is_an_error_unless_it_is_the_batch_model`` and
``test_producer_stores_full_params_with_a_seed`` in the same file.)"""

from __future__ import annotations

import io
import json

import pytest
from click.testing import CliRunner
from rich.console import Console

from worker.api.cli import cli
from worker.request.formats import parse_line
from worker.store.models import SUCCEEDED
from worker.api.status_view import render, take_snapshot
from worker.store.rows import job_row
from worker.store.store import Store

from tests.helpers.batches import ingest_lines, job_ids


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from tests.helpers.tiny_models import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("tiny-cli") / "model"))


def _finish(store: Store, job_id: str) -> None:
    attempt = store.claim(job_id, worker="w", device="cpu", lease_s=60, max_attempts=3).attempt
    store.finish(job_id, attempt, {"status": SUCCEEDED, "output_text": "hi", "finished_at": 1.0})


def test_cancel_of_an_unknown_id_fails(sqlite_url, redis_url):
    res = CliRunner().invoke(cli, ["--broker-url", redis_url, "--database-url", sqlite_url, "cancel", "no-such-id"])
    assert res.exit_code == 1 and "no batch or job 'no-such-id'" in res.output


def test_export_a_job_and_a_batch(sqlite_url):
    store = Store(sqlite_url)
    batch_id = ingest_lines(store, [{"custom_id": f"c{i}", "prompt": f"p{i}"} for i in (1, 2, 3)], name="b").batch_id
    ids = job_ids(store, batch_id)
    _finish(store, ids[0])
    _finish(store, ids[2])
    db = ["--database-url", sqlite_url]
    one = CliRunner().invoke(cli, [*db, "export", ids[2]])
    assert one.exit_code == 0, one.output
    [line] = one.stdout.splitlines()
    assert json.loads(line)["custom_id"] == "c3" and json.loads(line)["response"]["status_code"] == 200
    pending = CliRunner().invoke(cli, [*db, "export", ids[1]])
    assert pending.exit_code == 1 and f"job {ids[1]} is queued" in pending.output
    whole = CliRunner().invoke(cli, [*db, "export", "b"])
    assert [json.loads(l)["custom_id"] for l in whole.stdout.splitlines()] == ["c1", "c3"]
    assert CliRunner().invoke(cli, [*db, "export", "nothing"]).exit_code == 1


def test_status_lists_single_jobs_on_stdout_within_80_columns(sqlite_url):
    store = Store(sqlite_url)
    job = job_row(model="a-model-with-a-rather-long-name-for-a-narrow-terminal", prompt="x", custom_id="my-own-id")
    store.upsert_jobs([job])
    job_id = job["id"]
    res = CliRunner().invoke(cli, ["--database-url", sqlite_url, "status", "--once"])
    assert res.exit_code == 0 and "single jobs" in res.stdout and job_id in res.stdout
    narrow = Console(file=io.StringIO(), width=80)
    narrow.print(render(take_snapshot(store), False))
    text = narrow.file.getvalue()
    line = next(l for l in text.splitlines() if job_id in l)
    assert line.split()[:2] == [job_id, "queued"]  # the id whole, then its status
    assert max(len(l) for l in text.splitlines()) <= 80


def test_error_columns_are_the_ones_an_editor_shows():
    # Characters, counted from 1 (é is one column though two bytes).
    bad = parse_line('{"prompt": "é" "max_tokens": 3}'.encode(), 4)
    assert bad.message == "line 4: malformed JSON: Expecting ',' delimiter at column 16"
    bad = parse_line(b'{"prompt": "\xc3\xa9 \xff"}', 2)
    assert bad.message == "line 2: not UTF-8 text: byte 0xff at column 15"
    bad = parse_line(b'\xef\xbb\xbf{"prompt": "a \xff"}', 1)  # the BOM is not a column
    assert bad.message == "line 1: not UTF-8 text: byte 0xff at column 15"
    bad = parse_line(b'{"prompt": "a\tb"}', 7)
    assert bad.message == "line 7: malformed JSON: Invalid control character at column 14"


@pytest.mark.parametrize("broker", ["embedded", "redis"])
def test_submit_wait_starts_a_worker_when_none_consumes(broker, sqlite_url, redis_url, unique_queue, tiny_model,
                                                        tmp_path):
    """On the embedded defaults (the issue's case: nobody else can reach that Redis) and on a
    shared Redis that no worker consumes."""
    servers = ["--database-url", sqlite_url] + (["--broker-url", redis_url] if broker == "redis" else [])
    env = {"SPECBATCH_QUEUE": unique_queue, "SPECBATCH_WORKER_LOG": str(tmp_path / "worker.log"),
           **({"REDIS_URL": None, "SPECBATCH_BROKER_URL": None} if broker == "embedded" else {})}
    res = CliRunner().invoke(cli, [*servers, "submit", "hello", "--model", tiny_model, "--max-tokens", "3",
                                   "--wait", "300"], env=env)
    assert res.exit_code == 0, res.output + (tmp_path / "worker.log").read_text()[-3000:]
    assert "starting one on cpu" in res.stderr
    job_id, line = res.stdout.strip().splitlines()
    out = json.loads(line)
    assert out["response"]["status_code"] == 200 and out["specbatch"]["job_id"] == job_id


def test_submit_wait_without_a_worker_says_which_to_start(sqlite_url, redis_url, unique_queue):
    servers = ["--broker-url", redis_url, "--database-url", sqlite_url]
    res = CliRunner().invoke(cli, [*servers, "submit", "hello", "--model", "some-model", "--wait", "1",
                                   "--no-local-worker"], env={"SPECBATCH_QUEUE": unique_queue})
    assert res.exit_code == 1
    assert res.stderr.strip().splitlines()[-1] == (
        f"Error: job {res.stdout.split()[0]} still queued after 1 s; is a worker running? "
        "(`specbatch worker --model some-model`)")


def test_detach_refuses_the_embedded_broker(sqlite_url, tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "x"}\n')
    res = CliRunner().invoke(cli, ["--database-url", sqlite_url, "run", str(src), "--detach"],
                             env={"REDIS_URL": None, "SPECBATCH_BROKER_URL": None})
    assert res.exit_code == 2 and "--detach needs a broker that outlives this command" in res.output
