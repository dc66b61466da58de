"""Group commit (a worker's store): many threads' claims and results share transactions, and
every caller still gets its own answer, on SQLite and PostgreSQL."""

from __future__ import annotations

import threading

import pytest
from sqlalchemy import text

from worker.store.models import RUNNING, SUCCEEDED
from worker.store.rows import job_row
from worker.store.store import Store


def test_concurrent_claims_and_results_share_transactions_and_each_gets_its_answer(db_url):
    store = Store(db_url, auto_upgrade=True, group_commit=True)
    n = 48
    for i in range(n):
        store.upsert_jobs([job_row(model="m", prompt=f"p{i}", id=f"j{i}")])
    store.upsert_jobs([job_row(model="m", prompt="dup", id="dup")])
    barrier = threading.Barrier(n + 4)
    claims, finished, dup_claims = {}, {}, []

    def job(i: int) -> None:
        barrier.wait()
        claim = store.claim(f"j{i}", worker="w", device="cpu", lease_s=60, max_attempts=3)
        claims[i] = claim
        finished[i] = store.finish(f"j{i}", claim.attempt, {"status": SUCCEEDED, "output_text": f"out{i}"})

    def duplicate() -> None:  # four copies of one message: exactly one wins, in or across groups
        barrier.wait()
        dup_claims.append(store.claim("dup", worker="w", device="cpu", lease_s=60, max_attempts=3))

    threads = [threading.Thread(target=job, args=(i,)) for i in range(n)]
    threads += [threading.Thread(target=duplicate) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(claims[i].attempt == 1 for i in range(n)) and all(finished.values())
    assert [store.get_job(f"j{i}").output_text for i in range(n)] == [f"out{i}" for i in range(n)]
    assert sum(c.ok for c in dup_claims) == 1 and store.get_job("dup").status == RUNNING
    # A stale attempt's result is still refused (the fence holds inside a group too).
    assert store.finish("j0", 7, {"status": SUCCEEDED, "output_text": "late"}) is False
    group = store._group
    assert group.writes == 2 * n + 4 + 1 and group.groups < group.writes  # writes shared commits


def test_a_write_that_fails_fails_alone_and_its_group_still_commits(sqlite_url):
    store = Store(sqlite_url, auto_upgrade=True, group_commit=True)
    for i in range(3):
        store.upsert_jobs([job_row(model="m", prompt=f"p{i}", id=f"j{i}")])
    gate, holding = threading.Event(), threading.Event()

    def hold(conn):  # keeps the writer busy so the next writes queue up as one group
        holding.set()
        gate.wait(10)
        return "held"

    results: dict[str, object] = {}

    def call(name, write):
        try:
            results[name] = store._group.run(write)
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            results[name] = exc

    first = threading.Thread(target=call, args=("hold", hold))
    first.start()
    assert holding.wait(10)
    threads = [threading.Thread(target=call, args=(f"claim{i}", lambda conn, i=i: store._claim(
        conn, f"j{i}", worker="w", device="cpu", lease_s=60, max_attempts=3, queue=None)))
        for i in range(3)]
    threads.append(threading.Thread(target=call, args=("bad", lambda conn: conn.execute(text("SELECT * FROM nope")))))
    for t in threads:
        t.start()
    while store._group._queue.qsize() < 4:
        pass
    gate.set()
    for t in [first, *threads]:
        t.join(10)
    assert results["hold"] == "held"
    assert isinstance(results["bad"], Exception) and "nope" in str(results["bad"])
    assert all(results[f"claim{i}"].attempt == 1 for i in range(3))
    assert all(store.get_job(f"j{i}").status == RUNNING for i in range(3))


@pytest.mark.parametrize("group_commit", [True, False])
def test_stopped_group_commit_writes_directly(sqlite_url, group_commit):
    store = Store(sqlite_url, auto_upgrade=True, group_commit=group_commit)
    store.upsert_jobs([job_row(model="m", prompt="p", id="j")])
    if store._group is not None:
        store._group.stop()
    assert store.claim("j", worker="w", device="cpu", lease_s=60, max_attempts=3).attempt == 1
