"""The store side of fault tolerance on SQLite and PostgreSQL: the reaper's compare-and-swap
lets exactly one reaper win a job; give-back and ``--retry-failed`` give fresh attempts while
the fence only grows; SQLite reads never wait for the write lock; batches insert in chunks."""

from __future__ import annotations

import sqlite3
import threading
import time

from sqlalchemy import event

from worker.store.models import FAILED, QUEUED, RUNNING
from worker.store.rows import job_row
from worker.store.store import Store

from tests.helpers.batches import ingest_lines, job_ids


def _store(url: str) -> Store:
    return Store(url, auto_upgrade=True)


def _running(store: Store, job_id: str, *, queue: str = "q", max_attempts: int = 5) -> int:
    store.upsert_jobs([job_row(model="m", prompt="hi", id=job_id, queue=queue)])
    return store.claim(job_id, worker="dead", device="cpu", lease_s=60, max_attempts=max_attempts, queue=queue).attempt


def test_reapers_racing_requeue_each_expired_job_exactly_once(db_url):
    store = _store(db_url)
    for i in range(20):
        _running(store, f"j{i}")
    _running(store, "other-queue", queue="elsewhere")
    time.sleep(0.3)
    store.heartbeat_many({"j0": 1})  # j0's worker is alive: its lease is fresh
    results: list[list[dict]] = []
    barrier = threading.Barrier(6)

    def reap():
        barrier.wait()
        results.append(store.reap_expired(0.2, ["q"], max_attempts=5))

    threads = [threading.Thread(target=reap) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    won = [row["id"] for rows in results for row in rows]
    assert sorted(won) == sorted(f"j{i}" for i in range(1, 20))  # each once; j0 alive; other queue not ours
    for i in range(1, 20):
        job = store.get_job(f"j{i}")
        assert job.status == QUEUED and job.recovered_at is not None and "lease expired" in job.error
    assert store.get_job("j0").status == RUNNING
    assert store.get_job("other-queue").status == RUNNING
    # The dead attempt's late result is refused: the fence holds.
    assert not store.finish("j1", 1, {"status": "succeeded"})


def test_reaping_a_job_out_of_attempts_fails_it_with_the_cause(db_url):
    store = _store(db_url)
    _running(store, "j", max_attempts=1)
    time.sleep(0.2)
    assert store.reap_expired(0.1, ["q"], max_attempts=1) == []
    job = store.get_job("j")
    assert job.status == FAILED and job.error_type == "attempts_exhausted" and "lease expired" in job.error


def test_give_back_forgives_the_attempt_and_keeps_the_fence(db_url):
    store = _store(db_url)
    store.upsert_jobs([job_row(model="m", prompt="hi", id="j", queue="q")])
    for _ in range(3):  # drained three times in a row: never "attempts exhausted"
        attempt = store.claim("j", worker="w", device="cpu", lease_s=60, max_attempts=1, queue="q").attempt
        assert attempt is not None
        assert store.give_back("j", attempt, "drained", forgive=True)
        assert not store.give_back("j", attempt, "again")  # only the owner can give it back
    job = store.get_job("j")
    assert job.status == QUEUED and job.attempts == 3 and job.attempts_forgiven == 3
    assert not store.finish("j", 2, {"status": "succeeded"})


def test_retry_failed_gives_fresh_attempts(db_url):
    store = _store(db_url)
    lines = [{"custom_id": "c", "prompt": "p"}]
    [job_id] = job_ids(store, ingest_lines(store, lines, name="b").batch_id)
    for _ in range(2):
        attempt = store.claim(job_id, worker="w", device="cpu", lease_s=0, max_attempts=2).attempt
        store.fail(job_id, attempt, "boom") if attempt == 2 else None
    assert store.get_job(job_id).status == FAILED
    assert ingest_lines(store, lines, name="b", retry_failed=True).enqueued == 1
    claim = store.claim(job_id, worker="w", device="cpu", lease_s=60, max_attempts=2)
    assert claim.ok and claim.attempt == 3  # runs again at once; the fence kept growing


def test_stale_queued_names_jobs_not_published_lately(db_url):
    store = _store(db_url)
    store.upsert_jobs([job_row(model="m", prompt="old", id="old", queue="q", enqueued_at=time.time() - 100),
                       job_row(model="m", prompt="new", id="new", queue="q")])
    assert store.stale_queued(50, ["q"]) == [("old", "q")]
    assert store.message_rows(["old"]) == [{"id": "old", "queue": "q", "model": "m", "priority": None, "params": {},
                                            "batch_id": None, "custom_id": None, "line_no": None}]
    store.mark_published(["old"], recovered=True)
    assert store.stale_queued(50, ["q"]) == []


def test_sqlite_reads_do_not_wait_for_the_write_lock(sqlite_url):
    store = _store(sqlite_url)
    store.upsert_jobs([job_row(model="m", prompt="hi", id="j")])
    path = sqlite_url.removeprefix("sqlite:///")
    writer = sqlite3.connect(path, isolation_level=None, timeout=0.1)
    writer.execute("BEGIN IMMEDIATE")  # another process holds the one write lock
    try:
        # Before reads began DEFERRED, each of these waited out the 30 s busy timeout and failed.
        assert store.get_job("j").status == QUEUED
        assert store.batch_counts("none")[QUEUED] == 0
        assert store.stale_queued(0, ["q"]) == []
    finally:
        writer.execute("ROLLBACK")
        writer.close()


def test_a_large_batch_is_written_in_many_short_transactions(sqlite_url):
    store = _store(sqlite_url)
    commits = []
    event.listen(store.engine, "commit", lambda conn: commits.append(1))
    lines = [{"custom_id": f"c{i}", "prompt": f"p{i}"} for i in range(1000)]
    result = ingest_lines(store, lines, name="big", chunk=100)
    assert result.enqueued == 1000 and store.batch_counts(result.batch_id)[QUEUED] == 1000
    assert len(commits) >= 10  # so a heartbeat's transaction waits for one chunk at most


def test_a_refresh_for_a_superseded_attempt_never_aborts_the_attempt_that_replaced_it(db_url):
    """After a database outage the reaper re-queues every running job at once and this same
    worker may claim one again while its heartbeat is still refreshing the old attempt: the
    refresh says "superseded", and it must not mark the new attempt lost (it once did, and the
    new attempt's good result was stored as failed: "aborted: cancelled or superseded")."""
    from worker.run.heartbeat import Heartbeat

    store = _store(db_url)
    first = _running(store, "x")
    aborted: list[str] = []

    class ReclaimedDuringTheRefresh(Store):
        """The real store; the reaper and a new claim run between the snapshot and the write."""

        def heartbeat_many(self, attempts):
            if attempts == {"x": first}:
                assert store.give_back("x", first, "lease expired", forgive=False)
                assert beat.untrack("x", first) is None  # attempt 1 ended (fenced)
                second = store.claim("x", worker="w", device="cpu", lease_s=60, max_attempts=5, queue="q").attempt
                beat.track("x", second, f"x#{second}")
            return super().heartbeat_many(attempts)

    racing = ReclaimedDuringTheRefresh(db_url)
    beat = Heartbeat(racing, aborted.append, interval=3600)
    try:
        beat.track("x", first, f"x#{first}")
        assert beat.beat() == []
        assert aborted == []
        job = store.get_job("x")
        assert job.status == RUNNING and job.attempts == first + 1
        before = job.heartbeat_at
        time.sleep(0.01)
        assert beat.beat() == []  # the new attempt's lease is refreshed: it is owned
        assert store.get_job("x").heartbeat_at > before
        assert beat.untrack("x", first + 1) is None  # its result will be stored as it is
    finally:
        beat.stop()


def test_claiming_a_job_again_in_the_same_process_aborts_the_older_attempt_and_keeps_the_newer(db_url):
    """The reaper re-queued a job whose attempt is still generating here (its heartbeats were
    lost to an outage) and this process claimed it again: the old attempt is aborted and told
    why; its end does not stop the new attempt's heartbeat (that once let the new lease expire)."""
    from worker.run.heartbeat import Heartbeat

    store = _store(db_url)
    first = _running(store, "x")
    aborted: list[str] = []
    beat = Heartbeat(store, aborted.append, interval=3600)
    try:
        beat.track("x", first, f"x#{first}")
        time.sleep(0.2)
        assert [row["id"] for row in store.reap_expired(0.1, ["q"], max_attempts=5)] == ["x"]
        second = store.claim("x", worker="w", device="cpu", lease_s=60, max_attempts=5, queue="q").attempt
        beat.track("x", second, f"x#{second}")
        assert aborted == [f"x#{first}"]
        assert beat.untrack("x", first) == f"superseded by attempt {second} in this worker"
        assert not store.finish("x", first, {"status": "succeeded"})  # and the fence refuses it anyway
        before = store.get_job("x").heartbeat_at
        time.sleep(0.01)
        assert beat.beat() == []
        assert store.get_job("x").heartbeat_at > before  # the new attempt is still refreshed
        assert beat.untrack("x", second) is None
        assert store.finish("x", second, {"status": "succeeded"})
    finally:
        beat.stop()
