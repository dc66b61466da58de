"""``specbatch run`` end to end on a tiny model: a mixed good/bad file gives one output line per
input line and a non-zero exit; rerunning the same file skips what succeeded."""

from __future__ import annotations

import json
import re
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.integration


def chat(cid, content, **body):
    return json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
                       "body": {"messages": [{"role": "user", "content": content}], **body}})


def run_cli(args, env, cwd):
    return subprocess.run([sys.executable, "-m", "worker.api.cli", *args], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=240)


def setup_run(tmp_path, redis_url, unique_queue, lines):
    """Input file, output path, environment and server flags for one ``specbatch run``."""
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(lines) + "\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT), SPECBATCH_QUEUE=unique_queue,
               SPECBATCH_WORKER_LOG=str(tmp_path / "worker.log"))
    env.pop("DATABASE_URL", None)
    servers = ["--broker-url", redis_url, "--database-url", f"sqlite:///{tmp_path / 'sb.db'}"]
    return src, tmp_path / "out.jsonl", env, servers


def test_run_mixed_file(tmp_path, redis_url, unique_queue):
    from tests.helpers.tiny_models import make_tiny_model

    model = str(make_tiny_model(tmp_path / "tiny"))
    lines = [
        chat("ok-1", "hello", max_tokens=8, temperature=0),
        "{this is not json",
        chat("ok-2", "world", max_tokens=8, temperature=0.5, seed=3),
        chat("bad-field", "x", max_tokens=8, frobnicate=True),
        json.dumps({"custom_id": "ok-3", "url": "/v1/completions", "body": {"prompt": "abc", "max_tokens": 5, "n": 2}}),
        chat("too-long", "y" * 3000, max_tokens=4),
        chat("bad-param", "z", max_tokens=0),
        '{"prompt": "plain line", "max_tokens": 6}',
        chat("ok-1", "duplicate id", max_tokens=8),
        chat("served", "hi", model="gpt-4o-mini", max_tokens=4, max_completion_tokens=3),  # the file's own model name
        chat("other-model", "hi", model="gpt-9", max_tokens=4),
    ]
    src, out, env, servers = setup_run(tmp_path, redis_url, unique_queue, lines)
    args = [*servers, "run", str(src), "-o", str(out), "--model", model, "--max-num-seqs", "8",
            "--served-model-name", "gpt-4o-mini"]
    res = run_cli(args, env, tmp_path)
    assert res.returncode == 1, res.stderr[-3000:]
    rows = [json.loads(l) for l in out.read_text().splitlines()]
    assert len(rows) == len(lines)
    by_line = {r["specbatch"]["line"]: r for r in rows}
    assert sorted(by_line) == list(range(1, len(lines) + 1))
    for n in (1, 3, 5, 8, 10):
        assert by_line[n]["error"] is None and by_line[n]["response"]["status_code"] == 200, by_line[n]
    assert by_line[10]["response"]["body"]["usage"]["completion_tokens"] <= 3  # max_completion_tokens wins
    assert len(by_line[5]["response"]["body"]["choices"]) == 2
    assert by_line[5]["response"]["body"]["object"] == "text_completion"
    assert by_line[8]["custom_id"] == "line-8"
    expected = {2: "malformed JSON", 4: "frobnicate: unknown field", 6: "over the model's context",
                7: "max_tokens", 9: "duplicate custom_id", 11: "pass --served-model-name gpt-9"}
    for n, needle in expected.items():  # OpenAI's error-file shape for invalid requests
        assert by_line[n]["error"] is None and by_line[n]["response"]["status_code"] == 400, by_line[n]
        err = by_line[n]["response"]["body"]["error"]
        assert err["type"] == "invalid_request_error", err
        assert err["message"].startswith(f"line {n}:") and needle in err["message"], err
    flat = " ".join(res.stderr.split())
    assert f"6 line(s) failed (error lines in {out}):" in flat  # each has its error line
    assert re.search(r"│ lines\s+│ failed 6 succeeded 5\s+│", res.stderr), res.stderr  # every line, as the bar counts
    assert "TTFT p50" in res.stderr

    # Rerun: nothing succeeded is generated again; the output still has every line.
    first = {r["custom_id"]: r["response"]["body"]["choices"] for r in rows if (r["response"] or {}).get("status_code") == 200}
    res2 = run_cli(args, env, tmp_path)
    assert res2.returncode == 1
    assert "enqueued 0 (published 0 so far), already succeeded 5" in " ".join(res2.stderr.split())
    rows2 = [json.loads(l) for l in out.read_text().splitlines()]
    assert len(rows2) == len(lines)
    assert {r["custom_id"]: r["response"]["body"]["choices"] for r in rows2 if (r["response"] or {}).get("status_code") == 200} == first


def test_run_with_speculation_records_drafts(tmp_path, redis_url, unique_queue):
    """``--speculative ngram:4`` reaches the local worker's engine; drafts are counted per job."""
    from tests.helpers.tiny_models import make_tiny_model

    model = str(make_tiny_model(tmp_path / "tiny"))
    # A random tiny model falls into loops quickly: prompt lookup has plenty to propose.
    lines = [chat(f"s-{i}", "abcabcabc " * 4, max_tokens=48, temperature=0, ignore_eos=True) for i in range(4)]
    src, out, env, servers = setup_run(tmp_path, redis_url, unique_queue, lines)
    args = [*servers, "run", str(src), "-o", str(out), "--model", model, "--max-num-seqs", "4", "--speculative", "ngram:4"]
    res = run_cli(args, env, tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(l) for l in out.read_text().splitlines()]
    assert all(r["error"] is None for r in rows)
    assert sum(r["specbatch"]["num_draft_tokens"] for r in rows) > 0
    assert sum(r["specbatch"]["num_accepted_tokens"] for r in rows) > 0
    assert "draft acceptance" in res.stdout + res.stderr


def test_run_whose_engine_cannot_be_built_fails_at_once_with_its_cause(tmp_path, redis_url, unique_queue):
    """A deterministic start failure (exit 3) is not restarted ten times over minutes: the
    cause itself, exception type and message, is on the user's terminal, with the log named."""
    import torch

    from tests.helpers.tiny_models import make_tiny_model

    model = str(make_tiny_model(tmp_path / "tiny"))
    # No CUDA here: cuda:0 cannot be built; on a GPU machine, a device index past the last.
    device = "cuda:0" if not torch.cuda.is_available() else f"cuda:{torch.cuda.device_count() + 7}"
    src, out, env, servers = setup_run(tmp_path, redis_url, unique_queue, [chat("a", "hello", max_tokens=4)])
    res = run_cli([*servers, "run", str(src), "-o", str(out), "--model", model, "--device", device], env, tmp_path)
    assert res.returncode == 1, res.stdout[-3000:] + res.stderr[-3000:]
    said = " ".join((res.stdout + res.stderr).split())
    assert "the local worker cannot start (exit 3): engine could not be built:" in said, said[-3000:]
    assert "Error(" in said and str(tmp_path / "worker.log") in said, said[-3000:]  # e.g. RuntimeError('…')
    assert "restarted" not in said
    log = (tmp_path / "worker.log").read_text()
    assert log.count("worker exiting with 3") == 1, log[-3000:]  # one start, no restarts
