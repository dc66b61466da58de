"""A real worker process (CPU, tiny model) on the real Redis, against SQLite and PostgreSQL:
jobs submitted while it runs are merged into its running batch, every job ends with one
result and complete, ordered timings, and a duplicated message never yields a second result."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from worker.common.config import Settings
from worker.run.local import LocalWorker
from worker.store.models import SUCCEEDED

pytestmark = pytest.mark.integration

N_JOBS = 200


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from tests.helpers.tiny_models import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("tiny") / "model"))


def start_worker(client, settings, tmp_path, seqs=32, concurrency=None) -> LocalWorker:
    worker = LocalWorker(settings, concurrency=concurrency or seqs, max_num_seqs=seqs, loglevel="info",
                         log_path=str(tmp_path / "worker.log"))
    deadline = time.monotonic() + 120
    try:
        while not client.workers_consuming(settings.queue_name, timeout=0.5):
            assert worker.alive, (tmp_path / "worker.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "worker did not come up"
            time.sleep(0.3)
    except BaseException:
        worker.stop(timeout=5)
        raise
    return worker


def wait_until(predicate, timeout=120.0, poll=0.05):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(poll)


def test_worker_merges_jobs_submitted_while_running(db_url, redis_url, unique_queue, tiny_model, tmp_path):
    from worker.api.client import Client

    from worker.store.store import Store

    store = Store(db_url, auto_upgrade=True)  # PostgreSQL is migrated explicitly, as in a deploy step
    client = Client(broker_url=redis_url, database_url=db_url, model=tiny_model, queue=unique_queue, store=store)
    settings = Settings(broker_url=redis_url, database_url=db_url, model=tiny_model, device="cpu", queue=unique_queue)
    worker = start_worker(client, settings, tmp_path)
    try:
        # The worker process drives its engine in a child process: torch is loaded there only
        # (loading it in the worker too cost every start ~7 s of CPU).
        assert "libtorch" not in Path(f"/proc/{worker.proc.pid}/maps").read_text()
        # Wave 1: long jobs. Later waves arrive while wave 1 is generating.
        long = {"max_tokens": 96, "ignore_eos": True, "temperature": 0}
        short = {"max_tokens": 12, "ignore_eos": True, "temperature": 0.8, "seed": 1}
        rows = [{"custom_id": f"w1-{i}", "prompt": f"long job {i}", **long} for i in range(8)]
        first = client.submit_batch(rows, name=f"live-{unique_queue}")
        batch_id = first.batch_id
        wait_until(lambda: client.store.batch_counts(batch_id)["running"] >= 1)
        rest = [{"custom_id": f"w{2 + i // 64}-{i}", "messages": [{"role": "user", "content": f"q{i}"}], **short}
                for i in range(N_JOBS - 8)]
        for start in range(0, len(rest), 64):  # three more waves, each while earlier ones run
            client.submit_batch(rows + rest[: start + 64], name=f"live-{unique_queue}")
            time.sleep(0.2)
        counts = client.wait(batch_id, timeout=180)
        assert counts["succeeded"] == N_JOBS, counts

        jobs = client.store.jobs(batch_id)
        assert len(jobs) == N_JOBS and all(j.status == SUCCEEDED for j in jobs)
        for j in jobs:
            assert j.attempts == 1 and j.worker and j.device == "cpu"
            assert None not in (j.enqueued_at, j.started_at, j.first_scheduled_at, j.first_token_at, j.finished_at)
            assert j.enqueued_at <= j.started_at <= j.first_scheduled_at <= j.first_token_at <= j.finished_at
            assert j.queue_wait_s is not None and j.ttft_s is not None and j.tokens_per_s is not None
            assert j.num_output_tokens == (96 if j.custom_id.startswith("w1-") else 12)
            assert len(j.output_token_ids) == j.num_output_tokens

        # Merged into a running batch: a job that started after a long job had already produced
        # its first token still shared engine steps with it (overlapping running intervals) ...
        longs = [j for j in jobs if j.custom_id.startswith("w1-")]
        late = [j for j in jobs if not j.custom_id.startswith("w1-")
                and any(l.first_token_at < j.started_at and j.first_token_at < l.finished_at for l in longs)]
        assert late, "no job joined a batch that was already generating"
        # ... and the engine saw it in a batch of more than one sequence.
        assert max(j.max_batch_size for j in late) > 1

        # Redelivery: publish the same messages again. Nothing runs twice, nothing changes.
        before = {j.id: (j.output_text, j.finished_at, j.attempts) for j in jobs}
        dup = [dict(id=j.id, model=j.model, endpoint=j.endpoint, prompt=j.prompt, prompt_token_ids_in=None,
                    messages=j.messages, params=j.params, batch_id=j.batch_id, custom_id=j.custom_id,
                    line_no=j.line_no) for j in jobs[:20]]
        client.publish(dup)
        marker = client.submit(prompt="after the duplicates", params={"max_tokens": 2}, model=tiny_model)
        assert client.wait(marker, timeout=60) == SUCCEEDED
        time.sleep(0.5)
        after = {j.id: (j.output_text, j.finished_at, j.attempts) for j in client.store.jobs(batch_id)}
        assert after == before
        # The worker process tokenized those prompts for its engine (its tokenizer loads beside
        # the first message of several jobs, without torch): still no torch in it.
        assert "tokenizers" in Path(f"/proc/{worker.proc.pid}/maps").read_text()
        assert "libtorch" not in Path(f"/proc/{worker.proc.pid}/maps").read_text()
    finally:
        worker.stop()
    log = (tmp_path / "worker.log").read_text()
    assert len(re.findall(r"job \w+ skipped: already succeeded", log)) >= 20


def test_duplicate_messages_in_flight_yield_one_result(sqlite_url, redis_url, unique_queue, tiny_model, tmp_path):
    """The same message twice *before* the job ran: one copy generates, the other skips."""
    from worker.api.client import Client

    client = Client(broker_url=redis_url, database_url=sqlite_url, model=tiny_model, queue=unique_queue)
    settings = Settings(broker_url=redis_url, database_url=sqlite_url, model=tiny_model, device="cpu",
                        queue=unique_queue)
    sub = client.submit_batch([{"custom_id": f"d{i}", "prompt": f"dup {i}", "max_tokens": 48, "ignore_eos": True}
                               for i in range(10)], name="dups")
    client.publish(client.store.message_rows([j.id for j in client.store.jobs(sub.batch_id)]))  # now twice in the queue
    worker = start_worker(client, settings, tmp_path, seqs=8)
    try:
        counts = client.wait(sub.batch_id, timeout=120)
        assert counts["succeeded"] == 10
        # The second copies are consumed and each skips its job (it already succeeded).
        wait_until(lambda: len(re.findall(r"job \w+ skipped: ", (tmp_path / "worker.log").read_text())) >= 10,
                   timeout=30)
        jobs = client.store.jobs(sub.batch_id)
        assert all(j.attempts == 1 for j in jobs)
        lines = list(client.iter_results(sub.batch_id, timeout=5))
        assert sorted(l["custom_id"] for l in lines) == sorted(f"d{i}" for i in range(10))
        assert client.results(sub.batch_id) == [l for l in sorted(lines, key=lambda l: l["specbatch"]["line"])]

        # Cooperative cancel of a running job: DB status, then the engine aborts it.
        long_id = client.submit(prompt="cancel me", params={"max_tokens": 2000, "ignore_eos": True},
                                model=tiny_model)
        wait_until(lambda: client.store.get_job(long_id).status == "running", timeout=30)
        t0 = time.monotonic()
        assert client.cancel(long_id) == [long_id]
        wait_until(lambda: f"[{long_id}] succeeded in" in (tmp_path / "worker.log").read_text(), timeout=20)
        assert time.monotonic() - t0 < 5.0  # aborted, not run to 2000 tokens
        job = client.store.get_job(long_id)
        assert job.status == "cancelled" and job.output_text is None
    finally:
        worker.stop()
    log = (tmp_path / "worker.log").read_text()
    assert len(re.findall(r"job \w+ skipped: ", log)) == 10, log[-2000:]
