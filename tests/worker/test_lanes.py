"""Priority lanes through the real queue: lane queues, the pacer's round-robin and caps on real
Redis and SQL, and a real worker process answering an interactive job while 2,000 bulk jobs
wait."""

from __future__ import annotations

import time

import pytest
import redis

from worker.api.client import Client
from worker.common.config import Settings
from worker.dispatch.lanes import lane_queue, lane_queues
from worker.request.priority import parse_priority
from worker.store.models import QUEUED, RUNNING, SUCCEEDED
from worker.dispatch.pacer import Pacer
from worker.run.reaper import Reaper
from worker.store.store import Store

from tests.worker.test_integration import start_worker, wait_until


def test_priorities_and_their_lanes():
    assert parse_priority("interactive") == 0 and parse_priority("BULK") == 1 and parse_priority(None) == 1
    assert parse_priority(None, default="interactive") == 0 and parse_priority("-3") == -3 and parse_priority(5) == 5
    for bad in ("urgent", True, 1.5, 10**9):
        with pytest.raises(ValueError, match="priority"):
            parse_priority(bad)
    assert lane_queues("gen.m") == ["gen.m.interactive", "gen.m"]
    assert lane_queue("gen.m", 0) == lane_queue("gen.m", -5) == "gen.m.interactive"
    assert lane_queue("gen.m", 1) == lane_queue("gen.m", 7) == "gen.m"


def _lines(tag: str, n: int) -> list[dict]:
    return [{"custom_id": f"{tag}{i}", "prompt": f"{tag} {i}", "max_tokens": 1} for i in range(n)]


def _queued_batches(r: redis.Redis, queue: str, store) -> list[str]:
    """The batch id of every message waiting in ``queue``, oldest first."""
    import json

    ids = [json.loads(raw)["headers"]["id"] for raw in reversed(r.lrange(queue, 0, -1))]
    return [store.get_job(i).batch_id for i in ids]


@pytest.fixture
def producer(db_url, redis_url, unique_queue, monkeypatch):
    monkeypatch.setenv("SPECBATCH_PACING_WINDOW", "20")
    monkeypatch.setenv("SPECBATCH_GROUP_JOBS", "1")  # a message per job: these count jobs by messages
    store = Store(db_url, auto_upgrade=True)
    client = Client(broker_url=redis_url, database_url=db_url, model="tiny", queue=unique_queue, store=store)
    yield client
    r = redis.Redis.from_url(redis_url)
    r.delete(*lane_queues(unique_queue))


def test_jobs_go_to_their_lane_and_single_jobs_default_to_interactive(producer, redis_url, unique_queue):
    r = redis.Redis.from_url(redis_url)
    job = producer.submit("now please")
    later = producer.submit("whenever", priority="bulk")
    assert producer.store.get_job(job).queue == f"{unique_queue}.interactive"
    assert producer.store.get_job(job).priority == 0 and producer.store.get_job(later).priority == 1
    assert r.llen(f"{unique_queue}.interactive") == 1 and r.llen(unique_queue) == 1
    # A batch is bulk unless its lines (vLLM's body field) or the caller say otherwise.
    sub = producer.submit_batch([{"custom_id": "a", "prompt": "x"},
                                 {"custom_id": "b", "prompt": "y", "priority": "interactive"}])
    jobs = {j.custom_id: j for j in producer.store.jobs(sub.batch_id)}
    assert (jobs["a"].queue, jobs["a"].priority) == (unique_queue, 1)
    assert (jobs["b"].queue, jobs["b"].priority) == (f"{unique_queue}.interactive", 0)
    bad = producer.submit_batch([{"custom_id": "c", "prompt": "x", "priority": "soonish"}])
    assert [b.message for b in bad.bad_lines] == ["line 1: priority: priority must be 'interactive', 'bulk' "
                                                  "or an integer, got 'soonish'"]


def test_the_pacer_publishes_a_window_round_robin_between_batches(producer, redis_url, unique_queue):
    r = redis.Redis.from_url(redis_url)
    first = producer.submit_batch(_lines("a", 100))
    assert first.published == 20 and r.llen(unique_queue) == 20  # the window, not 100 prompts
    assert producer.store.batch_counts(first.batch_id)[QUEUED] == 100
    second = producer.submit_batch(_lines("b", 100))
    assert second.published == 0  # the window is full: the second batch waits in the store
    r.delete(unique_queue)  # as if workers took the first window
    pacer = Pacer(producer.store, producer.app, lane_queues(unique_queue))
    assert pacer.tick() == 20
    order = _queued_batches(r, unique_queue, producer.store)
    assert order.count(first.batch_id) == order.count(second.batch_id) == 10  # both progress together
    # Jobs go out in line order within a batch.
    lines = [j.line_no for j in producer.store.jobs(second.batch_id) if j.published_at]
    assert sorted(lines) == list(range(1, 11))


def test_a_batch_never_has_more_than_max_in_flight_jobs_out(producer, redis_url, unique_queue):
    r = redis.Redis.from_url(redis_url)
    capped = producer.submit_batch(_lines("c", 50), max_in_flight=3)
    free = producer.submit_batch(_lines("f", 50))
    pacer = Pacer(producer.store, producer.app, lane_queues(unique_queue))
    pacer.tick()
    order = _queued_batches(r, unique_queue, producer.store)
    assert order.count(capped.batch_id) == 3 and order.count(free.batch_id) == 17  # its share went to the other
    # Two of the capped batch's jobs start running: only one more may be published.
    r.delete(unique_queue)
    running = [j.id for j in producer.store.jobs(capped.batch_id) if j.published_at][:2]
    for job_id in running:
        assert producer.store.claim(job_id, worker="w", device="cpu", lease_s=60, max_attempts=3).ok
    pacer.tick()
    assert _queued_batches(r, unique_queue, producer.store).count(capped.batch_id) == 0  # 3 still out (queued)
    queued_ids = [j.id for j in producer.store.jobs(capped.batch_id, statuses=(QUEUED,)) if j.published_at]
    producer.store.finish(running[0], 1, {"status": SUCCEEDED, "finished_at": time.time()})
    assert producer.store.batch_counts(capped.batch_id)[RUNNING] == 1 and len(queued_ids) == 1
    r.delete(unique_queue)
    pacer.tick()
    assert _queued_batches(r, unique_queue, producer.store).count(capped.batch_id) == 1


def test_unpublished_jobs_are_not_orphans_and_lost_published_ones_are(producer, redis_url, unique_queue):
    r = redis.Redis.from_url(redis_url)
    sub = producer.submit_batch(_lines("o", 30))
    r.delete(unique_queue)  # Redis lost the 20 published messages
    reaper = Reaper(producer.store, producer.app, lane_queues(unique_queue), worker="t", lease_s=60,
                    max_attempts=3, grace_s=0.0, interval=0.05)
    reaper.sweep()  # first scan: missing once
    time.sleep(0.1)
    assert reaper.sweep()["orphans"] == 20  # the 10 never published are the pacer's, not orphans
    assert sum(1 for j in producer.store.jobs(sub.batch_id) if j.published_at is None) == 10


def test_an_interactive_job_behind_2000_bulk_jobs_starts_within_one_engine_step(
        sqlite_url, redis_url, unique_queue, tiny_model_dir, tmp_path, monkeypatch):
    tiny_model = tiny_model_dir
    monkeypatch.setenv("SPECBATCH_PACING_WINDOW", "2000")  # every bulk message queued in Redis ahead
    client = Client(broker_url=redis_url, database_url=sqlite_url, model=tiny_model, queue=unique_queue)
    settings = Settings(broker_url=redis_url, database_url=sqlite_url, model=tiny_model, device="cpu",
                        queue=unique_queue)
    bulk = client.submit_batch([{"custom_id": f"b{i}", "prompt": f"bulk line {i} " * 4, "max_tokens": 24,
                                 "ignore_eos": True} for i in range(2000)])
    assert bulk.published == 2000
    worker = start_worker(client, settings, tmp_path, seqs=4, concurrency=8)
    try:
        wait_until(lambda: client.store.batch_counts(bulk.batch_id)[SUCCEEDED] >= 8, timeout=180)
        # Bulk jobs running (claimed by a task thread), sampled while the worker is full: for 2 s,
        # and on for up to 8 s more until a sample shows it full (a loaded CI machine can leave
        # a short window with the worker between jobs), so both bounds below mean something.
        held = []
        deadline = time.monotonic() + 10
        while len(held) < 40 or (max(held) < 5 and time.monotonic() < deadline):
            held.append(client.store.batch_counts(bulk.batch_id)[RUNNING])
            time.sleep(0.05)
        urgent = client.submit("an interactive question", params={"max_tokens": 4})
        assert client.wait(urgent, timeout=120) == SUCCEEDED
        job = client.store.get_job(urgent)
        counts = client.store.batch_counts(bulk.batch_id)
        assert job.num_waiting_steps == 0, "it waited inside the engine"
        assert job.queue == f"{unique_queue}.interactive"
        assert counts[QUEUED] >= 1500, f"it waited for the bulk run: {counts}"
        # Task threads = 2 x 4, one kept for the interactive lane; bulk messages carry 10 of these
        # 24-token jobs each, and a worker holds at most 4 x max-num-seqs = 16 such jobs at once.
        assert 5 <= max(held) <= 16, held
    finally:
        client.cancel(bulk.batch_id)
        worker.stop(timeout=20)
        redis.Redis.from_url(redis_url).delete(*lane_queues(unique_queue))


def test_a_lines_user_is_stored_and_returned(producer):
    from worker.request.formats import output_line

    sub = producer.submit_batch([
        {"custom_id": "u", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": [{"role": "user", "content": "hi"}], "user": "user-1234"}},
        {"custom_id": "bad", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": [{"role": "user", "content": "hi"}], "user": 42}},
    ])
    (job,) = producer.store.jobs(sub.batch_id, statuses=(QUEUED,))
    assert job.user == "user-1234" and output_line(job)["specbatch"]["user"] == "user-1234"
    assert [b.message for b in sub.bad_lines] == ["line 2: user: must be a string of 1 to 255 characters"]
    single = producer.submit("hello", user="svc-7")
    assert producer.store.get_job(single).user == "svc-7"
