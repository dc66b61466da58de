"""A Redis restart is waited out inside the worker (issue 33).

First the failure itself, made to happen every time with plain kombu: a consumer holding
unacked messages (``acks_late``) and a pidbox-like fanout channel, Redis killed, then the
sequence Celery runs on a connection error (``collect``, then ``close``). Kombu's own close
raises ``AttributeError: 'NoneType' object has no attribute 'hostname'``, Celery's
"Unrecoverable error" (cause: ``worker.dispatch.kombu_redis``). With our repairs the same sequence
closes cleanly, and a message delivered before the outage is acked on the restarted Redis.

Then the whole worker: jobs running, Redis killed and started again 10 s and then 60 s later,
with and without persistence. The worker process never exits, every job succeeds exactly
once, and no job spent an attempt on the outage.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.faults.conftest import RedisServer, Workers, stored_results, wait_until
from worker.api.client import Client
from worker.common.config import Settings
from worker.store.models import QUEUED, RUNNING, SUCCEEDED

ROOT = Path(__file__).resolve().parents[2]

#: Celery's reaction to a broker connection error, on a connection whose task channel holds
#: unacked messages and whose BRPOP is in flight, with a fanout consumer on a later channel.
_SEQUENCE = r'''
import json, socket, sys
from kombu import Connection, Exchange, Queue
from celery.utils.threads import bound_open_broker_sockets

url, kill_file = sys.argv[1], sys.argv[2]
conn = Connection(url)
tasks = Queue("tasks", routing_key="tasks")
with conn.Producer() as producer:
    for i in range(3):
        producer.publish({"i": i}, routing_key="tasks", declare=[tasks])
delivered = []
channel = conn.default_channel
channel.basic_qos(0, 10, False)
conn.Consumer([tasks], callbacks=[lambda body, m: delivered.append(m)], channel=channel).consume()
box = conn.channel()  # like Celery's pidbox: created after the task channel, a fanout consumer
conn.Consumer([Queue("box", Exchange("box", type="fanout"), auto_delete=True)], channel=box).consume()
for _ in range(6):
    try:
        conn.drain_events(timeout=0.3)
    except socket.timeout:
        pass
assert len(delivered) == 3 and channel._in_poll, (len(delivered), channel._in_poll)
open(kill_file, "w").close()
while open(kill_file).read() != "killed":
    pass
bound_open_broker_sockets(conn, 5.0)
try:
    conn.collect(socket_timeout=5.0)
except Exception:
    pass
outcome = {"close": "ok", "ack": None}
try:
    conn.close()
except Exception as exc:
    outcome["close"] = repr(exc)
print(json.dumps(outcome), flush=True)
sys.stdin.readline()  # Redis restarted: ack a message delivered before the outage
try:
    delivered[0].ack()
    outcome["ack"] = "ok"
except Exception as exc:
    outcome["ack"] = repr(exc)
print(json.dumps(outcome), flush=True)
'''


def _run_sequence(redis_server: RedisServer, tmp_path: Path, *, repaired: bool) -> tuple[dict, dict]:
    """Run ``_SEQUENCE`` in a child (plain kombu, or with ``worker.dispatch.kombu_redis`` applied),
    killing Redis at its signal and starting it again before the late ack."""
    import json

    kill_file = tmp_path / f"kill-{repaired}"
    prelude = "import worker.dispatch.kombu_redis as k; k.apply()\n" if repaired else ""
    child = subprocess.Popen([sys.executable, "-c", prelude + _SEQUENCE, redis_server.url, str(kill_file)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        wait_until(lambda: kill_file.exists() or child.poll() is not None, timeout=30, what="consumer ready")
        assert child.poll() is None, child.stderr.read()
        redis_server.kill()
        kill_file.write_text("killed")
        after_close = json.loads(child.stdout.readline() or "null") or pytest.fail(child.stderr.read())
        redis_server.start()
        child.stdin.write("\n")
        child.stdin.flush()
        after_ack = json.loads(child.stdout.readline() or "null") or pytest.fail(child.stderr.read())
        return after_close, after_ack
    finally:
        child.kill()
        child.wait()


def test_plain_kombu_dies_on_a_redis_loss_with_unacked_messages_and_the_repair_survives(tmp_path):
    redis_server = RedisServer(tmp_path, persistent=True)
    try:
        plain, _ = _run_sequence(redis_server, tmp_path, repaired=False)
        assert "'NoneType' object has no attribute 'hostname'" in plain["close"], plain
        redis_server.proc.kill()
        redis_server.proc.wait()
        redis_server.start()
        import redis

        client = redis.Redis(port=redis_server.port)
        client.flushall()
        closed, acked = _run_sequence(redis_server, tmp_path, repaired=True)
        assert closed["close"] == "ok", closed
        assert acked["ack"] == "ok", acked
        # The append-only file kept the three unacked messages; the late ack removed one.
        assert client.hlen("unacked") == 2
    finally:
        redis_server.kill()


def _job_ids(raw: bytes) -> list[str]:
    """The job ids a message in kombu's unacked index carries (a job, or a group of jobs)."""
    import base64
    import json

    message = json.loads(raw)[0]
    args = json.loads(base64.b64decode(message["body"]))[0]
    if args and isinstance(args[0], list):  # specbatch.generate_group: [job id, ...]
        return args[0]
    return [args[0]]


#: Jobs long enough that some are running at each outage (tiny model, slowed steps).
SLOW = {"SPECBATCH_FAULTS": '{"step_sleep_s": 0.02}'}
N_JOBS, TOKENS = 24, 300


@pytest.mark.waits(130)
@pytest.mark.parametrize("persistent", [False, True], ids=["no-persistence", "append-only-file"])
def test_worker_waits_out_redis_restarts(persistent, sqlite_url, unique_queue, tiny_model, tmp_path):
    redis_server = RedisServer(tmp_path, persistent=persistent)
    settings = Settings(broker_url=redis_server.url, database_url=sqlite_url, model=tiny_model, device="cpu",
                        queue=unique_queue)
    group = Workers(settings, tmp_path)
    try:
        worker = group.start(env=SLOW)
        pid = worker.proc.pid
        client = Client(broker_url=settings.broker_url, database_url=settings.database_url, model=settings.model,
                        queue=settings.queue)
        rows = [{"custom_id": f"r{i}", "prompt": f"restart job {i}", "max_tokens": TOKENS, "ignore_eos": True,
                 "temperature": 0} for i in range(N_JOBS)]
        batch_id = client.submit_batch(rows, name="redis-restarts").batch_id
        log = Path(worker.log_path)
        for outage_s in (10.0, 60.0):
            # Strike while the worker holds unacked messages of running jobs.
            wait_until(lambda: client.store.batch_counts(batch_id)[RUNNING] >= 4, timeout=120,
                       what="jobs running")
            connected = log.read_text().count("Connected to redis")
            redis_server.kill()
            down_at = time.monotonic()
            while time.monotonic() - down_at < outage_s:
                assert worker.alive, f"worker exited {worker.proc.returncode}:\n{log.read_text()[-3000:]}"
                time.sleep(0.5)
            redis_server.start()
            wait_until(lambda: log.read_text().count("Connected to redis") > connected or not worker.alive,
                       timeout=90, what="the consumer to reconnect")
            assert worker.alive, f"worker exited {worker.proc.returncode}:\n{log.read_text()[-3000:]}"
        # The consumer resumed both lanes: an interactive job is answered while the batch runs.
        urgent = client.submit("urgent after the restarts", params={"max_tokens": 4}, priority="interactive")
        assert client.wait(urgent, timeout=120) == SUCCEEDED
        counts = client.wait(batch_id, timeout=300)
        logs = log.read_text()
        assert worker.alive and worker.proc.pid == pid and worker.restarts == 0
        assert "Unrecoverable error" not in logs
        assert counts[SUCCEEDED] == N_JOBS and not counts[QUEUED] + counts[RUNNING], counts
        assert max(stored_results(logs).values()) == 1
        jobs = client.store.jobs(batch_id)
        assert all(j.attempts == 1 for j in jobs), sorted((j.custom_id, j.attempts, j.error) for j in jobs)
        # Acks went out after the reconnect (with the append-only file, messages delivered
        # before an outage were still in Redis's unacked index). What may stay there: a message
        # popped in the instant the broker went away, whose delivery died with the connection;
        # the orphan sweep re-published its job. Each must name a job that succeeded once (its
        # redelivery after the visibility timeout is then dropped by the claim).
        import redis

        broker = redis.Redis(port=redis_server.port)
        left = [_job_ids(raw) for raw in broker.hvals("unacked")]
        assert len(left) <= 2, left
        for ids in left:
            assert all(client.store.get_job(i).status == SUCCEEDED and stored_results(logs)[i] == 1
                       for i in ids), ids
    finally:
        group.stop_all()
        redis_server.kill()


@pytest.mark.waits(45)
@pytest.mark.parametrize("retry_s", [None, "3"], ids=["within-retry", "longer-than-DB_RETRY_SECONDS"])
def test_worker_waits_out_a_database_cut(retry_s, pg_url, redis_url, unique_queue, tiny_model, tmp_path):
    """PostgreSQL cut for 20 s through a TCP proxy while jobs run: the same promises, also when
    the cut outlasts ``DB_RETRY_SECONDS`` (a result given up on then was re-run, attempt 2)."""
    from sqlalchemy.engine import make_url

    from tests.faults.conftest import TcpProxy
    from worker.store.store import Store

    url = make_url(pg_url)
    proxy = TcpProxy(url.port or 5432)
    proxied = url.set(port=proxy.port).render_as_string(hide_password=False)
    Store(pg_url, auto_upgrade=True)  # migrated directly, as a deploy step would
    settings = Settings(broker_url=redis_url, database_url=proxied, model=tiny_model, device="cpu",
                        queue=unique_queue)
    group = Workers(settings, tmp_path)
    try:
        worker = group.start(env={**SLOW, **({"SPECBATCH_DB_RETRY_SECONDS": retry_s} if retry_s else {})})
        pid = worker.proc.pid
        client = Client(broker_url=settings.broker_url, database_url=pg_url, model=settings.model,
                        queue=settings.queue)
        rows = [{"custom_id": f"c{i}", "prompt": f"cut job {i}", "max_tokens": TOKENS // 2, "ignore_eos": True,
                 "temperature": 0} for i in range(N_JOBS // 2)]
        batch_id = client.submit_batch(rows, name="db-cut").batch_id
        wait_until(lambda: client.store.batch_counts(batch_id)[RUNNING] >= 4, timeout=120, what="jobs running")
        proxy.cut()
        cut_at = time.monotonic()
        while time.monotonic() - cut_at < 20.0:
            assert worker.alive, f"worker exited {worker.proc.returncode}:\n{group.logs()[-3000:]}"
            time.sleep(0.5)
        proxy.restore()
        counts = client.wait(batch_id, timeout=300)
        logs = group.logs()
        assert worker.alive and worker.proc.pid == pid and worker.restarts == 0
        assert "database unreachable" in logs  # the cut was felt, and waited out
        assert counts[SUCCEEDED] == len(rows), (counts, client.store.failed_jobs(batch_id))
        assert max(stored_results(logs).values()) == 1
        jobs = client.store.jobs(batch_id)
        history = {j.custom_id: [(a.attempt, a.outcome, a.cause, a.charged) for a in client.store.attempt_history(j.id)]
                   for j in jobs if j.attempts != 1}
        assert not history, history
    finally:
        group.stop_all()
        proxy.close()
