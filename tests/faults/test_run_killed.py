"""``specbatch run`` killed mid-run (SIGKILL to it, its local worker and that worker's engine, as a
lost machine would): the output file it leaves is valid JSONL, an ordered prefix of the input,
and running the same command again completes it with every line exactly once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.faults.conftest import FAST_RECOVERY_ENV, process_gone, wait_until

ROOT = Path(__file__).resolve().parents[2]
N_GOOD = 240


def _lines() -> list[str]:
    lines = [json.dumps({"custom_id": f"k{i}", "method": "POST", "url": "/v1/chat/completions",
                         "body": {"messages": [{"role": "user", "content": f"count to {i}"}], "max_tokens": 48,
                                  "temperature": 0, "ignore_eos": True}})
             for i in range(1, N_GOOD + 1)]
    lines.insert(100, "{broken")  # line 101: one bad line, which must be in the output once too
    return lines


def _whole_lines(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


def _read(path: Path) -> list[dict]:
    text = path.read_text(encoding="utf-8") if path.exists() else ""
    assert text == "" or text.endswith("\n"), "a torn last line"
    return [json.loads(line) for line in text.splitlines()]


@pytest.mark.waits(35)
def test_a_run_killed_mid_way_leaves_valid_jsonl_that_a_rerun_completes_once(redis_url, sqlite_url, unique_queue,
                                                                             tiny_model, tmp_path):
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(_lines()) + "\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT), SPECBATCH_QUEUE=unique_queue, **FAST_RECOVERY_ENV,
               SPECBATCH_WORKER_LOG=str(tmp_path / "worker.log"))
    env.pop("DATABASE_URL", None)
    cmd = [sys.executable, "-m", "worker.api.cli", "--broker-url", redis_url, "--database-url", sqlite_url,
           "run", str(src), "-o", str(out), "--model", tiny_model, "--max-num-seqs", "4"]
    with open(tmp_path / "first.log", "wb") as log:
        first = subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=log, stderr=log, start_new_session=True)
        try:
            wait_until(lambda: first.poll() is not None or _whole_lines(out) >= 3, timeout=240, poll=0.02,
                       what="the first results in the output file")
        finally:
            os.killpg(first.pid, signal.SIGKILL)  # the CLI, its local worker and the worker's engine
            first.wait()
    assert first.returncode == -signal.SIGKILL, (tmp_path / "first.log").read_text()[-3000:]
    partial = _read(out)  # valid JSONL (each line parses, none torn)
    total = N_GOOD + 1
    assert 3 <= len(partial) < total, "killed after the run had finished: nothing was interrupted"
    assert [r["specbatch"]["line"] for r in partial] == list(range(1, len(partial) + 1))  # an ordered prefix
    prefix = out.read_bytes()

    second = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert second.returncode == 1, second.stderr[-3000:]  # one bad line: non-zero, as any run with one
    assert "1 line(s) failed" in second.stderr
    rows = _read(out)
    assert out.read_bytes().startswith(prefix)  # what was written stays as it was
    assert [r["specbatch"]["line"] for r in rows] == list(range(1, total + 1))  # every line exactly once
    assert len({r["custom_id"] for r in rows if r["custom_id"]}) == N_GOOD
    assert rows[100]["response"]["status_code"] == 400 and "malformed JSON" in rows[100]["response"]["body"]["error"]["message"]
    assert all(r["response"]["status_code"] == 200 for i, r in enumerate(rows) if i != 100)


def _parse_child(cli_pid: int, src: Path) -> int | None:
    """The pid of the CLI's parsing process once it reads ``src`` (it was handed the rest of the file)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid != cli_pid or b"worker.ingest.parse_process" not in (entry / "cmdline").read_bytes():
                continue
            if any(os.readlink(fd) == str(src) for fd in (entry / "fd").iterdir()):
                return int(entry.name)
        except (OSError, IndexError, ValueError):
            continue
    return None


def test_the_parsing_process_dies_with_a_killed_run_and_a_rerun_stores_every_line_once(redis_url, sqlite_url,
                                                                                       unique_queue, tmp_path):
    """SIGKILL to ``specbatch run`` alone (not its process group) while its child parses the
    file: the child goes too (it never holds the file or the pipe for nobody), and the rerun
    stores every line exactly once."""
    import sqlite3

    n = 80_000
    src = tmp_path / "big.jsonl"
    with open(src, "w") as fh:
        for i in range(1, n + 1):
            fh.write(json.dumps({"custom_id": f"r{i}", "messages": [{"role": "user", "content": f"say {i} " * 12}],
                                 "max_tokens": 1}) + "\n")
    assert src.stat().st_size > 8 << 20  # large enough for a parsing process (worker.ingest.stream.CHILD_MIN_BYTES)
    env = dict(os.environ, PYTHONPATH=str(ROOT), SPECBATCH_QUEUE=unique_queue)
    env.pop("DATABASE_URL", None)
    cmd = [sys.executable, "-m", "worker.api.cli", "--broker-url", redis_url, "--database-url", sqlite_url,
           "run", str(src), "--detach", "--no-local-worker", "--batch-name", "big"]
    with open(tmp_path / "first.log", "wb") as log:
        first = subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=log, stderr=log)
        try:
            child = wait_until(lambda: first.poll() is not None or _parse_child(first.pid, src), timeout=120,
                               poll=0.02, what="the parsing process to read the file")
        finally:
            first.kill()
            first.wait()
    assert child is not True and first.returncode == -signal.SIGKILL, (tmp_path / "first.log").read_text()[-3000:]
    wait_until(lambda: process_gone(child), timeout=10, what="the parsing process to die with the CLI")

    db = sqlite_url.removeprefix("sqlite:///")
    with sqlite3.connect(db) as conn:
        (partial,) = conn.execute("select count(*) from jobs").fetchone()
    assert 0 < partial < n, "killed before the first chunk or after the last: nothing was interrupted"
    second = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stderr[-3000:]
    with sqlite3.connect(db) as conn:
        got = conn.execute("select count(*), count(distinct line_no), min(line_no), max(line_no), "
                           "count(distinct custom_id), count(distinct batch_id), sum(status != 'queued') "
                           "from jobs").fetchone()
    assert got == (n, n, 1, n, n, 1, 0)
