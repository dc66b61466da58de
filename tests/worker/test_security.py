"""Hostile input and the transport: JSON-only messages (a real pickled message is refused),
hostile ids and prompts stored and returned intact on SQLite and PostgreSQL, Redis with a
password and with TLS through the real Client, and no password ever printed."""

from __future__ import annotations

import json
import logging
import os
import pickle
import threading
import time
import uuid
from pathlib import Path

import pytest
import redis
from kombu import Connection, Exchange, Queue

from tests.worker.redis_servers import free_port, make_certs, redis_binary, redis_server
from worker.dispatch.app import make_app
from worker.api.client import Client
from worker.request.formats import output_line, write_jsonl
from worker.store.models import Job
from worker.store.store import Store

pytestmark = pytest.mark.integration

HOSTILE_IDS = [
    "'; DROP TABLE jobs; --",
    "Robert'); DELETE FROM batches WHERE ('1'='1",
    "nul\x00inside",
    "\x00",
    "\ufdd0starts with the escape marker",
    "a backslash-zero \\0 that is not a NUL \\",
    "\x1b[31mred\x07\x08\r\n\t",
    "unicode ☃ 𝔘",
]


def _hostile_prompt(size: int = 10 * 1024 * 1024) -> str:
    unit = "SELECT * FROM jobs; -- \x00\x01\x1b[2J'\"\\0 ☃\n"
    return (unit * (size // len(unit) + 1))[:size]


# ---- hostile text through the store and the output writer --------------------------------
def test_hostile_ids_and_prompts_round_trip(db_url, redis_url, unique_queue, tmp_path):
    store = Store(db_url, auto_upgrade=True)
    client = Client(broker_url=redis_url, database_url=db_url, model="tiny", queue=unique_queue, store=store)
    big = _hostile_prompt()
    lines = [json.dumps({"custom_id": cid, "prompt": f"prompt of {cid}"}) for cid in HOSTILE_IDS]
    lines.append(json.dumps({"custom_id": "big", "url": "/v1/completions", "body": {"prompt": big, "max_tokens": 1}}))
    src = tmp_path / "hostile.jsonl"
    src.write_text("\n".join(lines) + "\n", encoding="utf-8")
    try:
        sub = client.submit_batch(src, name="x\x00'; DROP TABLE batches; --")
        assert not sub.bad_lines and sub.published == len(lines)
        # What a worker writes back: the prompt echoed (NUL and all), and an error for one job.
        for job in store.jobs(sub.batch_id):
            attempt = store.claim(job.id, worker="w", device="cpu", lease_s=60, max_attempts=3).attempt
            if job.custom_id == HOSTILE_IDS[0]:
                assert store.fail(job.id, attempt, f"error about {job.custom_id}\x00")
            else:
                assert store.finish(job.id, attempt, {"status": "succeeded", "output_text": job.prompt,
                                                       "finish_reason": "length", "finished_at": time.time()})
        jobs = {j.custom_id: j for j in Store(db_url).jobs(sub.batch_id)}  # a fresh Store: read from the database
        assert set(jobs) == {*HOSTILE_IDS, "big"}
        assert jobs["big"].prompt == big and jobs["big"].output_text == big
        for cid in HOSTILE_IDS[1:]:
            assert jobs[cid].prompt == jobs[cid].output_text == f"prompt of {cid}"
        assert jobs[HOSTILE_IDS[0]].error == f"error about {HOSTILE_IDS[0]}\x00"
        assert store.get_batch("x\x00'; DROP TABLE batches; --").id == sub.batch_id

        out = tmp_path / "out.jsonl"
        write_jsonl(out, (output_line(j) for j in store.jobs(sub.batch_id)))
        rows = {r["custom_id"]: r for r in map(json.loads, out.read_text(encoding="utf-8").splitlines())}
        assert set(rows) == {*HOSTILE_IDS, "big"}
        assert rows["big"]["response"]["body"]["choices"][0]["text"] == big
        assert rows[HOSTILE_IDS[0]]["error"]["message"].endswith(f"error about {HOSTILE_IDS[0]}\x00")
        # The published messages carry the job ids only (the 10 MB prompt stays in the store);
        # Flower's view of them names each job by its custom_id.
        with client.app.connection_for_read() as conn:
            q = conn.SimpleQueue(unique_queue)
            bodies = [q.get(timeout=10) for _ in lines]
            q.close()
        assert sorted(b.payload[0][0] for b in bodies) == sorted(j.id for j in jobs.values())
        assert all(b.payload[0][1:] == [] and len(b.body) < 1000 for b in bodies)
        assert all(f"custom_id={cid!r}" in "".join(b.headers["argsrepr"] for b in bodies) for cid in HOSTILE_IDS)
    finally:
        redis.Redis.from_url(redis_url).delete(unique_queue)
        store.dispose()


# ---- JSON only ---------------------------------------------------------------------------
def test_a_pickled_task_message_is_refused_and_nothing_runs(redis_url, unique_queue, caplog):
    """A real Celery worker with the app's settings, a pickled message then a JSON one on its
    queue: the JSON one runs, the pickle is refused (and dropped, not redelivered)."""
    from celery.contrib.testing.worker import start_worker

    app = make_app(redis_url, include_tasks=False)
    app.conf.task_default_queue = unique_queue
    app.conf.task_queues = [Queue(unique_queue, routing_key=unique_queue)]
    ran: list[str] = []
    done = threading.Event()
    # A name of its own: worker.run.tasks' generate is a shared task, so an app made after another
    # test imported it would otherwise run the real task instead of this one.
    task_name = f"test.generate.{unique_queue}"

    @app.task(name=task_name)
    def generate(job_id, payload):
        ran.append(job_id)
        done.set()

    exchange = Exchange(unique_queue, type="direct")
    queue = Queue(unique_queue, exchange, routing_key=unique_queue)
    with Connection(redis_url) as conn:
        producer = conn.Producer()
        pickled = app.amqp.create_task_message("pickled-job", task_name, ("pickled-job", {}), {})
        producer.publish(pickle.dumps(pickled.body), serializer=None, content_type="application/x-python-serialize",
                         content_encoding="binary", headers=pickled.headers, routing_key=unique_queue,
                         exchange=exchange, declare=[queue], **pickled.properties)
        good = app.amqp.create_task_message("json-job", task_name, ("json-job", {}), {})
        producer.publish(good.body, serializer="json", headers=good.headers, routing_key=unique_queue,
                         exchange=exchange, declare=[queue], **good.properties)
    try:
        with caplog.at_level(logging.WARNING), start_worker(app, pool="solo", perform_ping_check=False,
                                                            queues=[unique_queue], shutdown_timeout=30):
            assert done.wait(120), "the JSON message never ran"
        assert ran == ["json-job"]
        assert "Refusing to deserialize untrusted content of type pickle" in caplog.text
        assert redis.Redis.from_url(redis_url).llen(unique_queue) == 0  # refused and dropped
    finally:
        redis.Redis.from_url(redis_url).delete(unique_queue)


# ---- Redis with a password, Redis over TLS -----------------------------------------------
def _submit_and_receive(broker_url: str, tmp_path: Path) -> Job:
    """Submit one job through the real Client and take its message off the queue."""
    queue = f"gen.sec-{uuid.uuid4().hex[:8]}"
    client = Client(broker_url=broker_url, database_url=f"sqlite:///{tmp_path / 'sb.db'}", model="tiny", queue=queue)
    job_id = client.submit("hello", params={"max_tokens": 3})
    with client.app.connection_for_read() as conn:
        message = conn.SimpleQueue(f"{queue}.interactive").get(timeout=10)  # one job rides the interactive lane
    assert message.content_type == "application/json"
    assert message.payload[0] == [job_id]  # the job's id only: the store holds the request
    message.ack()
    job = client.store.get_job(job_id)
    assert job.prompt == "hello" and job.params["max_tokens"] == 3
    return job


def test_redis_with_a_password(tmp_path):
    binary, port, password = redis_binary(), free_port(), uuid.uuid4().hex
    args = ["--port", str(port), "--bind", "127.0.0.1", "--requirepass", password]
    with redis_server(binary, args, tmp_path, ["-p", str(port), "-a", password, "--no-auth-warning"]):
        job = _submit_and_receive(f"redis://:{password}@127.0.0.1:{port}/0", tmp_path)
        assert job.params["seed"] is not None  # recorded by the producer
        with pytest.raises(Exception) as wrong:
            Client(broker_url=f"redis://:not-{password}@127.0.0.1:{port}/0",
                   database_url=f"sqlite:///{tmp_path / 'sb2.db'}", model="tiny").submit("x")
        assert password not in str(wrong.value) and "not-" + password not in str(wrong.value)


def test_redis_over_tls(tmp_path):
    binary, port = redis_binary(tls=True), free_port()
    certs = make_certs(tmp_path)
    args = ["--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1", "--tls-cert-file", str(certs["cert"]),
            "--tls-key-file", str(certs["key"]), "--tls-ca-cert-file", str(certs["ca"]), "--tls-auth-clients", "no"]
    with redis_server(binary, args, tmp_path, ["--tls", "--cacert", str(certs["ca"]), "-p", str(port)]):
        # A client that does not trust the server's CA is refused, with or without
        # ssl_cert_reqs in the URL. (Databases 2 and 3: kombu pools producers process-wide by
        # host, port and database, not by TLS options.)
        for db, query in ((2, "?ssl_cert_reqs=required"), (3, "")):
            with pytest.raises(Exception, match="CERTIFICATE_VERIFY_FAILED"):
                Client(broker_url=f"rediss://127.0.0.1:{port}/{db}{query}", model="tiny",
                       database_url=f"sqlite:///{tmp_path / 'sb3.db'}").submit("x")
        _submit_and_receive(f"rediss://127.0.0.1:{port}/0?ssl_cert_reqs=required&ssl_ca_certs={certs['ca']}", tmp_path)
        _submit_and_receive(f"rediss://127.0.0.1:{port}/1?ssl_ca_certs={certs['ca']}", tmp_path)  # verified by default


def test_plain_and_embedded_brokers_still_work(redis_url, tmp_path):
    _submit_and_receive(redis_url, tmp_path)
    from worker.dispatch.embedded import embedded_redis_url

    _submit_and_receive(embedded_redis_url(), tmp_path)


# ---- no password is ever shown ----------------------------------------------------------
def test_cli_never_shows_a_password(tmp_path, pg_url):
    """``specbatch run`` (with its local worker's banner and log), ``submit`` and ``status``
    given URLs with passwords: the output names the servers, with the password masked."""
    import subprocess
    import sys

    from tests.helpers.tiny_models import make_tiny_model

    root = Path(__file__).resolve().parents[2]
    model = str(make_tiny_model(tmp_path / "tiny"))
    binary, port, password = redis_binary(), free_port(), "hunter2-" + uuid.uuid4().hex[:8]
    broker = f"redis://:{password}@127.0.0.1:{port}/0"
    log = tmp_path / "worker.log"
    env = dict(os.environ, PYTHONPATH=str(root), SPECBATCH_QUEUE=f"gen.pw-{uuid.uuid4().hex[:8]}",
               SPECBATCH_WORKER_LOG=str(log), SPECBATCH_WORKER_LOGLEVEL="info", SPECBATCH_AUTO_MIGRATE="1")
    env.pop("DATABASE_URL", None)
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"prompt": "hi", "max_tokens": 2, "temperature": 0}) + "\n")
    # trust auth ignores the password, so a PostgreSQL URL can carry one here
    database = pg_url.replace("postgres@", f"postgres:{password}@")

    def cli(*args):
        res = subprocess.run([sys.executable, "-m", "worker.api.cli", "--broker-url", broker, "--database-url", database,
                              *args], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
        return res, res.stdout + res.stderr

    with redis_server(binary, ["--port", str(port), "--bind", "127.0.0.1", "--requirepass", password], tmp_path,
                      ["-p", str(port), "-a", password, "--no-auth-warning"]):
        res, out = cli("run", str(src), "-o", str(tmp_path / "out.jsonl"), "--model", model, "--max-num-seqs", "2")
        assert res.returncode == 0, out[-3000:]
        res2, out2 = cli("submit", "hello", "--model", model, "--max-tokens", "0")  # a usage error
        res3, out3 = cli("status")
    worker_log = log.read_text()
    assert res2.returncode == 2 and "max_tokens must be at least 1" in out2
    assert res3.returncode == 0
    assert f"broker redis://:***@127.0.0.1:{port}/0" in out and "postgres:***@127.0.0.1" in out3
    assert "redis://:**@127.0.0.1" in worker_log  # Celery's banner masks it too
    assert f"broker redis://:***@127.0.0.1:{port}/0" in worker_log  # and so does ours
    for text in (out, out2, out3, worker_log):
        assert password not in text.replace("\n", "")  # not even split by a line wrap
