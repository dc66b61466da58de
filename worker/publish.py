"""Task messages: small JSON, one per job, sent through one producer and connection.

Producers, the lease reaper, the orphan sweep and a worker giving a job back all publish the
same way, so a job's message looks the same whoever sends it: task id = job id, the job's
payload as the only argument besides its id, nothing but JSON.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

from kombu import Queue

from .app import TASK_NAME
from .store import JOB_PAYLOAD_FIELDS

log = logging.getLogger(__name__)

#: Reconnect with backoff while Redis restarts (about a minute in all), then give up: the job
#: rows are in the store already and the orphan sweep publishes whatever never reached Redis.
RETRY_POLICY = {"max_retries": 30, "interval_start": 0.2, "interval_step": 0.5, "interval_max": 3.0}


def payload_of(row: dict[str, Any]) -> dict[str, Any]:
    return {k: row.get(k) for k in JOB_PAYLOAD_FIELDS}


def args_repr(row: dict[str, Any]) -> str:
    """What Flower and ``celery inspect`` show as the task's arguments: where the job comes from
    (custom_id first: the column is narrow), its line and batch, then its id; never the prompt
    (large, and maybe private)."""
    custom_id = row.get("custom_id")
    if isinstance(custom_id, str) and len(custom_id) > 200:
        custom_id = custom_id[:200] + "…"
    parts = [("custom_id", custom_id), ("line", row.get("line_no")), ("batch", row.get("batch_id")),
             ("job", row["id"])]
    return " ".join(f"{name}={value!r}" for name, value in parts if value is not None)


def publish_jobs(app, rows: Sequence[dict[str, Any]], queue_of: Callable[[dict[str, Any]], str], *,
                 retry: bool = True) -> int:
    """Publish one task message per job row; ``queue_of(row)`` names its queue."""
    if not rows:
        return 0
    amqp = app.amqp
    queues: dict[str, Queue] = {}
    with app.producer_or_acquire() as producer, producer.batch(max_size=2000):
        # kombu >= 5.7 buffers these in one non-transactional Redis pipeline per 2000
        # commands (task LPUSH + task-sent event PUBLISH) instead of a round trip each.
        for row in rows:
            qname = queue_of(row)
            queue = queues.get(qname)
            if queue is None:
                queue = queues[qname] = Queue(qname, routing_key=qname)
            message = amqp.create_task_message(
                row["id"], TASK_NAME, (row["id"], payload_of(row)), {}, create_sent_event=True,
                ignore_result=True, argsrepr=args_repr(row), kwargsrepr="{}",
            )
            amqp.send_task_message(producer, TASK_NAME, message, queue=queue, declare=[queue],
                                   retry=retry, retry_policy=RETRY_POLICY)
    return len(rows)


def queued_job_ids(redis_client, queue: str, limit: int = 1_000_000) -> set[str]:
    """Job ids of the messages waiting in ``queue``'s Redis lists (kombu keeps one list per
    queue, plus one per priority step); reserved (unacked) messages are not counted."""
    import json

    ids: set[str] = set()
    names = [queue.encode()] + [k for k in redis_client.scan_iter(match=queue + "\x06\x16*") if k != queue.encode()]
    for name in names:
        start, page = 0, 5000
        while start < limit:
            chunk = redis_client.lrange(name, start, start + page - 1)
            if not chunk:
                break
            for raw in chunk:
                try:
                    ids.add(json.loads(raw)["headers"]["id"])
                except (ValueError, KeyError, TypeError):
                    continue
            start += page
    return ids

