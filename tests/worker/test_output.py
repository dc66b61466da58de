"""The run's output file (``worker.ingest.output``) on real SQLite/PostgreSQL: an ordered prefix of the
batch, appended as results arrive, resumed from its last line, a torn last line cut off."""

from __future__ import annotations

import json

from worker.store.models import QUEUED, SUCCEEDED
from worker.ingest.output import OutputFile
from worker.store.store import Store

from tests.helpers.batches import ingest_lines, job_ids


def _batch(store: Store, n: int, name: str = "b") -> tuple[str, list[str]]:
    """``n`` prompts and a malformed last line."""
    lines = [{"custom_id": f"c{i}", "prompt": f"p{i}"} for i in range(1, n + 1)] + ["{malformed"]
    batch_id = ingest_lines(store, lines, name=name).batch_id
    return batch_id, job_ids(store, batch_id)


def _finish(store: Store, job_id: str) -> None:
    attempt = store.claim(job_id, worker="w", device="cpu", lease_s=60, max_attempts=3).attempt
    store.finish(job_id, attempt, {"status": SUCCEEDED, "output_text": f"out {job_id}", "finished_at": 1.0})


def _read(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_results_are_appended_in_input_order_as_soon_as_the_lines_before_them_have_one(db_url, tmp_path):
    store = Store(db_url, auto_upgrade=True)
    batch_id, ids = _batch(store, 6)
    out = tmp_path / "out.jsonl"
    writer = OutputFile(out, store, batch_id)
    for i in (1, 2, 4):  # line 3 is still queued: 4 waits behind it
        _finish(store, ids[i])
    assert writer.pump() == 0 and out.read_text() == ""
    _finish(store, ids[0])
    assert writer.pump() == 3
    assert [r["specbatch"]["line"] for r in _read(out)] == [1, 2, 3]
    for i in (3, 5):
        _finish(store, ids[i])
    assert writer.pump() == 4  # lines 4-6 and the bad line 7 (final since the batch was written)
    rows = _read(out)
    assert [r["specbatch"]["job_id"] for r in rows] == ids
    assert rows[-1]["response"]["status_code"] == 400 and writer.lines == 7
    assert writer.pump() == 0


def test_a_rerun_goes_on_after_the_last_line_and_cuts_a_torn_one(db_url, tmp_path):
    store = Store(db_url, auto_upgrade=True)
    batch_id, ids = _batch(store, 5)
    out = tmp_path / "out.jsonl"
    for i in (0, 1):
        _finish(store, ids[i])
    OutputFile(out, store, batch_id).pump()
    with open(out, "a") as fh:
        fh.write('{"id": "batch_req_torn", "custom')  # a power cut in the middle of a line
    for i in (2, 3, 4):
        _finish(store, ids[i])
    writer = OutputFile(out, store, batch_id)
    assert writer.lines == 2
    writer.pump()
    rows = _read(out)  # valid JSONL: the torn line is gone
    assert [r["specbatch"]["job_id"] for r in rows] == ids and writer.lines == 6


def test_a_file_of_another_batch_or_fresh_is_written_anew(db_url, tmp_path):
    store = Store(db_url, auto_upgrade=True)
    other, other_ids = _batch(store, 2, name="other")
    batch_id, ids = _batch(store, 2)
    out = tmp_path / "out.jsonl"
    for job_id in other_ids[:2] + ids[:2]:
        _finish(store, job_id)
    OutputFile(out, store, other).pump()
    writer = OutputFile(out, store, batch_id)
    writer.pump()
    assert [r["specbatch"]["job_id"] for r in _read(out)] == ids
    again = OutputFile(out, store, batch_id, fresh=True)
    assert again.lines == 0 and out.read_text() == ""
    assert again.pump() == 3


def test_export_pages_through_a_batch_in_input_order(db_url):
    store = Store(db_url, auto_upgrade=True)
    batch_id, ids = _batch(store, 9)
    for job_id in ids[:9:2]:
        _finish(store, job_id)
    got = [j.id for j in store.iter_jobs(batch_id, page=2)]
    assert got == ids
    done = [j.id for j in store.iter_jobs(batch_id, statuses=[SUCCEEDED], page=2)]
    assert done == ids[:9:2]
    assert [j.id for j in store.iter_jobs(batch_id, statuses=[QUEUED], page=3)] == ids[1:9:2]
