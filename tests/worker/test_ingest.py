"""Streaming ingest on real SQLite/PostgreSQL and Redis: a file goes in chunk by chunk, its first
jobs are published before the last chunk is read, duplicates are caught across chunks in
bounded memory, a batch is never finished between chunks, and a run killed half-way resumes
with every line exactly once."""

from __future__ import annotations

import json

import numpy as np
import pytest
import redis

from worker.ingest import stream as ingest_module
from worker.api.client import Client
from worker.ingest.stream import Ingest, SeenIds
from worker.dispatch.lanes import lane_queues
from worker.store.models import FAILED, QUEUED, SUCCEEDED
from worker.dispatch.pacer import Pacer
from worker.store.rows import INVALID_INPUT
from worker.store.store import Store

from tests.worker.test_lanes import producer  # noqa: F401  (fixture: a client with a 20-message pacing window)




def _ingest(client: Client, chunk: int, **kw) -> Ingest:
    return Ingest(client.store, model=client.model, queue_for=client.queue_for, priority=1,
                  pace=lambda: client.pace(), chunk=chunk, **kw)


def _lines(n: int, dup_every: int = 0) -> list[str]:
    out = []
    for i in range(1, n + 1):
        cid = f"c{i - dup_every + 1}" if dup_every and i % dup_every == 0 else f"c{i}"
        out.append(json.dumps({"custom_id": cid, "prompt": f"p{i}", "max_tokens": 1}))
    return out


def _finish_all(store: Store, batch_id: str) -> None:
    for job in store.jobs(batch_id, statuses=[QUEUED]):
        attempt = store.claim(job.id, worker="w", device="cpu", lease_s=60, max_attempts=3).attempt
        store.finish(job.id, attempt, {"status": SUCCEEDED, "finished_at": 1.0})


def test_chunks_give_the_same_jobs_as_one_pass_and_catch_duplicates_across_chunks(producer):
    lines = _lines(50, dup_every=9) + ["{not json", json.dumps({"custom_id": "c3", "prompt": ""})]
    result = _ingest(producer, chunk=7).run(lines, name="b", input_file=None)
    jobs = {j.line_no: j for j in producer.store.jobs(result.batch_id)}
    assert len(jobs) == 52 and result.num_lines == 52
    dups = [n for n in range(9, 51, 9)]  # line n repeats the id of line n - 8 (mostly in an earlier chunk)
    assert result.num_bad == len(dups) + 2 and result.num_good == 50 - len(dups)
    for n in dups:
        assert jobs[n].status == FAILED and jobs[n].error_type == INVALID_INPUT
        assert jobs[n].error == f"line {n}: duplicate custom_id 'c{n - 8}' (first on line {n - 8})"
        assert jobs[n].custom_id is None
    assert jobs[51].error.startswith("line 51: malformed JSON")
    # A bad line whose id was taken keeps the line but not the id: (batch, custom_id) stays unique.
    assert jobs[52].status == FAILED and jobs[52].custom_id is None
    assert [b.line_no for b in result.bad_lines] == sorted(dups + [51, 52])
    assert producer.store.get_batch(result.batch_id).ingested_at is not None


def test_hash_collisions_are_not_duplicates(producer, monkeypatch):
    """Every id hashes alike: only a confirmed match in the store makes a line a duplicate."""
    monkeypatch.setattr(ingest_module, "_hash", lambda custom_id: 7)
    lines = _lines(30) + [json.dumps({"custom_id": "c4", "prompt": "again"})]
    result = _ingest(producer, chunk=4).run(lines, name="b", input_file=None)
    assert result.num_good == 30 and result.num_bad == 1
    assert result.bad_lines[0].message == "line 31: duplicate custom_id 'c4' (first on line 4)"


def test_seen_ids_find_every_hash_added_in_bounded_memory():
    seen = SeenIds()
    rng = np.random.default_rng(0)
    added = rng.permutation(np.arange(10_000, dtype=np.int64) * 7919 - 5_000 * 7919)  # negatives too
    for start in range(0, 10_000, 1000):
        hashes = added[start:start + 1000]
        assert not seen.lookup(hashes).any()
        seen.add(hashes)
        assert seen.lookup(added[:start + 1000]).all()
    assert seen.nbytes == 8 * 10_000 and len(seen._runs) <= 4
    assert all((np.diff(run) >= 0).all() for run in seen._runs)
    found = seen.lookup(np.array([0, 5 * 7919, 4999 * 7919, 3, 2**62, -2**62], dtype=np.int64))
    assert found.tolist() == [True, True, True, False, False, False]


def test_first_jobs_are_published_while_the_file_is_still_read(producer, redis_url, unique_queue):
    r = redis.Redis.from_url(redis_url)
    seen: list[tuple[int, int]] = []

    def on_chunk(result):
        seen.append((result.num_lines, r.llen(unique_queue)))

    producer.submit_batch(_lines(1500), name="b", on_chunk=on_chunk)  # more than the first chunk
    lines_read, waiting = seen[0]
    assert lines_read < 1500 and waiting > 0  # published after the first chunk, not after the file


def test_a_batch_is_not_finished_between_chunks_and_a_killed_ingest_resumes(producer):
    class Killed(Exception):
        pass

    def die_after_two(result):
        if result.num_lines >= 10:
            raise Killed

    lines = _lines(25) + ["[1, 2]"]
    with pytest.raises(Killed):
        _ingest(producer, chunk=5, on_chunk=die_after_two).run(lines, name="half", input_file=None)
    store = producer.store
    batch = store.get_batch("half")
    assert batch.ingested_at is None and store.batch_counts(batch.id)[QUEUED] == 10
    _finish_all(store, batch.id)  # its workers run dry before the rest of the file arrives
    store.refresh_batch(batch.id)
    Pacer(store, producer.app, lane_queues(producer.settings.queue)).close_drained()
    assert store.get_batch(batch.id).finished_at is None
    assert batch.id in [b for b, _ in store.open_batches()]
    assert producer._poll_done(batch.id) is None  # Client.wait keeps waiting

    # The rerun writes the rest: every line exactly once, what succeeded is not run again.
    again = _ingest(producer, chunk=5).run(lines, name="half", input_file=None)
    assert again.batch_id == batch.id
    assert again.skipped_succeeded == 10 and again.enqueued == 15 and again.num_bad == 1
    jobs = store.jobs(batch.id)
    assert sorted(j.line_no for j in jobs) == list(range(1, 27))
    assert store.get_batch(batch.id).ingested_at is not None
    _finish_all(store, batch.id)
    assert producer._poll_done(batch.id) == {"queued": 0, "running": 0, "succeeded": 25, "failed": 1,
                                             "cancelled": 0}
    assert store.get_batch(batch.id).finished_at is not None


def test_iter_results_reads_rows_only_as_they_finish_in_input_order(producer):
    sub = producer.submit_batch(_lines(12) + ["oops"], name="b")
    store = producer.store
    ids = [j.id for j in store.jobs(sub.batch_id)]
    prefix = store.finished_prefix(sub.batch_id, None)
    assert prefix == []  # line 1 is still queued: nothing can be written in order yet
    _finish_all(store, sub.batch_id)
    lines = list(producer.iter_results(sub.batch_id, timeout=10))
    assert [l["specbatch"]["job_id"] for l in lines] == ids
    assert [l["specbatch"]["line"] for l in lines] == list(range(1, 14))
    assert producer.results(sub.batch_id) == lines


def test_token_counts_in_one_batch_equal_one_by_one(tiny_model_dir):
    from worker.request.formats import parse_line
    from worker.request.validate import TokenCounter

    counter = TokenCounter(tiny_model_dir)
    raw = [{"prompt": "hello there"}, {"messages": [{"role": "system", "content": "be brief"},
                                                    {"role": "user", "content": "hi é"}]},
           {"prompt": [1, 2, 3]}, {"prompt": [1, 2, 10**6]}, {"prompt": "x " * 300}]
    reqs = [parse_line(json.dumps(r), n) for n, r in enumerate(raw, start=1)]
    many = counter.tokenize_many(reqs)
    one = [counter._one(r) for r in reqs]
    assert [repr(x) for x in many] == [repr(x) for x in one]
    assert [repr(x) for x in counter.count_many(reqs)] == [repr(x if isinstance(x, Exception) else len(x)) for x in many]
    assert isinstance(many[3], ValueError) and len(many[4]) > 300


def test_a_prompt_the_producer_tokenized_reaches_the_engine_as_its_ids_and_is_not_tokenized_again(
        producer, smollm2_dir, smol_llm, tmp_path):
    """A prompt whose length had to be counted (too many bytes to be proven to fit) is stored
    with the producer's token ids; the claim hands the engine those ids, equal to what the engine
    would make of the text or conversation itself. A prompt proven to fit travels as its text
    and is tokenized once, by the worker process (``runtime.prompt_tokenizer``, a message's jobs
    in one call), into the engine's own ids. (A greedy or seeded prompt is tokenized at ingest
    whatever its length: its result cache key is over its tokens; ``tests/worker/test_bulk_once.py``.)"""
    from worker.request.convert import request_from_row
    from worker.request.validate import TokenCounter
    from worker.run.runtime import prompt_tokenizer
    from worker.run.tasks import tokenized

    long_text = "The quick brown fox jumps over the lazy dog. " * 8  # 360 bytes, under 128 tokens
    chat = [{"role": "system", "content": "Answer in one word. " * 6}, {"role": "user", "content": long_text}]
    lines = [{"custom_id": "short", "prompt": "hi"}, {"custom_id": "text", "prompt": long_text},
             {"custom_id": "chat", "messages": chat}, {"custom_id": "ids", "prompt": [5, 6, 7]}]
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    result = _ingest(producer, chunk=10, parse_in_child=False, count_tokens=TokenCounter(smollm2_dir),
                     max_model_len=128).run(src, name="tokens", input_file=None)
    assert (result.num_good, result.num_bad) == (4, 0)
    engine = smol_llm.engine
    expected = {"short": None, "text": engine.make_request(long_text).prompt_token_ids,
                "chat": engine.make_request(messages=chat).prompt_token_ids, "ids": None}
    for job in producer.store.jobs(result.batch_id):
        claim = producer.store.claim(job.id, worker="w", device="cpu", lease_s=60, max_attempts=3)
        assert claim.job["prompt_tokens"] == expected[job.custom_id], job.custom_id
        request = request_from_row(claim.job)
        if expected[job.custom_id] is not None:
            assert request.prompt == expected[job.custom_id] and request.messages is None
            made = engine.make_request(request.prompt, params=request.params)
            assert made.prompt_token_ids == expected[job.custom_id]
        else:
            assert request.prompt == {"short": "hi", "ids": [5, 6, 7]}[job.custom_id]
        (_, sent), = tokenized(prompt_tokenizer(smollm2_dir), [(0, request)])
        as_given = {"short": engine.make_request("hi").prompt_token_ids, "ids": [5, 6, 7]}
        assert sent.messages is None and sent.prompt == (expected[job.custom_id] or as_given[job.custom_id])


def test_the_worker_tokenizes_a_message_s_prompts_into_the_engine_s_ids(tiny_model_dir, tmp_path):
    """What the worker process sends its engine: text prompts and conversations as the engine's
    own token ids, all of a message's in one call; token ids as they came; what the tokenizer
    cannot take (an empty prompt, a conversation the template refuses) as it came, for the
    engine to refuse in its own words. No tokenizer where loading it would import torch (a
    model's own tokenizer class) or where the model is not a local folder: the engine tokenizes."""
    import shutil

    from engine import LLM, SamplingParams
    from worker.request.convert import WorkRequest
    from worker.run.runtime import prompt_tokenizer
    from worker.run.tasks import tokenized

    counter = prompt_tokenizer(tiny_model_dir)
    params = SamplingParams(max_tokens=1)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Is it fine? é"}]
    refused = [{"role": "user", "content": "a"}, {"role": "user", "content": 3}]
    given = [WorkRequest("hello there", None, params), WorkRequest(None, chat, params), WorkRequest([5, 6], None, params),
             WorkRequest("", None, params), WorkRequest(None, refused, params)]
    sent = [req for _, req in tokenized(counter, list(enumerate(given)))]
    engine = LLM(tiny_model_dir, device="cpu", max_num_seqs=4).engine
    assert sent[0].prompt == engine.make_request("hello there").prompt_token_ids and sent[0].messages is None
    assert sent[1].prompt == engine.make_request(messages=chat).prompt_token_ids and sent[1].messages is None
    assert sent[2:] == given[2:]
    with pytest.raises(ValueError):
        engine.make_request(messages=refused)
    assert tokenized(None, list(enumerate(given))) == list(enumerate(given))

    own_class = tmp_path / "own-class"
    shutil.copytree(tiny_model_dir, own_class)
    config = json.loads((own_class / "tokenizer_config.json").read_text())
    (own_class / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "LlamaTokenizer"}))
    assert prompt_tokenizer(str(own_class)) is None
    assert prompt_tokenizer("an-org/a-model-on-the-hub") is None


def test_a_logit_bias_that_leaves_no_token_is_refused_at_validation(producer, tiny_model_dir, tmp_path):
    """Nothing but garbage can come of it: it fails at validation naming the line (never queued),
    as does a bias naming a token past the vocabulary; a bias that leaves one token runs."""
    from worker.request.validate import TokenCounter

    counter = TokenCounter(tiny_model_dir)
    vocab = counter.vocab_size
    lines = [{"custom_id": "all", "prompt": "a", "logit_bias": {str(t): -100 for t in range(vocab)}},
             {"custom_id": "past", "prompt": "b", "logit_bias": {str(vocab): 5}},
             {"custom_id": "one", "prompt": "c", "logit_bias": {str(t): -100 for t in range(1, vocab)}}]
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    result = _ingest(producer, chunk=10, parse_in_child=False, count_tokens=counter,
                     max_model_len=64).run(src, name="bias", input_file=None)
    jobs = {j.custom_id: j for j in producer.store.jobs(result.batch_id)}
    assert jobs["all"].status == FAILED and jobs["all"].error.startswith("line 1: logit_bias bans every token")
    assert jobs["past"].status == FAILED and f"token id {vocab} is outside the vocabulary" in jobs["past"].error
    assert jobs["one"].status == QUEUED and (result.num_good, result.num_bad) == (1, 2)


def test_a_chunk_written_twice_keeps_one_row_each(db_url):
    """PostgreSQL writes a new batch's rows with COPY; rows that exist already make it fall back
    to the upsert, which skips them (SQLite upserts always)."""
    from worker.store.rows import job_row

    store = Store(db_url, auto_upgrade=True)
    batch_id, _ = store.open_batch(name="twice", input_file=None, model="m")
    rows = [job_row(model="m", prompt=f"p{i}\x00", custom_id=f"c{i}", line_no=i, messages=None) for i in (1, 2)]
    bad = [job_row(model="m", line_no=3, error="line 3: malformed JSON")]
    for _ in range(2):
        store.write_chunk(batch_id, rows, bad, reopened=False)
    jobs = store.jobs(batch_id)
    assert [(j.line_no, j.prompt, j.params) for j in jobs] == [(1, "p1\x00", {}), (2, "p2\x00", {}),
                                                              (3, None, {})]


def _mixed_lines(n: int) -> list[str]:
    """Prompts and chats, duplicates near and across chunks (of good, bad and too-long lines),
    bad lines with and without an id, prompts over a small context, blank lines, another model."""
    out = []
    for i in range(1, n + 1):
        cid = f"c{i - 60}" if i > 60 and i % 37 == 0 else f"c{i - 1}" if i % 101 == 0 else f"c{i}"
        if i % 23 == 0:
            out.append(json.dumps({"custom_id": cid, "prompt": "word " * 40}))
        elif i % 29 == 0:
            out.append(json.dumps({"custom_id": cid, "prompt": "p", "temperature": 9}))
        elif i % 31 == 0:
            out.append("{broken")
        elif i % 41 == 0:
            out.append(json.dumps({"custom_id": cid, "prompt": "p", "model": "gpt-9-ultra"}))
        elif i % 43 == 0:
            out.append("   ")
        elif i % 2:
            out.append(json.dumps({"custom_id": cid, "messages": [{"role": "user", "content": f"hi {i}"}],
                                   "max_tokens": i % 7 + 1, "priority": "interactive" if i % 5 == 0 else None}))
        else:
            out.append(json.dumps({"custom_id": cid, "prompt": f"p{i}", "temperature": 0.5, "user": f"u{i % 3}"}))
    return out


def _child_started(ingest: Ingest) -> None:
    """Hold the writer until the child says it is ready (a few seconds: this file takes the
    parent less), so the hand-over happens early in the file."""
    import select

    if ingest.parser is not None:
        assert select.select([ingest.parser.proc.stdout], [], [], 60)[0], "the parsing process never got ready"


def test_a_file_parsed_in_a_child_process_gives_the_jobs_parsed_in_process(producer, tiny_model_dir, tmp_path):
    """Once the child (``worker.ingest.parse_process``) is ready it parses the rest of the file: rows,
    errors, duplicates (across the hand-over too) and context checks are the same as parsed here."""
    from worker.request.validate import TokenCounter

    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(_mixed_lines(700)) + "\n")
    counter = TokenCounter(tiny_model_dir)
    kw = dict(count_tokens=counter, max_model_len=24, first_chunk=50)
    child = _ingest(producer, chunk=100, child_min_bytes=0, on_chunk=lambda result: _child_started(ingest), **kw)
    ingest = child
    child = child.run(src, name="child", input_file=None)
    here = _ingest(producer, chunk=100, parse_in_child=False, **kw).run(src, name="here", input_file=None)
    assert 400 < child.parsed_in_child < 700 and here.parsed_in_child == 0

    def jobs(batch_id):
        out = {}
        for j in producer.store.jobs(batch_id):
            params = dict(j.params)
            assert j.status == FAILED or isinstance(params.pop("seed"), int)
            out[j.line_no] = (j.custom_id, j.status, j.error, j.error_type, j.endpoint, j.prompt, j.messages, params,
                              j.queue, j.priority, j.user)
        return out

    got, want = jobs(child.batch_id), jobs(here.batch_id)
    assert got == want
    assert len(got) == 700 - len(range(43, 701, 43))
    errors = [e for (_, status, e, *_rest) in got.values() if status == FAILED]
    for kind in ("duplicate custom_id", "over the model's context", "malformed JSON", "temperature", "gpt-9-ultra"):
        assert any(kind in e for e in errors), kind
    assert (child.num_good, child.num_bad) == (here.num_good, here.num_bad)
    assert [(b.line_no, b.error) for b in child.bad_lines] == [(b.line_no, b.error) for b in here.bad_lines]


def test_a_table_parsed_in_a_child_process_gives_the_jobs_parsed_in_process(producer, tiny_model_dir, tmp_path):
    """A Parquet table's rows go through the same hand-over: the child builds the rest with the
    same recipe (template, id column, per-row sampling columns), errors and duplicates alike."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from worker.ingest.tables import Table
    from worker.request.table_rows import RowRecipe
    from worker.request.validate import TokenCounter

    n = 700
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({
        "key": [f"k{i - 1}" if i % 101 == 0 else f"k{i}" for i in range(1, n + 1)],  # duplicates
        "topic": [None if i % 31 == 0 else "word " * (40 if i % 23 == 0 else 1) for i in range(1, n + 1)],
        "max_tokens": pa.array([-1 if i % 29 == 0 else i % 7 + 1 for i in range(1, n + 1)], pa.int64()),
    }), src, row_group_size=64)
    recipe = RowRecipe(template="About {{ topic }}", id_column="key", params={"temperature": 0.5})
    kw = dict(count_tokens=TokenCounter(tiny_model_dir), max_model_len=24, first_chunk=50, recipe=recipe)
    child = _ingest(producer, chunk=100, child_min_bytes=0, on_chunk=lambda result: _child_started(ingest), **kw)
    ingest = child
    child = child.run(Table(src), name="child", input_file=None)
    here = _ingest(producer, chunk=100, parse_in_child=False, **kw).run(Table(src), name="here", input_file=None)
    assert 400 < child.parsed_in_child < n and here.parsed_in_child == 0

    def jobs(batch_id):
        out = {}
        for j in producer.store.jobs(batch_id):
            params = dict(j.params)
            assert j.status == FAILED or isinstance(params.pop("seed"), int)
            out[j.line_no] = (j.custom_id, j.status, j.error, j.messages, params, j.prompt_tokens)
        return out

    got, want = jobs(child.batch_id), jobs(here.batch_id)
    assert got == want and len(got) == n
    errors = [e for (_, status, e, *_rest) in got.values() if status == FAILED]
    for kind in ("duplicate custom_id", "over the model's context", "max_tokens must be at least 1", "undefined"):
        assert any(kind in e for e in errors), kind


def test_a_parsing_process_killed_before_it_is_ready_leaves_the_file_to_the_parent(producer, tmp_path, caplog):
    """SIGKILL to the child while it starts: the parent parses the whole file itself, says so."""
    import signal

    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(_lines(900)) + "\n")

    def kill_child(result):
        if ingest.parser is not None and ingest.parser.proc.poll() is None:
            ingest.parser.proc.send_signal(signal.SIGKILL)
            ingest.parser.proc.wait()

    ingest = _ingest(producer, chunk=100, first_chunk=50, child_min_bytes=0, on_chunk=kill_child)
    with caplog.at_level("WARNING", logger="worker.ingest.stream"):
        result = ingest.run(src, name="b", input_file=None)
    assert result.parsed_in_child == 0 and result.num_good == 900
    assert "the parsing process died (killed by signal 9)" in caplog.text
    assert sorted(j.line_no for j in producer.store.jobs(result.batch_id)) == list(range(1, 901))


def test_a_parsing_process_killed_mid_file_fails_the_ingest_and_a_rerun_resumes(producer, tmp_path):
    """SIGKILL to the child once it streams: the ingest fails naming it (never a silent short
    batch), the batch stays open, and the rerun writes the rest, every line once."""
    import signal

    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(_lines(3000)) + "\n")

    def kill_once_streaming(result):
        _child_started(ingest)
        if result.parsed_in_child and ingest.parser.proc.poll() is None:
            ingest.parser.proc.send_signal(signal.SIGKILL)

    ingest = _ingest(producer, chunk=100, first_chunk=50, child_min_bytes=0, on_chunk=kill_once_streaming)
    with pytest.raises(RuntimeError, match=r"the parsing process died: killed by signal 9"):
        ingest.run(src, name="b", input_file=None)
    batch = producer.store.get_batch("b")
    assert batch.ingested_at is None and 0 < sum(producer.store.batch_counts(batch.id).values()) < 3000
    again = _ingest(producer, chunk=100).run(src, name="b", input_file=None)
    assert again.batch_id == batch.id
    assert sorted(j.line_no for j in producer.store.jobs(batch.id)) == list(range(1, 3001))
