"""Monitoring from the store: ``specbatch report`` (one self-contained HTML page, opened in headless
Chromium) and ``specbatch status`` (rich, on stdout), checked against the store's own figures.

The browser test reads a real ``specbatch run`` on the tiny model (speculation on, two invalid
lines), so the plots show real timings; the rest write batches through the streaming ingest and
run their jobs with the store's own writes (``claim``, ``finish``) on SQLite and PostgreSQL.
"""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
from click.testing import CliRunner
from rich.console import Console

from worker.api.cli import cli
from worker.store.models import FAILED, SUCCEEDED
from worker.api.report import render_html, write_report
from worker.api.status_view import render, take_snapshot
from worker.store.rows import INVALID_INPUT
from worker.store.store import Store
from worker.api.summary import percentile

from tests.helpers.batches import ingest_lines

ROOT = Path(__file__).resolve().parents[2]
HOSTILE_ID = '<img src=x onerror="alert(1)">&amp;'  # a custom_id is user input: shown, never run


def chat(cid: str, content: str, **body) -> str:
    return json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
                       "body": {"messages": [{"role": "user", "content": content}], **body}})


@pytest.fixture(scope="module")
def ran(tmp_path_factory, tiny_model_dir, module_redis_url):
    """A real ``specbatch run``: 10 chat lines through a local worker with n-gram speculation,
    one malformed line and one invalid one (its custom_id is HTML). Returns (database URL, batch id)."""
    tmp = tmp_path_factory.mktemp("run")
    lines = [chat(f"ok-{i}", "abcabcabc " * (1 + i % 3), max_tokens=8 + 6 * i, temperature=0, ignore_eos=True)
             for i in range(10)]
    lines += ["{not json", chat(HOSTILE_ID, "x", max_tokens=0)]
    src = tmp / "in.jsonl"
    src.write_text("\n".join(lines) + "\n")
    db = f"sqlite:///{tmp / 'sb.db'}"
    env = dict(os.environ, PYTHONPATH=str(ROOT), SPECBATCH_QUEUE=f"gen.report-{uuid.uuid4().hex[:8]}",
               SPECBATCH_WORKER_LOG=str(tmp / "worker.log"))
    env.pop("DATABASE_URL", None)
    res = subprocess.run([sys.executable, "-m", "worker.api.cli", "--broker-url", module_redis_url, "--database-url", db,
                          "run", str(src), "-o", str(tmp / "out.jsonl"), "--model", tiny_model_dir,
                          "--max-num-seqs", "4", "--speculative", "ngram:4"],
                         env=env, cwd=tmp, capture_output=True, text=True, timeout=240)
    assert res.returncode == 1, res.stderr[-3000:]  # the two bad lines have no result
    store = Store(db)
    (batch,) = store.batches()
    return db, batch.id


def test_report_in_browser(ran, browser, tmp_path):
    from tests.browser import artifacts_dir, console_errors

    db, batch_id = ran
    out = tmp_path / "report.html"
    res = CliRunner().invoke(cli, ["--database-url", db, "report", batch_id, "-o", str(out)])
    assert res.exit_code == 0, res.output
    page = out.read_text()
    assert "http://" not in page and "https://" not in page and "<script" not in page  # self-contained

    store = Store(db)
    jobs = store.jobs(batch_id)
    ok = [j for j in jobs if j.status == SUCCEEDED]
    failed = [j for j in jobs if j.status == FAILED]
    assert len(ok) == 10 and len(failed) == 2 and all(j.error_type == INVALID_INPUT for j in failed)

    browser.get(out.as_uri())
    images = browser.execute_script(
        "return Array.from(document.images).map(i => [i.id, i.complete, i.naturalWidth, i.src.slice(0, 22)])")
    assert [i[0] for i in images] == ["plot-ttft", "plot-tpot", "plot-queue-wait", "plot-throughput",
                                      "plot-batch-size", "plot-acceptance"], images  # the hostile id made none
    for plot, complete, width, src in images:
        assert complete and width > 0 and src == "data:image/png;base64,", (plot, complete, width, src)
    assert console_errors(browser) == []

    def value(cell_id: str) -> str:
        return browser.find_element("id", cell_id).get_attribute("data-value")

    assert int(value("summary-jobs")) == len(jobs)
    assert int(value("summary-succeeded")) == len(ok)
    assert int(value("summary-failed")) == len(failed)
    assert int(value("summary-output-tokens")) == sum(j.num_output_tokens for j in ok) > 0
    assert float(value("summary-ttft-p50")) == pytest.approx(percentile([j.ttft_s for j in ok], 50), rel=1e-9)
    assert float(value("summary-tpot-p99")) == pytest.approx(percentile([j.tpot_s for j in ok], 99), rel=1e-9)
    drafts = sum(j.num_draft_tokens for j in ok)
    assert drafts > 0
    assert float(value("summary-acceptance")) == pytest.approx(sum(j.num_accepted_tokens for j in ok) / drafts)

    slowest = max(ok, key=lambda j: j.finished_at - j.started_at)
    first = browser.find_element("css selector", "#slowest tr.job")
    assert first.find_element("css selector", ".custom-id").text == slowest.custom_id
    assert first.find_element("css selector", ".id").text == slowest.id
    latency = float(first.find_element("css selector", ".latency").get_attribute("data-value"))
    assert latency == pytest.approx(slowest.finished_at - slowest.started_at, rel=1e-9)

    rows = browser.find_elements("css selector", "#failed tr.job")
    shown = {r.get_attribute("data-job-id"): (r.find_element("css selector", ".custom-id").text,
                                              r.find_element("css selector", ".error").text) for r in rows}
    assert shown == {j.id: (j.custom_id or "", j.error) for j in failed}
    assert HOSTILE_ID in {cid for cid, _ in shown.values()}  # shown as text
    cause = browser.find_element("css selector", "#causes .cause").text
    assert cause == INVALID_INPUT and browser.find_element("css selector", "#causes .count").text == "2"

    height = browser.execute_script("return document.documentElement.scrollHeight")
    browser.set_window_size(1400, min(height + 400, 10000))  # the whole page (the window has chrome too)
    browser.save_screenshot(str(artifacts_dir() / "report.png"))


def test_status_once_on_a_real_run(ran):
    db, batch_id = ran
    res = CliRunner().invoke(cli, ["--database-url", db, "status", batch_id, "--once"])
    assert res.exit_code == 0, res.output
    out = res.stdout
    assert batch_id in out and "12/12 (100 %)" in out
    assert "succeeded 10  failed 2  cancelled 0  running 0  queued 0" in out
    assert "failures       invalid_input 2" in out
    assert "jobs/s" in out and "output tok/s  (whole run)" in out and "ETA            done" in out
    job = Store(db).jobs(batch_id)[0]
    one = CliRunner().invoke(cli, ["--database-url", db, "status", job.id])
    assert one.exit_code == 0 and json.loads(one.stdout)["custom_id"] == job.custom_id  # JSON alone on stdout
    overview = CliRunner().invoke(cli, ["--database-url", db, "status", "--once"])
    assert overview.exit_code == 0 and batch_id in overview.stdout and "invalid_input 2" in overview.stdout
    assert "local-" in overview.stdout and " cpu " in overview.stdout and "stopped" in overview.stdout


# ---- batches written through the store ---------------------------------------------------------
def cell(page: str, key: str) -> str:
    """The ``data-value`` of summary cell ``key`` in a report page."""
    (value,) = re.findall(rf'<td [^>]*data-value="([^"]*)" id="summary-{key}"', page)
    return value


def make_batch(store: Store, *, n_ok: int, n_invalid: int = 0, name: str | None = None,
               custom_id=lambda i: f"c{i}") -> tuple[str, list[str]]:
    """``n_ok`` prompts, then ``n_invalid`` lines naming a model whose name must be escaped in HTML;
    returns the batch and its good jobs' ids in line order."""
    lines = [{"custom_id": custom_id(i), "prompt": f"p{i}"} for i in range(n_ok)]
    lines += [{"custom_id": f"bad{i}", "prompt": "p", "model": "<json> & more"} for i in range(n_invalid)]
    result = ingest_lines(store, lines, name=name or uuid.uuid4().hex, input_file="in.jsonl")
    return result.batch_id, [j.id for j in store.jobs(result.batch_id) if j.error_type != INVALID_INPUT]


def run_job(store: Store, job_id: str, *, worker: str = "w1@host", device: str = "cpu", tokens: int = 10,
            seconds: float = 1.0, end: float | None = None, status: str = SUCCEEDED, error_type: str | None = None,
            **extra) -> None:
    """Claim and finish a job as a worker would, with timings ending at ``end``."""
    attempt = store.claim(job_id, worker=worker, device=device, lease_s=60, max_attempts=3).attempt
    assert attempt is not None
    end = time.time() if end is None else end
    start = end - seconds
    values = dict(status=status, started_at=start, first_scheduled_at=start + 0.01, first_token_at=start + 0.1,
                  finished_at=end, ttft_s=0.1, tpot_s=(seconds - 0.1) / max(tokens - 1, 1), queue_wait_s=0.5,
                  num_output_tokens=tokens, num_prompt_tokens=5, max_batch_size=2, **extra)
    if status == FAILED:
        values.update(error=f"boom {job_id[:4]}", error_type=error_type or "generation_error")
    assert store.finish(job_id, attempt, values)


def test_monitoring_queries(db_url):
    store = Store(db_url, auto_upgrade=True)
    batch_id, ids = make_batch(store, n_ok=6, n_invalid=2)
    now = time.time()
    run_job(store, ids[0], tokens=10, seconds=1.0, end=now - 300)  # long ago: outside a 60 s window
    run_job(store, ids[1], tokens=20, seconds=3.0, end=now - 5)
    run_job(store, ids[2], tokens=30, seconds=2.0, end=now - 1, num_draft_tokens=8, num_accepted_tokens=6)
    run_job(store, ids[3], tokens=4, seconds=0.5, end=now - 2, status=FAILED, error_type="aborted")
    store.claim(ids[4], worker="w2@host", device="cuda:1", lease_s=60, max_attempts=3)  # running; ids[5] queued

    assert store.counts_by_batch([batch_id])[batch_id] == {"queued": 1, "running": 1, "succeeded": 3, "failed": 3,
                                                           "cancelled": 0}
    assert store.failures_by_cause([batch_id]) == {batch_id: {INVALID_INPUT: 2, "aborted": 1}}
    stats = store.finished_stats([batch_id], since=now - 60)[batch_id]
    assert stats["jobs"] == 4 and stats["output_tokens"] == 64  # invalid lines never ran
    assert stats["recent_jobs"] == 3 and stats["recent_output_tokens"] == 54
    assert stats["first_started"] == pytest.approx(now - 301) and stats["last_finished"] == pytest.approx(now - 1)
    slow = store.slowest_jobs(batch_id, limit=2)
    assert [r["id"] for r in slow] == [ids[1], ids[2]] and slow[0]["latency_s"] == pytest.approx(3.0)
    failed = store.failed_jobs(batch_id)
    assert [r["error_type"] for r in failed] == ["aborted", INVALID_INPUT, INVALID_INPUT]
    cols = [row for chunk in store.iter_job_columns(batch_id, ("status", "num_output_tokens"), chunk=3)
            for row in chunk]
    assert sorted(cols, key=str) == sorted([(SUCCEEDED, 10), (SUCCEEDED, 20), (SUCCEEDED, 30), (FAILED, 4),
                                            ("running", None), ("queued", None), (FAILED, None), (FAILED, None)],
                                           key=str)

    (view,) = take_snapshot(store, store.get_batch(batch_id), window_s=60).batches
    assert view.left == 2 and view.jobs_per_s == pytest.approx(3 / 60, rel=1e-3)
    assert view.tokens_per_s == pytest.approx(54 / 60, rel=1e-3) and view.eta_s == pytest.approx(40, rel=1e-3)
    assert view.ttft_p50 == pytest.approx(0.1)

    page = render_html(store, store.get_batch(batch_id))  # PostgreSQL and SQLite alike
    assert cell(page, "succeeded") == "3" and cell(page, "output-tokens") == "60"
    assert "&lt;json&gt; &amp; more" in page and "<json>" not in page
    assert "2 job(s) still queued or running" in page


def test_status_once_shows_workers_eta_and_failures(sqlite_url):
    store = Store(sqlite_url)
    batch_id, ids = make_batch(store, n_ok=8, n_invalid=1, name="a name that is rather long " * 4)
    store.worker_starting("gpu-node-with-a-long-name-0123456789@host", device="cuda:3", queue="gen.m", model="m")
    store.worker_state("gpu-node-with-a-long-name-0123456789@host", "ready")
    now = time.time()
    for k, job in enumerate(ids[:4]):
        run_job(store, job, worker="gpu-node-with-a-long-name-0123456789@host", device="cuda:3", end=now - 10 + k,
                status=FAILED if k == 3 else SUCCEEDED, error_type="generation_error")
    for job in ids[4:6]:
        store.claim(job, worker="gpu-node-with-a-long-name-0123456789@host", device="cuda:3", lease_s=60,
                    max_attempts=3)
    res = CliRunner().invoke(cli, ["--database-url", sqlite_url, "status", "--once"])
    assert res.exit_code == 0, res.output
    out = res.stdout  # stdout, not stderr
    assert batch_id in out and "5/9 (56 %)" in out and "failed 2" in out
    assert "generation_error 1, invalid_input 1" in out and "ETA 0:11" in out  # 4 left at 4 jobs in 11 s
    lines = out.splitlines()
    at = next(i for i, l in enumerate(lines) if "gpu-node-with-a-long-name-0123456789@host" in l)
    assert lines[at].split()[1:] == ["ready"]  # the name, then the state
    assert lines[at + 1].split()[:3] == ["cuda:3", "running", "2"] and "queue gen.m" in lines[at + 1]

    res = CliRunner().invoke(cli, ["--database-url", sqlite_url, "status", batch_id, "--once"])
    assert res.exit_code == 0, res.output
    assert "failures       generation_error 1, invalid_input 1" in res.stdout
    assert "throughput     0.36 jobs/s  3.6 output tok/s  (last 0:11)" in res.stdout
    assert "ETA            0:11" in res.stdout

    narrow = Console(file=io.StringIO(), width=80)  # a narrow terminal: the ids stay whole
    for detail in (False, True):
        narrow.print(render(take_snapshot(store, store.get_batch(batch_id) if detail else None), detail))
    text = narrow.file.getvalue()
    assert text.count(batch_id) == 2 and text.count("gpu-node-with-a-long-name-0123456789@host") == 2
    assert max(len(l) for l in text.splitlines()) <= 80


def test_status_watch_ends_with_the_batch(sqlite_url):
    store = Store(sqlite_url)
    batch_id, ids = make_batch(store, n_ok=2)
    run_job(store, ids[0])
    attempt = store.claim(ids[1], worker="w", device="cpu", lease_s=60, max_attempts=3).attempt
    finisher = threading.Timer(0.6, lambda: store.finish(ids[1], attempt, {"status": SUCCEEDED,
                                                                            "finished_at": time.time()}))
    finisher.start()
    started = time.monotonic()
    res = CliRunner().invoke(cli, ["--database-url", sqlite_url, "status", batch_id, "--watch", "--interval", "0.2"])
    finisher.join()
    assert res.exit_code == 0, res.output
    assert time.monotonic() - started < 10 and "2/2 (100 %)" in res.stdout and "ETA            done" in res.stdout


def test_report_of_an_empty_batch(sqlite_url, tmp_path):
    store = Store(sqlite_url)
    batch_id, _ = make_batch(store, n_ok=0)
    page = write_report(store, store.get_batch(batch_id), tmp_path / "r.html").read_text()
    assert cell(page, "jobs") == "0" and cell(page, "ttft-p50") == ""
    assert "<img" not in page and 'id="slowest-none"' in page and 'id="failed-none"' in page


def test_report_of_a_failed_only_batch(sqlite_url):
    store = Store(sqlite_url)
    batch_id, ids = make_batch(store, n_ok=2, n_invalid=3, custom_id=lambda i: f"<b>{i}</b>")
    for job in ids:
        run_job(store, job, status=FAILED, tokens=0, seconds=0.2)
    page = render_html(store, store.get_batch(batch_id))
    assert cell(page, "failed") == "5" and cell(page, "output-tokens") == "0"
    assert page.count('<tr class="job"') == 5 and "&lt;b&gt;0&lt;/b&gt;" in page and "<b>0</b>" not in page
    assert 'id="plot-ttft-none"' in page and 'id="plot-acceptance-none"' in page
    assert 'id="plot-batch-size"' in page  # the failed attempts still ran on a worker
