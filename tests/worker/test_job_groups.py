"""Short jobs travel several to a message: the grouping rule, the messages a batch becomes in
the real Redis (and that the orphan sweep still sees every job in them), and a real worker
running a group whose entries go wrong in every way a message can, each failing alone."""

from __future__ import annotations

import base64
import json

import pytest

from worker.common.config import settings
from worker.dispatch.publish import GROUP_HEADER, generation_budget, job_groups, queued_job_ids


def _row(i: int, max_tokens: int | None, queue: str = "q", n: int | None = None) -> dict:
    params = {} if max_tokens is None else {"max_tokens": max_tokens}
    if n is not None:
        params["n"] = n
    return {"id": f"job{i}", "queue": queue, "params": params}


def test_groups_hold_a_fixed_amount_of_work_in_order():
    queue_of = lambda row: row["queue"]  # noqa: E731
    one_token = [_row(i, 1) for i in range(70)]
    groups = job_groups(one_token, queue_of, max_jobs=32, max_tokens=256)
    assert [len(g) for g in groups] == [32, 32, 6]
    assert [r["id"] for g in groups for r in g] == [r["id"] for r in one_token]  # order kept

    assert [len(g) for g in job_groups([_row(i, 100) for i in range(5)], queue_of,
                                       max_jobs=32, max_tokens=256)] == [2, 2, 1]
    # Over the budget (the default max_tokens is 1024): alone, whatever the neighbours.
    mixed = [_row(0, 1), _row(1, None), _row(2, 1), _row(3, 1), _row(4, 300)]
    assert [[r["id"] for r in g] for g in job_groups(mixed, queue_of, max_jobs=32, max_tokens=256)] == [
        ["job0"], ["job1"], ["job2", "job3"], ["job4"]]
    # n samples count n times; a queue boundary ends a group.
    assert generation_budget(_row(0, 10, n=4)) == 40
    split = [_row(0, 1, "a"), _row(1, 1, "a"), _row(2, 1, "b"), _row(3, 1, "a")]
    assert [[r["id"] for r in g] for g in job_groups(split, queue_of, max_jobs=32, max_tokens=256)] == [
        ["job0", "job1"], ["job2"], ["job3"]]
    # Hostile params never break the grouping: counted as the default.
    assert generation_budget({"params": {"max_tokens": "many", "n": -3}}) == 1024
    assert generation_budget({"params": None}) == 1024


def test_a_batch_of_short_jobs_becomes_few_messages_and_the_sweep_sees_every_job(sqlite_url, redis_url,
                                                                                 unique_queue):
    import redis

    from worker.api.client import Client

    client = Client(broker_url=redis_url, database_url=sqlite_url, model="tiny", queue=unique_queue)
    short = [{"custom_id": f"s{i}", "prompt": f"short {i}", "max_tokens": 1} for i in range(100)]
    long = [{"custom_id": f"l{i}", "prompt": f"long {i}", "max_tokens": 500} for i in range(3)]
    sub = client.submit_batch(short + long, name=f"groups-{unique_queue}")
    ids = {j.id for j in client.store.jobs(sub.batch_id)}
    r = redis.Redis.from_url(redis_url)
    try:
        raw = r.lrange(unique_queue, 0, -1)
        messages = [json.loads(m) for m in raw]
        tasks = sorted(m["headers"]["task"] for m in messages)
        # 100 one-token jobs: group messages of K (64 by default) and the rest; the long ones alone.
        k = settings().group_jobs
        sizes = [k] * (100 // k) + ([100 % k] if 100 % k else [])
        assert tasks == ["specbatch.generate"] * 3 + ["specbatch.generate_group"] * len(sizes), tasks
        groups = [m["headers"][GROUP_HEADER] for m in messages if m["headers"]["task"] == "specbatch.generate_group"]
        assert sorted(len(g) for g in groups) == sorted(sizes)
        assert queued_job_ids(r, unique_queue) == ids  # the orphan sweep finds every job in them
        # A message carries its job ids and nothing else of them: the store holds the requests.
        bodies = {m["headers"]["id"]: json.loads(base64.b64decode(m["body"])) for m in messages}
        for m in messages:
            named = m["headers"].get(GROUP_HEADER) or m["headers"]["id"]
            assert bodies[m["headers"]["id"]] == [[named], {}, bodies[m["headers"]["id"]][2]]
        group = next(m for m in messages if m["headers"]["task"] == "specbatch.generate_group")
        # Flower shows every job of a group by its custom_id, line, batch and id.
        shown = group["headers"]["argsrepr"]
        assert shown.startswith(f"{len(group['headers'][GROUP_HEADER])} jobs: custom_id=")
        assert all(f"job={job_id!r}" in shown for job_id in group["headers"][GROUP_HEADER])
    finally:
        r.delete(unique_queue)


def test_the_pacing_window_counts_messages_and_asks_a_batch_for_as_many_jobs_as_they_carry(
        sqlite_url, redis_url, unique_queue, monkeypatch):
    import redis

    from worker.api.client import Client
    from worker.dispatch.lanes import lane_queues
    from worker.dispatch.pacer import Pacer

    monkeypatch.setenv("SPECBATCH_PACING_WINDOW", "4")
    client = Client(broker_url=redis_url, database_url=sqlite_url, model="tiny", queue=unique_queue)
    r = redis.Redis.from_url(redis_url)
    try:
        k = settings().group_jobs  # jobs a message carries (64 by default)
        rows = [{"custom_id": f"s{i}", "prompt": f"short {i}", "max_tokens": 1} for i in range(10 * k + 50)]
        sub = client.submit_batch(rows)
        # A job a message asked for first (nothing known of the batch yet): 4 jobs, one message;
        # then K a message for the 3 left: 4 messages, 4 + 3K jobs.
        assert r.llen(unique_queue) == 4 and sub.published == 4 + 3 * k
        assert len(queued_job_ids(r, unique_queue)) == sub.published
        r.delete(unique_queue)  # as if a worker took them
        pacer = Pacer(client.store, client.app, lane_queues(unique_queue))  # a worker's, long-lived
        assert pacer.tick() == 4 + 3 * k and r.llen(unique_queue) == 4
        r.delete(unique_queue)
        assert pacer.tick() == 4 * k and r.llen(unique_queue) == 4  # learnt: K jobs a message
    finally:
        r.delete(unique_queue)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from tests.helpers.tiny_models import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("tiny") / "model"))


def test_a_group_whose_entries_go_wrong_fails_only_those(db_url, redis_url, unique_queue, tiny_model, tmp_path):
    """One group message: good jobs, one already succeeded, one cancelled before it ran, one for
    another model, an id with no row, a malformed entry and a duplicate. The good ones succeed
    once, each bad one ends as it would alone, nothing is made of the missing one, the worker
    lives on. Messages of the format before ids only (``[job id, payload]``) still run, from
    the store: their payloads are ignored."""
    from worker.dispatch.app import GROUP_TASK_NAME, TASK_NAME
    from worker.api.client import Client
    from worker.common.config import Settings
    from worker.store.models import CANCELLED, FAILED, SUCCEEDED

    from tests.worker.test_integration import start_worker, wait_until

    from worker.store.rows import job_row
    from worker.store.store import Store

    store = Store(db_url, auto_upgrade=True)  # PostgreSQL is migrated explicitly, as in a deploy step
    client = Client(broker_url=redis_url, database_url=db_url, model=tiny_model, queue=unique_queue, store=store)
    settings = Settings(broker_url=redis_url, database_url=db_url, model=tiny_model, device="cpu", queue=unique_queue)
    worker = start_worker(client, settings, tmp_path, seqs=8)
    try:
        done = client.submit("done already", params={"max_tokens": 2, "temperature": 0}, model=tiny_model)
        assert client.wait(done, timeout=60) == SUCCEEDED
        before = client.store.get_job(done)
        rows = [job_row(model=tiny_model, prompt=f"group job {i}", queue=unique_queue,
                        params={"max_tokens": 3, "temperature": 0}) for i in range(8)]
        rows[5]["model"] = "gpt-9-ultra"
        client.store.upsert_jobs(rows)
        jobs = [row["id"] for row in rows]
        cancelled, other_model, old_group, old_single = jobs[4], jobs[5], jobs[6], jobs[7]
        client.store.cancel(job_ids=[cancelled])
        client.app.send_task(GROUP_TASK_NAME, args=(jobs[:6] + [done, "no-such-job", 42, jobs[0]],), queue=unique_queue)
        stale = {"prompt": "not this one", "params": {"max_tokens": 1}}  # what an old message carried
        client.app.send_task(GROUP_TASK_NAME, args=([[old_group, stale], [None, stale]],), queue=unique_queue)
        client.app.send_task(TASK_NAME, args=(old_single, stale), queue=unique_queue)

        wait_until(lambda: all(client.store.get_job(j).status in (SUCCEEDED, FAILED, CANCELLED) for j in jobs),
                   timeout=60)
        for job_id in jobs[:4] + [old_group, old_single]:
            job = client.store.get_job(job_id)
            assert job.status == SUCCEEDED and job.attempts == 1 and job.num_output_tokens == 3, job_id
            assert job.queue == unique_queue and job.prompt.startswith("group job")
        assert client.store.get_job(cancelled).status == CANCELLED
        assert client.store.get_job(cancelled).attempts == 0
        wrong = client.store.get_job(other_model)
        assert wrong.status == FAILED and wrong.error_type == "wrong_model"
        after = client.store.get_job(done)
        assert (after.attempts, after.finished_at, after.output_text) == (before.attempts, before.finished_at,
                                                                          before.output_text)
        assert client.store.get_job("no-such-job") is None  # a message never makes a job
        # The worker is alive and takes new work.
        marker = client.submit("after the group", params={"max_tokens": 2}, model=tiny_model)
        assert client.wait(marker, timeout=60) == SUCCEEDED
        assert worker.alive
    finally:
        worker.stop()
    log = (tmp_path / "worker.log").read_text()
    assert "group message entry ignored: 42" in log
    assert "group message entry ignored: None" in log
    assert f"job {done} skipped: already succeeded" in log
    assert "job no-such-job: no such job in the store; its message is dropped" in log
    assert "job no-such-job skipped: unknown job" in log
    assert log.count(f"job {jobs[0]} attempt 1 stored") == 1  # the duplicate entry skipped
