"""Store idempotency on SQLite and PostgreSQL: upserts, attempt fencing, no second result."""

from __future__ import annotations

import logging
import threading
import time

from sqlalchemy import func, inspect, select

from worker.store import migrate
from worker.store.models import CANCELLED, FAILED, QUEUED, RUNNING, SUCCEEDED, Job
from worker.store.pacing import unpublished_select
from worker.store.rows import INVALID_INPUT, job_row
from worker.store.store import Store

from tests.helpers.batches import ingest_lines, job_ids


def _store(url: str) -> Store:
    return Store(url, auto_upgrade=True)


def test_migrations_upgrade_empty_database(db_url):
    store = Store(db_url, auto_upgrade=False)
    assert migrate.current_revision(store.engine) is None
    store.upgrade()
    assert migrate.is_current(store.engine)
    tables = set(inspect(store.engine).get_table_names())
    assert {"batches", "jobs", "alembic_version"} <= tables
    store.upgrade()  # idempotent
    store.dispose()


def test_sqlite_is_upgraded_automatically_and_uses_wal(sqlite_url):
    store = Store(sqlite_url)
    assert migrate.is_current(store.engine)
    with store.engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() == 30000


def test_upsert_same_job_id_twice_keeps_one_row(db_url):
    store = _store(db_url)
    row = job_row(model="m", prompt="hi", id="job-1")
    store.upsert_jobs([row])
    store.upsert_jobs([dict(row, prompt="changed")])
    job = store.get_job("job-1")
    assert job.prompt == "hi" and job.status == QUEUED


def test_claim_fencing_refuses_older_attempt(db_url):
    store = _store(db_url)
    store.upsert_jobs([job_row(model="m", prompt="hi", id="j")])
    c1 = store.claim("j", worker="w1", device="cpu", lease_s=0.0, max_attempts=5)
    assert c1.attempt == 1
    # A redelivered copy after the lease expired takes over as attempt 2 ...
    c2 = store.claim("j", worker="w2", device="cpu", lease_s=0.0, max_attempts=5)
    assert c2.attempt == 2
    # ... so attempt 1 can neither heartbeat nor write its result.
    assert not store.heartbeat("j", 1)
    assert not store.finish("j", 1, {"status": SUCCEEDED, "output_text": "old"})
    assert store.finish("j", 2, {"status": SUCCEEDED, "output_text": "new", "finished_at": time.time()})
    job = store.get_job("j")
    assert (job.status, job.output_text, job.attempts, job.worker) == (SUCCEEDED, "new", 2, "w2")
    # A succeeded job is never claimed again.
    c3 = store.claim("j", worker="w3", device="cpu", lease_s=0.0, max_attempts=5)
    assert not c3.ok and "succeeded" in c3.reason


def test_duplicate_while_live_is_skipped(db_url):
    store = _store(db_url)
    store.upsert_jobs([job_row(model="m", prompt="hi", id="j")])
    assert store.claim("j", worker="w1", device="cpu", lease_s=60, max_attempts=5).attempt == 1
    dup = store.claim("j", worker="w2", device="cpu", lease_s=60, max_attempts=5)
    assert not dup.ok and "live" in dup.reason


def test_concurrent_claims_exactly_one_wins_and_only_it_gets_the_request(db_url):
    store = _store(db_url)
    store.upsert_jobs([job_row(model="m", prompt="hi", id="j", params={"max_tokens": 3})])
    results = []
    barrier = threading.Barrier(8)

    def go(i):
        barrier.wait()
        results.append(store.claim("j", worker=f"w{i}", device="cpu", lease_s=60, max_attempts=5))

    threads = [threading.Thread(target=go, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(c.ok for c in results) == 1
    assert store.get_job("j").attempts == 1
    [won] = [c for c in results if c.ok]
    assert won.job["prompt"] == "hi" and won.job["params"] == {"max_tokens": 3}
    assert all(c.job is None for c in results if not c.ok)


def test_racing_claims_on_two_connections_one_wins(db_url):
    """Two stores (two connection pools, as two worker processes) claim the same jobs at once:
    each job is won by exactly one, and the winner alone has its request."""
    stores = [_store(db_url), Store(db_url)]
    ids = [f"r{i}" for i in range(20)]
    stores[0].upsert_jobs([job_row(model="m", prompt=f"p {job_id}", id=job_id) for job_id in ids])
    barrier = threading.Barrier(2)
    claims: list[list] = [[], []]

    def go(i):
        barrier.wait()
        claims[i] = stores[i].claim_many(ids, worker=f"w{i}", device="cpu", lease_s=60, max_attempts=5)

    threads = [threading.Thread(target=go, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for job_id, first, second in zip(ids, *claims):
        assert first.ok != second.ok, job_id
        won = first if first.ok else second
        assert won.attempt == 1 and won.job["prompt"] == f"p {job_id}"
    for store in stores:
        store.dispose()


def test_the_claim_returns_the_request_it_claims(db_url):
    store = _store(db_url)
    messages = [{"role": "user", "content": "hi ☃"}]
    store.upsert_jobs([
        job_row(model="m", messages=messages, id="chat", params={"temperature": 0, "logit_bias": {"7": 1.5}},
                custom_id="c", priority=0, queue="q.interactive", cache_salt="tenant", request_digest="d" * 32),
        job_row(model="m", prompt_token_ids_in=[1, 2, 3], id="ids", queue="q"),
    ])
    chat = store.claim("chat", worker="w", device="cpu", lease_s=60, max_attempts=3, queue="q.interactive")
    assert chat.job == {"model": "m", "prompt": None, "prompt_token_ids_in": None, "prompt_tokens": None, "messages": messages,
                        "params": {"temperature": 0, "logit_bias": {"7": 1.5}}, "priority": 0, "custom_id": "c",
                        "queue": "q.interactive", "cache_salt": "tenant", "request_digest": "d" * 32}
    ids = store.claim_many(["ids"], worker="w", device="cpu", lease_s=0, max_attempts=3)[0]
    assert ids.job["prompt_token_ids_in"] == [1, 2, 3] and ids.job["queue"] == "q"  # no queue given: kept
    # Taking over an expired lease returns the request too (and records the lost attempt).
    again = store.claim("ids", worker="w2", device="cpu", lease_s=0, max_attempts=3, queue="q2")
    assert again.attempt == 2 and again.job["prompt_token_ids_in"] == [1, 2, 3] and again.job["queue"] == "q2"
    assert [a.outcome for a in store.attempt_history("ids")] == ["lost"]


def test_attempts_exhausted_fails_job(db_url):
    store = _store(db_url)
    store.upsert_jobs([job_row(model="m", prompt="hi", id="j")])
    for _ in range(2):
        assert store.claim("j", worker="w", device="cpu", lease_s=0.0, max_attempts=2).ok
    c = store.claim("j", worker="w", device="cpu", lease_s=0.0, max_attempts=2)
    assert not c.ok
    assert store.get_job("j").status == FAILED


def test_a_message_for_a_missing_row_is_dropped_and_nothing_is_inserted(db_url, caplog):
    """The store is the only truth: a message whose job has no row (a database restored from
    an older backup) makes no job; it is dropped, with a warning."""
    store = _store(db_url)
    store.upsert_jobs([job_row(model="m", prompt="hi", id="here")])
    with caplog.at_level(logging.WARNING, logger="worker.store.leases"):
        lost = store.claim("lost", worker="w", device="cpu", lease_s=60, max_attempts=3, queue="q")
        both = store.claim_many(["lost", "here"], worker="w", device="cpu", lease_s=60, max_attempts=3)
    assert (lost.ok, lost.reason, lost.job) == (False, "unknown job", None)
    assert not both[0].ok and both[0].reason == "unknown job" and both[1].attempt == 1
    assert store.get_job("lost") is None
    with store.engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(Job)).scalar_one() == 1
    assert "job lost: no such job in the store; its message is dropped" in caplog.text


def test_a_rerun_of_a_file_skips_succeeded_and_retries_failed_on_request(db_url):
    store = _store(db_url)
    lines = [{"custom_id": f"c{i}", "prompt": f"p{i}"} for i in range(4)] + ["{bad json"]
    first = ingest_lines(store, lines, name="b", input_file="f")
    assert first.enqueued == 4 and first.num_bad == 1
    counts = store.batch_counts(first.batch_id)
    assert counts[QUEUED] == 4 and counts[FAILED] == 1
    jobs = {j.custom_id: j for j in store.jobs(first.batch_id) if j.custom_id}
    # c0 succeeds, c1 fails, c2 is cancelled, c3 stays queued
    a = store.claim(jobs["c0"].id, worker="w", device="cpu", lease_s=60, max_attempts=3).attempt
    store.finish(jobs["c0"].id, a, {"status": SUCCEEDED})
    a = store.claim(jobs["c1"].id, worker="w", device="cpu", lease_s=60, max_attempts=3).attempt
    store.fail(jobs["c1"].id, a, "boom")
    store.cancel(job_ids=[jobs["c2"].id])
    # Rerun the same file (fresh ids drawn): matched by custom_id.
    second = ingest_lines(store, lines, name="b", input_file="f")
    assert second.batch_id == first.batch_id
    assert second.skipped_succeeded == 1 and second.skipped_failed == 2 and second.enqueued == 1
    after = {j.custom_id: j for j in store.jobs(first.batch_id) if j.custom_id}
    assert {c: j.id for c, j in after.items()} == {c: j.id for c, j in jobs.items()}  # no row added
    assert after["c3"].status == QUEUED and after["c3"].published_at is None  # back to the pacer
    # Invalid lines are replaced, not duplicated.
    assert len([j for j in store.jobs(first.batch_id) if j.error_type == INVALID_INPUT]) == 1
    third = ingest_lines(store, lines, name="b", input_file="f", retry_failed=True)
    assert third.enqueued == 3 and third.skipped_succeeded == 1 and third.skipped_failed == 0
    assert store.get_job(jobs["c1"].id).status == QUEUED
    assert store.get_job(jobs["c2"].id).status == QUEUED
    assert len(store.jobs(first.batch_id)) == 5


def test_cancel_marks_queued_and_running(db_url):
    store = _store(db_url)
    store.upsert_jobs([job_row(model="m", prompt="a", id="q")])
    store.upsert_jobs([job_row(model="m", prompt="b", id="r")])
    a = store.claim("r", worker="w", device="cpu", lease_s=60, max_attempts=3).attempt
    cancelled, running = store.cancel(job_ids=["q", "r"])
    assert sorted(cancelled) == ["q", "r"] and running == ["r"]
    assert not store.heartbeat("r", a)  # tells the worker to abort
    assert not store.finish("r", a, {"status": SUCCEEDED})
    assert store.get_job("r").status == CANCELLED
    assert not store.claim("q", worker="w", device="cpu", lease_s=60, max_attempts=3).ok


def test_refresh_batch_counts_and_finish(db_url):
    store = _store(db_url)
    batch_id = ingest_lines(store, [{"custom_id": "c", "prompt": "p"}]).batch_id
    [jid] = job_ids(store, batch_id)
    a = store.claim(jid, worker="w", device="cpu", lease_s=60, max_attempts=3).attempt
    assert store.refresh_batch(batch_id)[RUNNING] == 1
    assert store.get_batch(batch_id).finished_at is None
    store.finish(jid, a, {"status": SUCCEEDED})
    store.refresh_batch(batch_id)
    b = store.get_batch(batch_id)
    assert b.num_succeeded == 1 and b.num_total == 1 and b.finished_at is not None


def test_heartbeat_many_refreshes_owned_attempts_and_names_the_lost(db_url):
    store = _store(db_url)
    for job_id in ("live", "cancelled", "superseded", "done"):
        store.upsert_jobs([job_row(model="m", prompt="p", id=job_id)])
    att = {j: store.claim(j, worker="w", device="cpu", lease_s=60, max_attempts=3).attempt
           for j in ("live", "cancelled", "superseded", "done")}
    store.cancel(job_ids=["cancelled"])
    # A newer attempt took "superseded" over (its lease was presumed dead).
    assert store.claim("superseded", worker="w2", device="cpu", lease_s=0, max_attempts=3).attempt == 2
    assert store.finish("done", att["done"], {"status": SUCCEEDED, "finished_at": time.time()})
    before = store.get_job("live").heartbeat_at
    time.sleep(0.01)
    lost = store.heartbeat_many(att)
    assert lost == {"cancelled", "superseded", "done"}
    assert store.get_job("live").heartbeat_at > before
    assert store.get_job("superseded").worker == "w2"  # the other attempt's row is untouched
    assert store.heartbeat_many({}) == set()


def test_one_heartbeat_thread_aborts_what_was_cancelled(db_url):
    from worker.run.heartbeat import Heartbeat

    store = _store(db_url)
    for job_id in ("a", "b"):
        store.upsert_jobs([job_row(model="m", prompt="p", id=job_id)])
    aborted: list[str] = []
    beat = Heartbeat(store, aborted.append, interval=3600)  # beats driven by hand below
    try:
        for job_id in ("a", "b"):
            beat.track(job_id, store.claim(job_id, worker="w", device="cpu", lease_s=60, max_attempts=3).attempt,
                       f"{job_id}#1")
        assert beat.beat() == [] and aborted == []
        store.cancel(job_ids=["b"])
        assert beat.beat() == ["b"] and aborted == ["b#1"]
        assert beat.untrack("b", 1) == "cancelled or superseded"
        assert beat.untrack("a", 1) is None
        assert beat.beat() == []  # nothing tracked any more
    finally:
        beat.stop()


def test_the_pacer_s_next_jobs_are_an_ordered_index_range_on_a_freshly_loaded_table(db_url):
    """Taking a batch's next jobs of one queue reads an index range in line order, with no sort
    and no scan of the batch's other jobs, right after a bulk load (no statistics gathered yet:
    on PostgreSQL the planner then took (batch, status) and filtered every job; migration 0005)."""
    store = _store(db_url)
    batch_id, _ = store.open_batch(name="b", input_file=None, model="m", params=None, priority=1,
                                   max_in_flight=None)
    rows = [job_row(model="m", prompt=f"p{i}", custom_id=f"c{i}", line_no=i + 1, queue="q") for i in range(3000)]
    store.write_chunk(batch_id, rows, [], reopened=False, retry_failed=False)
    names = {ix["name"] for ix in inspect(store.engine).get_indexes("jobs")}
    assert "ix_jobs_status" not in names and "ix_jobs_status_heartbeat" in names
    with store.engine.connect() as conn:
        for queue, limit in (("q", 1000), ("q.interactive", 32)):
            compiled = unpublished_select(batch_id, queue, limit).compile(
                dialect=conn.dialect, compile_kwargs={"render_postcompile": True})
            if store.dialect == "postgresql":
                assert "ix_jobs_unpublished" in names and "ix_jobs_pacing" not in names
                plan = "\n".join(r[0] for r in conn.exec_driver_sql("EXPLAIN " + str(compiled), compiled.params))
                assert "ix_jobs_unpublished" in plan and "Sort" not in plan and "Filter" not in plan, plan
                # As psycopg runs it from its fifth time on: prepared, with a generic plan.
                sql = str(compiled)
                for i, name in enumerate(compiled.params, start=1):
                    sql = sql.replace(f"%({name})s", f"${i}")
                conn.exec_driver_sql(f"PREPARE take_next AS {sql}")
                conn.exec_driver_sql("SET plan_cache_mode = force_generic_plan")
                args = ", ".join(f"'{v}'" if isinstance(v, str) else str(v) for v in compiled.params.values())
                plan = "\n".join(r[0] for r in conn.exec_driver_sql(f"EXPLAIN EXECUTE take_next({args})"))
                conn.exec_driver_sql("DEALLOCATE take_next")
                conn.exec_driver_sql("RESET plan_cache_mode")
                assert "ix_jobs_unpublished" in plan and "Sort" not in plan and "Filter" not in plan, plan
            else:
                assert "ix_jobs_pacing" in names
                params = tuple(compiled.params[k] for k in compiled.positiontup)
                plan = "\n".join(r[-1] for r in conn.exec_driver_sql("EXPLAIN QUERY PLAN " + str(compiled), params))
                assert "ix_jobs_pacing" in plan and "TEMP B-TREE" not in plan, plan
    taken = store.take_unpublished(batch_id, "q", 1000)
    assert [r["custom_id"] for r in taken] == [f"c{i}" for i in range(1000)]
    store.dispose()


def test_a_claim_retried_through_an_outage_keeps_its_time_and_starts_its_lease_now(db_url):
    """Every retry of one delivery's claim passes the time it was first tried (``at``): that is
    the attempt's start, and how a retry knows a claim that went through unanswered as its own;
    its lease starts when the claim is written, or a claim retried through a long outage began
    with its lease already expired."""
    store = _store(db_url)
    store.upsert_jobs([job_row(model="m", prompt="hi", id="j"), job_row(model="m", prompt="hi", id="k")])
    at = time.time() - 100  # first tried before a 100-s outage
    before = time.time()
    claim = store.claim_many(["j"], worker="w", device="cpu", lease_s=60, max_attempts=3, at=at)[0]
    job = store.get_job("j")
    assert claim.attempt == 1 and claim.started_at == at and job.started_at == at and job.heartbeat_at >= before
    assert store.claim_many(["j"], worker="w", device="cpu", lease_s=60, max_attempts=3, at=at)[0].attempt == 1
    store.claim("k", worker="w", device="cpu", lease_s=0, max_attempts=3)  # a lost attempt, taken over:
    taken = store.claim("k", worker="w", device="cpu", lease_s=0, max_attempts=3, at=at)  # by the one-job claim
    assert taken.attempt == 2 and store.get_job("k").started_at == at and store.get_job("k").heartbeat_at >= before
