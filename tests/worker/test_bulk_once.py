"""Bulk once, end to end on a real worker (tiny model), Redis and SQLite/PostgreSQL: a greedy,
seeded or structured result is answered from the result cache at ingest, token for token what
a fresh run gives; an unseeded sample never is; a changed weight file misses; rows of a batch
asking the same run once and each gets its own output line; tenants' salts keep their results
apart; the pacer publishes rows behind one system prompt together."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.worker.test_integration import start_worker
from worker.store.models import QUEUED, SUCCEEDED

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]

QUESTIONS = [f"What is {i} plus {i}?" for i in range(12)]
SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "sure": {"type": "boolean"}},
          "required": ["answer", "sure"], "additionalProperties": False}


@pytest.fixture(scope="module")
def served(module_db_url, module_redis_url, tmp_path_factory):
    """One worker for the module (per database); each test submits batches through a client."""
    from tests.helpers.tiny_models import make_tiny_model
    from worker.api.client import Client
    from worker.common.config import Settings
    from worker.request.validate import TokenCounter
    from worker.store.store import Store

    root = tmp_path_factory.mktemp("once")
    model = str(make_tiny_model(root / "tiny", logit_scale=8.0))
    queue = f"gen.test-{uuid.uuid4().hex[:10]}"
    Store(module_db_url, auto_upgrade=True)
    client = Client(broker_url=module_redis_url, database_url=module_db_url, model=model, queue=queue)
    settings = Settings(broker_url=module_redis_url, database_url=module_db_url, model=model, device="cpu",
                        queue=queue)
    worker = start_worker(client, settings, root, seqs=16)
    counter = TokenCounter(model)
    yield {"model": model, "queue": queue, "redis": module_redis_url, "db": module_db_url, "client": client,
           "counter": counter, "root": root}
    worker.stop(timeout=10)


def submit(served, rows, *, wait=True, **kwargs):
    client = served["client"]
    sub = client.submit_batch(rows, name=f"b-{uuid.uuid4().hex[:8]}", count_tokens=served["counter"],
                              max_model_len=served["counter"].max_model_len, **kwargs)
    if wait:
        counts = client.wait(sub.batch_id, timeout=120)
        assert counts["succeeded"] == len(rows), counts
    return sub, {j.custom_id: j for j in client.store.jobs(sub.batch_id)}


def rows_of(kind: str, tag: str) -> list[dict]:
    params = {"greedy": {"temperature": 0, "max_tokens": 12},
              "seeded": {"temperature": 1.0, "seed": 1234, "max_tokens": 12},
              "structured": {"temperature": 0.7, "seed": 99, "max_tokens": 60,
                             "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}}}[kind]
    return [{"custom_id": f"{tag}-{i}", "messages": [{"role": "user", "content": f"{tag}: {q}"}], **params}
            for i, q in enumerate(QUESTIONS)]


@pytest.mark.parametrize("kind", ["greedy", "seeded", "structured"])
def test_a_cached_answer_is_token_identical_to_a_fresh_run(served, kind):
    rows = rows_of(kind, f"id-{kind}")
    first, computed = submit(served, rows)
    assert all(j.attempts == 1 and not j.cached and j.request_digest for j in computed.values())
    again, answered = submit(served, rows)
    assert again.ingest.cached == len(rows) and again.ingest.enqueued == 0
    fresh, recomputed = submit(served, rows, cache=False)  # a fresh run: the cache neither read nor merged
    assert fresh.ingest.cached == 0 and all(j.request_digest is None and j.attempts == 1 for j in recomputed.values())
    for cid, job in answered.items():
        assert job.status == SUCCEEDED and job.cached and job.attempts == 0 and job.worker is None
        assert job.output_token_ids == computed[cid].output_token_ids == recomputed[cid].output_token_ids, cid
        assert job.output_text == computed[cid].output_text
        assert job.cached_timings["id"] == computed[cid].id  # the run that computed it, kept apart
        assert job.cached_timings["ttft_s"] == computed[cid].ttft_s
        if kind == "structured":
            assert set(json.loads(job.output_text)) == {"answer", "sure"}
    stats = served["client"].store.cache_stats()
    assert stats["entries"] >= len(rows) and stats["hits"] >= len(rows)


def test_an_unseeded_sampled_job_is_never_served_from_the_cache(served):
    rows = [{"custom_id": f"u-{i}", "prompt": f"sample {i}", "temperature": 1.0, "max_tokens": 8} for i in range(6)]
    rows.append(dict(rows[0], custom_id="u-again"))  # the same request twice: two samples, not one
    _, first = submit(served, rows)
    second_sub, second = submit(served, rows)
    assert second_sub.ingest.cached == 0 and second_sub.ingest.duplicates == 0
    for job in list(first.values()) + list(second.values()):
        assert job.request_digest is None and not job.cached and job.duplicate_of is None and job.attempts == 1
    seeds = {j.params["seed"] for j in first.values()} | {j.params["seed"] for j in second.values()}
    assert len(seeds) == 2 * len(rows)  # each a fresh seed: a new sample every time


def test_a_changed_weight_file_misses(served, tmp_path):
    """The cache is keyed by the model's content: the same files elsewhere hit; one weight file
    written anew misses."""
    from safetensors.torch import load_file, save_file
    from worker.api.client import Client
    from worker.request.validate import TokenCounter

    rows = rows_of("greedy", "weights")
    submit(served, rows)  # computed by the module's worker, cached
    copy = tmp_path / "copy"
    shutil.copytree(served["model"], copy)
    client = Client(broker_url=served["redis"], database_url=served["db"], model=str(copy),
                    queue=f"gen.none-{uuid.uuid4().hex[:8]}")  # nobody serves it: a miss stays queued
    counter = TokenCounter(str(copy))
    same = client.submit_batch(rows, name=f"copy-{uuid.uuid4().hex[:8]}", count_tokens=counter,
                               max_model_len=counter.max_model_len)
    assert same.ingest.cached == len(rows)
    weights = next(copy.glob("*.safetensors"))
    tensors = load_file(str(weights))
    name = next(iter(tensors))
    tensors[name] = tensors[name] + 1e-3
    save_file(tensors, str(weights), metadata={"format": "pt"})
    changed = client.submit_batch(rows, name=f"changed-{uuid.uuid4().hex[:8]}", count_tokens=counter,
                                  max_model_len=counter.max_model_len)
    assert changed.ingest.cached == 0 and changed.ingest.enqueued == len(rows)
    assert {j.status for j in client.store.jobs(changed.batch_id)} == {QUEUED}
    client.cancel(changed.batch_id)


def test_tenants_salts_keep_their_results_apart(served):
    rows = [dict(r, cache_salt="tenant-a") for r in rows_of("greedy", "salted")]
    submit(served, rows)
    other, _ = submit(served, [dict(r, cache_salt="tenant-b") for r in rows])
    assert other.ingest.cached == 0
    same, _ = submit(served, rows)
    assert same.ingest.cached == len(rows)


def test_duplicate_rows_run_once_and_each_row_gets_its_own_output_line(served, tmp_path):
    """A file asking some questions twice (or three times) through ``specbatch run``: each
    distinct request is claimed once, every line gets its own output line with the same answer."""
    base = rows_of("greedy", "dup")[:6]
    lines = base + [dict(base[i], custom_id=f"dup-copy-{i}-{k}") for i in (0, 2, 5) for k in range(1 + (i == 5))]
    src = tmp_path / "dups.jsonl"
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    env = {"PYTHONPATH": str(ROOT), "SPECBATCH_QUEUE": served["queue"], "PATH": "/usr/bin:/bin"}
    res = subprocess.run([sys.executable, "-m", "worker.api.cli", "--broker-url", served["redis"], "--database-url",
                          served["db"], "run", str(src), "--model", served["model"], "--no-local-worker",
                          "--timeout", "120"], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, res.stderr[-3000:] + res.stdout[-3000:]
    assert "run once for an earlier line asking the same 4" in " ".join((res.stdout + res.stderr).split())
    out = [json.loads(x) for x in (tmp_path / "dups.out.jsonl").read_text().splitlines()]
    assert [o["custom_id"] for o in out] == [line["custom_id"] for line in lines]  # one line each, in order
    by_id = {o["custom_id"]: o for o in out}
    for o in out:
        if o["custom_id"].startswith("dup-copy-"):
            i = int(o["custom_id"].split("-")[2])
            first = by_id[f"dup-{i}"]
            assert o["response"]["body"]["choices"] == first["response"]["body"]["choices"]
            assert o["specbatch"]["duplicate_of"] == first["specbatch"]["job_id"] and o["specbatch"]["attempts"] == 0
        else:
            assert o["specbatch"]["duplicate_of"] is None and o["specbatch"]["attempts"] == 1
    claimed = [o for o in out if o["specbatch"]["worker"] is not None]
    assert len(claimed) == len(base)  # computed once each


def test_a_duplicate_whose_first_row_ended_elsewhere_is_settled_by_the_sweep(db_url, redis_url, unique_queue,
                                                                            tiny_model_dir):
    """A first row cancelled by its job id (a path that knows nothing of copies) leaves its
    duplicates queued; the reaper's sweep (``settle_stray_duplicates``) settles them with it.

    The sweep is called here on a database of the test's own, with no worker: a worker's reaper
    sweeps every ``SWEEP_SECONDS`` and would settle the copy at a moment of its choosing."""
    from sqlalchemy import update as sql_update

    from worker.api.client import Client
    from worker.request.validate import TokenCounter
    from worker.store.models import Job

    from worker.store.store import Store

    Store(db_url, auto_upgrade=True)
    client = Client(broker_url=redis_url, database_url=db_url, model=tiny_model_dir, queue=unique_queue)
    counter = TokenCounter(tiny_model_dir)
    rows = rows_of("greedy", "stray")[:2]
    rows.append(dict(rows[0], custom_id="stray-copy"))
    sub = client.submit_batch(rows, name="stray", count_tokens=counter, max_model_len=counter.max_model_len)
    jobs = {j.custom_id: j for j in client.store.jobs(sub.batch_id)}
    assert jobs["stray-copy"].duplicate_of == jobs["stray-0"].id and jobs["stray-copy"].status == QUEUED
    assert client.store.settle_stray_duplicates() == 0  # its first row is still queued: nothing to settle
    client.store.cancel(job_ids=[jobs["stray-0"].id])
    assert client.store.get_job(jobs["stray-0"].id).status == "cancelled"
    assert client.store.get_job(jobs["stray-copy"].id).status == QUEUED  # the cancel did not know of it
    assert client.store.settle_stray_duplicates() == 1
    assert client.store.get_job(jobs["stray-copy"].id).status == "cancelled"
    assert client.store.get_job(jobs["stray-1"].id).status == QUEUED  # a row of its own: untouched

    # A duplicate naming a row the store does not hold (a hand edit, a bug) runs on its own.
    with client.store.engine.begin() as conn:
        conn.execute(sql_update(Job).where(Job.id == jobs["stray-1"].id)
                     .values(duplicate_of="no-such-job", published_at=1.0))
    assert client.store.settle_stray_duplicates() == 1
    moved = client.store.get_job(jobs["stray-1"].id)
    assert moved.duplicate_of is None and moved.published_at is None  # the pacer's to publish now
    assert moved.status == QUEUED


def test_the_cache_is_held_to_its_bound_least_recently_used_first_and_can_be_cleared(served):
    store = served["client"].store
    store.clear_cache()  # only this test's entries from here on (the module's tests run one at a time)
    submit(served, rows_of("greedy", "evict-old"))
    submit(served, rows_of("greedy", "evict-new"))
    submit(served, rows_of("greedy", "evict-old"))  # a hit: the old ones are the most recently used now
    stats = store.cache_stats()
    per_entry = stats["bytes"] / stats["entries"]
    evicted = store.evict_cache(int(stats["bytes"] - 5 * per_entry))
    assert evicted >= 5
    again_new, _ = submit(served, rows_of("greedy", "evict-new"))
    again_old, _ = submit(served, rows_of("greedy", "evict-old"))
    assert again_old.ingest.cached == len(QUESTIONS)  # recently used: kept
    assert again_new.ingest.cached < len(QUESTIONS)  # least recently used: went first
    res = subprocess.run([sys.executable, "-m", "worker.api.cli", "--database-url", served["db"], "cache", "stats"],
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0 and res.stdout.startswith("result cache: 24 entries"), res.stderr  # the answer, on stdout
    res = subprocess.run([sys.executable, "-m", "worker.api.cli", "--database-url", served["db"], "cache", "clear"],
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0 and "dropped 24 cached result(s)" in res.stderr, res.stderr  # said to the terminal
    assert store.cache_stats()["entries"] == 0
    cleared, _ = submit(served, rows_of("greedy", "evict-old"))
    assert cleared.ingest.cached == 0


def test_the_pacer_publishes_rows_behind_one_system_prompt_together(served):
    """Shuffled rows behind three long system prompts, and rows that share nothing: the pacer
    hands out each system prompt's rows together; rows that share nothing keep line order."""
    import random

    systems = [f"System {k}: " + " ".join(f"rule {k}.{i} is to be kind." for i in range(12)) for k in range(3)]
    rows = [{"custom_id": f"s{k}-{i}", "messages": [{"role": "system", "content": systems[k]},
                                                    {"role": "user", "content": f"question {i}"}],
             "max_tokens": 4} for k in range(3) for i in range(8)]
    random.Random(7).shuffle(rows)
    rows += [{"custom_id": f"plain-{i}", "prompt": f"unrelated prompt number {i}", "max_tokens": 4} for i in range(6)]
    client = served["client"]
    sub = client.submit_batch(rows, name=f"pace-{uuid.uuid4().hex[:8]}", count_tokens=served["counter"],
                              max_model_len=served["counter"].max_model_len, max_in_flight=1)
    # What the pacer takes next, all of it (the one in flight was taken by the producer's tick).
    store = client.store
    taken = store.take_unpublished(sub.batch_id, served["queue"], 1000)
    order = [r["custom_id"] for r in taken]
    groups = [cid.split("-")[0] for cid in order if cid.startswith("s")]
    changes = sum(1 for a, b in zip(groups, groups[1:]) if a != b)
    assert changes <= 2, order  # three runs: one per system prompt
    plain = [cid for cid in order if cid.startswith("plain")]
    assert plain == sorted(plain, key=lambda c: int(c.split("-")[1])), order
    client.publish(taken)
    counts = client.wait(sub.batch_id, timeout=120)
    assert counts["succeeded"] == len(rows)


def test_a_single_job_is_answered_from_the_cache_unless_asked_not_to(served):
    client = served["client"]
    params = {"temperature": 0, "max_tokens": 8}
    first = client.submit("a single greedy question", params=params)
    assert client.wait(first, timeout=60) == SUCCEEDED
    computed = client.store.get_job(first)
    assert computed.request_digest and computed.attempts == 1 and not computed.cached
    second = client.store.get_job(client.submit("a single greedy question", params=params))
    assert second.status == SUCCEEDED and second.cached and second.attempts == 0
    assert second.output_token_ids == computed.output_token_ids and second.cached_timings["id"] == computed.id
    fresh_id = client.submit("a single greedy question", params=params, cache=False)
    assert client.wait(fresh_id, timeout=60) == SUCCEEDED
    fresh = client.store.get_job(fresh_id)
    assert not fresh.cached and fresh.attempts == 1 and fresh.output_token_ids == computed.output_token_ids


def test_duplicates_held_for_their_first_row_do_not_fill_the_in_flight_cap(served):
    """Five copies of one row under ``max_in_flight=2``: held copies are not in flight (counted,
    they filled the cap and the row they wait for was never published)."""
    base = rows_of("greedy", "capped")[:2]
    rows = base + [dict(base[0], custom_id=f"capped-copy-{k}") for k in range(5)]
    sub, jobs = submit(served, rows, max_in_flight=2)
    assert sub.ingest.duplicates == 5
    assert {jobs[f"capped-copy-{k}"].output_token_ids == jobs["capped-0"].output_token_ids for k in range(5)} == {True}


def test_a_rerun_that_adds_a_duplicate_of_a_stored_row_is_answered_by_it(served, tmp_path):
    """A batch reopened by name (a rerun of a grown file): a new line asking what a stored line
    asks is held for that row (its stored id, not the id the rerun drew for it) and settled."""
    rows = rows_of("greedy", "grown")[:3]
    name = f"grown-{uuid.uuid4().hex[:8]}"
    client = served["client"]
    kwargs = dict(name=name, count_tokens=served["counter"], max_model_len=served["counter"].max_model_len, cache=True)
    first = client.submit_batch(rows, **kwargs)
    client.wait(first.batch_id, timeout=60)
    client.store.clear_cache()  # so the new line is merged with its stored twin, not answered from the cache
    grown = rows + [dict(rows[1], custom_id="grown-again")]
    again = client.submit_batch(grown, **kwargs)
    assert again.batch_id == first.batch_id and again.ingest.duplicates == 1
    counts = client.wait(first.batch_id, timeout=60)
    assert counts["succeeded"] == 4, counts
    jobs = {j.custom_id: j for j in client.store.jobs(first.batch_id)}
    assert jobs["grown-again"].duplicate_of == jobs["grown-1"].id
    assert jobs["grown-again"].output_token_ids == jobs["grown-1"].output_token_ids
