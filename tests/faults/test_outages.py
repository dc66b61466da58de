"""Shutdowns and outages end with every job succeeded exactly once: a SIGTERM drain gives
unfinished jobs back at once; Redis restarted without persistence loses every message and the
orphan sweep re-publishes them; PostgreSQL cut for 20 s stalls nothing for good; a tiny KV
cache preempts and still finishes everything; a cancelled queued job never runs."""

from __future__ import annotations

import signal
import threading
import time

import pytest
from sqlalchemy.engine import make_url

from tests.faults.conftest import RedisServer, TcpProxy, Workers, stored_results, wait_until
from worker.api.client import Client
from worker.common.config import Settings
from worker.store.models import CANCELLED, GIVEN_BACK, QUEUED, RUNNING, SUCCEEDED
from worker.store.store import Store

SLOW = {"SPECBATCH_FAULTS": '{"step_sleep_s": 0.02}'}


def client_for(settings: Settings, store: Store | None = None) -> Client:
    return Client(broker_url=settings.broker_url, database_url=settings.database_url, model=settings.model,
                  queue=settings.queue, store=store)


def rows(n: int, tokens: int, prefix: str = "job") -> list[dict]:
    return [{"custom_id": f"{prefix}{i}", "prompt": f"{prefix} number {i}", "max_tokens": tokens,
             "ignore_eos": True, "temperature": 0} for i in range(n)]


@pytest.mark.waits(24)
def test_sigterm_drains_then_gives_back_at_once(workers):
    client = client_for(workers.settings)
    first = workers.start(env=SLOW)
    batch_id = client.submit_batch(rows(8, 400), name="drain").batch_id
    wait_until(lambda: client.store.batch_counts(batch_id)[RUNNING] >= 4, what="jobs running")
    first.proc.send_signal(signal.SIGTERM)
    assert first.proc.wait(timeout=60) == 0  # a warm shutdown, after DRAIN_TIMEOUT (2 s)
    jobs = client.store.jobs(batch_id)
    assert not [j for j in jobs if j.status == RUNNING]  # nothing waits for a lease to expire
    drained = [j for j in jobs if j.attempts == 1]
    assert drained and all(j.status == QUEUED and j.attempts_forgiven == 1 for j in drained), \
        ([(j.status, j.attempts_forgiven, j.error) for j in jobs], first_log_lines(workers.logs()))
    assert all("drained" in j.error for j in drained), [j.error for j in drained]
    workers.start()
    counts = client.wait(batch_id, timeout=180)
    assert counts[SUCCEEDED] == 8
    assert max(stored_results(workers.logs()).values()) == 1


def first_log_lines(logs: str, limit: int = 60) -> list[str]:
    """The workers' log lines that say what happened to jobs, for a failing assertion's message."""
    keep = ("given back", "stored", "crashed", "drain", "Traceback", "Error", "died", "shutdown")
    return [line[:240] for line in logs.splitlines() if any(k in line for k in keep)][:limit]


def run_through_outage(settings: Settings, tmp_path, name: str, outage, after=lambda: None) -> str:
    """60 jobs on two workers; ``outage()`` strikes once 5 have succeeded; all must end
    succeeded exactly once (then ``after()`` runs, workers still up). Returns the workers' logs."""
    group = Workers(settings, tmp_path)
    try:
        client = client_for(settings)
        group.start(env=SLOW)
        group.start(env=SLOW)
        batch_id = client.submit_batch(rows(60, 40), name=name).batch_id
        wait_until(lambda: client.store.batch_counts(batch_id)[SUCCEEDED] >= 5, what="progress")
        outage()
        # The workers' supervisor (systemd, Kubernetes, compose) restarts a worker that exits:
        # Celery may give up on a broker that vanished mid-reconnect ("Unrecoverable error").
        deadline = time.monotonic() + 240
        while (counts := client.store.batch_counts(batch_id))[QUEUED] + counts[RUNNING] and time.monotonic() < deadline:
            for worker in group.all:
                worker.keep_alive()
            time.sleep(0.5)
        counts = client.wait(batch_id, timeout=5)  # the producer's own polls live through it too
        assert counts[SUCCEEDED] == 60, (counts, client.store.failed_jobs(batch_id))
        after()
        logs = group.logs()
        assert max(stored_results(logs).values()) == 1
        return logs
    finally:
        group.stop_all()


@pytest.mark.waits(27)
@pytest.mark.parametrize("persistent", [False, True], ids=["no-persistence", "append-only-file"])
def test_redis_restarted(persistent, sqlite_url, unique_queue, tiny_model, tmp_path, monkeypatch):
    # Two jobs a message (the producer publishes them): 30 messages, more than the two workers
    # reserve (8 each), so the restart loses queued messages (the orphan sweep's case) besides
    # reserved group messages; with the default six a message, the workers held all ten.
    monkeypatch.setenv("SPECBATCH_GROUP_JOBS", "2")
    redis_server = RedisServer(tmp_path, persistent=persistent)
    settings = Settings(broker_url=redis_server.url, database_url=sqlite_url, model=tiny_model, device="cpu",
                        queue=unique_queue)

    def restart() -> None:
        redis_server.kill()  # without persistence, every queued and reserved message is gone
        time.sleep(2.0)
        redis_server.start()  # same port

    try:
        logs = run_through_outage(settings, tmp_path, "redis-restart", restart)
        if not persistent:
            assert "re-published" in logs  # the orphan sweep did it
    finally:
        redis_server.kill()


@pytest.mark.waits(55)
def test_database_cut_for_20_seconds(pg_url, redis_url, unique_queue, tiny_model, tmp_path):
    url = make_url(pg_url)
    proxy = TcpProxy(url.port or 5432)
    proxied = url.set(port=proxy.port).render_as_string(hide_password=False)
    Store(pg_url, auto_upgrade=True)  # migrated directly, as a deploy step would
    settings = Settings(broker_url=redis_url, database_url=proxied, model=tiny_model, device="cpu",
                        queue=unique_queue)

    submitted: list[str] = []
    producer = client_for(settings)

    def cut_for_20_s() -> None:
        proxy.cut()
        # A producer submitting during the cut waits for the database, then goes through.
        during = threading.Thread(target=lambda: submitted.append(producer.submit("sent during the cut")))
        during.start()
        time.sleep(20.0)
        proxy.restore()
        during.join(120)

    def the_late_submission_ran() -> None:
        assert len(submitted) == 1 and producer.wait(submitted[0], timeout=120) == SUCCEEDED

    try:
        logs = run_through_outage(settings, tmp_path, "db-cut", cut_for_20_s, after=the_late_submission_ran)
        assert "database unreachable" in logs  # the cut was felt, and waited out
    finally:
        proxy.close()


def test_tiny_kv_cache_preempts_and_finishes_everything(workers):
    client = client_for(workers.settings)
    # 24 blocks of 16 tokens for 8 sequences growing to ~110 tokens each: they cannot all fit.
    workers.start(seqs=8, env={"SPECBATCH_KV_CACHE_BYTES": str(24 * 8192)})  # tiny model: 8 KiB a block
    batch_id = client.submit_batch(rows(24, 100), name="kv").batch_id
    counts = client.wait(batch_id, timeout=240)
    assert counts[SUCCEEDED] == 24
    jobs = client.store.jobs(batch_id)
    assert all(len(j.output_token_ids) == 100 for j in jobs)
    assert sum(j.num_preemptions or 0 for j in jobs) > 0


def test_cancelled_queued_job_never_runs(workers):
    client = client_for(workers.settings)
    job = client.submit("cancel me before any worker", params={"max_tokens": 8})
    assert client.cancel(job) == [job]
    workers.start()
    marker = client.submit("after it", params={"max_tokens": 4})
    assert client.wait(marker, timeout=120) == SUCCEEDED
    row = client.store.get_job(job)
    assert row.status == CANCELLED and row.attempts == 0 and row.output_text is None
    assert f"job {job} skipped: already cancelled" in workers.logs()


def test_the_reaper_gives_live_workers_a_lease_after_a_database_outage(pg_url, redis_url, unique_queue):
    """While the database was away nobody could heartbeat: every lease looks expired when it
    comes back. The reaper waits one lease before reaping, so a live worker's job is refreshed
    (not re-run, not charged an attempt); a dead worker's job is still reaped after that lease."""
    from worker.run.reaper import Reaper
    from worker.store.rows import job_row

    url = make_url(pg_url)
    proxy = TcpProxy(url.port or 5432)
    proxied = url.set(port=proxy.port).render_as_string(hide_password=False)
    Store(pg_url, auto_upgrade=True)
    client = Client(broker_url=redis_url, database_url=proxied, model="m", queue=unique_queue)
    store, lease = client.store, 2.0
    for job_id in ("live", "dead"):
        store.upsert_jobs([job_row(model="m", prompt="hi", id=job_id, queue=unique_queue)])
        assert store.claim(job_id, worker="w", device="cpu", lease_s=lease, max_attempts=5, queue=unique_queue).ok
    reaper = Reaper(store, client.app, [unique_queue], worker="t", lease_s=lease, max_attempts=5,
                    interval=3600, grace_s=3600)
    try:
        assert reaper.sweep_or_log() == {"reaped": 0, "orphans": 0}
        proxy.cut()
        assert reaper.sweep_or_log() is None
        time.sleep(lease + 0.5)  # both leases expire while nobody can write
        proxy.restore()
        assert reaper.sweep_or_log()["reaped"] == 0  # the database is back: a lease of grace
        for _ in range(3):  # the live worker heartbeats again; the dead one never does
            store.heartbeat_many({"live": 1})
            time.sleep(lease / 2)
        store.heartbeat_many({"live": 1})
        assert reaper.sweep_or_log()["reaped"] == 1
        live, dead = store.get_job("live"), store.get_job("dead")
        assert live.status == RUNNING and live.attempts == 1
        assert dead.status == QUEUED and "lease expired" in dead.error
    finally:
        proxy.close()


def test_a_claim_or_result_whose_commit_answer_is_lost_is_still_ours(pg_url):
    """The connection is cut right after PostgreSQL commits a claim and before the worker hears
    it (its COMMIT's answer dropped by a proxy): the worker's retry finds the job running under
    its own name and claim time and runs it as attempt 1. Taken for another live attempt, the
    job ran nowhere until its lease expired and then ran again as attempt 2 (charged). A result
    write or a give-back cut the same way is done once and reported done."""
    from worker.store.dbretry import with_db_retry
    from worker.store.rows import job_row

    url = make_url(pg_url)
    proxy = TcpProxy(url.port or 5432)
    proxied = url.set(port=proxy.port).render_as_string(hide_password=False)
    Store(pg_url, auto_upgrade=True)
    store = Store(proxied)
    try:
        store.upsert_jobs([job_row(model="m", prompt=f"p{i}", id=f"lost-answer-{i}") for i in range(3)])
        ids = [f"lost-answer-{i}" for i in range(3)]
        at = time.time()
        proxy.lose_commit_answer.set()
        claims = with_db_retry("claim", lambda: store.claim_many(ids + ids[:1], worker="w1", device="cpu", lease_s=60,
                                                                 max_attempts=3, at=at))
        assert not proxy.lose_commit_answer.is_set(), "no COMMIT answer was dropped: the test proved nothing"
        assert [(c.ok, c.attempt) for c in claims[:3]] == [(True, 1)] * 3, [c.reason for c in claims]
        assert [c.job["prompt"] for c in claims[:3]] == ["p0", "p1", "p2"]
        assert claims[3].reason == "running in another live attempt"  # a duplicate in the message: not ours twice
        # Another delivery of the same jobs (another claim time, or another worker) is refused.
        assert [c.reason for c in store.claim_many(ids, worker="w1", device="cpu", lease_s=60, max_attempts=3)] \
            == ["running in another live attempt"] * 3
        assert not store.claim(ids[0], worker="w2", device="cpu", lease_s=60, max_attempts=3, at=at).ok
        assert all(store.get_job(i).attempts == 1 for i in ids)
        # The same for the results: a retried write whose first commit went through is stored,
        # once; a write for an attempt that does not own the job is still refused.
        done = time.time()
        results = [(i, 1, {"status": SUCCEEDED, "output_text": f"out {i}", "finished_at": done}) for i in ids]
        proxy.lose_commit_answer.set()
        assert with_db_retry("result", lambda: store.finish_many(results), until_written=True) == [True] * 3
        assert not proxy.lose_commit_answer.is_set(), "no COMMIT answer was dropped: the test proved nothing"
        assert [(store.get_job(i).status, store.get_job(i).output_text) for i in ids] == \
            [(SUCCEEDED, f"out {i}") for i in ids]
        assert store.finish_many([(ids[0], 2, {"status": SUCCEEDED, "finished_at": done})]) == [False]
        assert store.finish_many([(ids[0], 1, {"status": SUCCEEDED, "finished_at": time.time()})]) == [False]
        # And a give-back (a draining worker's): back in the queue once, reported done, so its
        # worker publishes its message (reported fenced, the job waited for the orphan sweep).
        store.upsert_jobs([job_row(model="m", prompt="back", id="lost-answer-back")])
        assert store.claim("lost-answer-back", worker="w1", device="cpu", lease_s=60, max_attempts=3).attempt == 1
        back_at = time.time()
        proxy.lose_commit_answer.set()
        assert with_db_retry("give back", lambda: store.give_back("lost-answer-back", 1, "drained", at=back_at),
                             until_written=True)
        assert not proxy.lose_commit_answer.is_set(), "no COMMIT answer was dropped: the test proved nothing"
        assert store.get_job("lost-answer-back").status == QUEUED
        assert [a.outcome for a in store.attempt_history("lost-answer-back")] == [GIVEN_BACK]
        assert not store.give_back("lost-answer-back", 1, "drained", at=time.time())  # not that one: fenced
    finally:
        store.dispose()
        proxy.close()
