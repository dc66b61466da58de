"""Task messages: small JSON, sent through one producer and connection.

Producers, the lease reaper, the orphan sweep and a worker giving a job back all publish the
same way, so a job's message looks the same whoever sends it: task id = job id, the job id as
its only argument, nothing but JSON. A message carries ids only: the store is the one truth, and
the worker's claim returns each job's request with the claim (``Store.claim``). A message
from before that (``[job id, payload]``) still works: its ids are taken, its payload ignored
(``message_job_ids``).

The pacer sends a batch's short jobs several to a message (``job_groups``): a one-token job's
own message cost its worker more than its generation (Celery's receive, events, ack and a task
thread each: bench/tiny_jobs.py), so a message carries about a fixed amount of work, up to
``GROUP_JOBS`` jobs and ``GROUP_TOKENS`` tokens to generate. Long jobs still travel alone, so
work spreads across workers as before. A group message's one argument is the list of its job
ids; it names them in the ``specbatch_jobs`` header too, which the orphan sweep reads (``queued_job_ids``).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

from kombu import Queue

from engine.sampling_params import DEFAULT_MAX_TOKENS

from worker.dispatch.app import GROUP_TASK_NAME, TASK_NAME
from worker.common.config import settings
from worker.store.rows import new_id

log = logging.getLogger(__name__)

#: The header of a group message that lists its jobs' ids.
GROUP_HEADER = "specbatch_jobs"

#: Reconnect with backoff while Redis restarts (about a minute in all), then give up: the job
#: rows are in the store already and the orphan sweep publishes whatever never reached Redis.
RETRY_POLICY = {"max_retries": 30, "interval_start": 0.2, "interval_step": 0.5, "interval_max": 3.0}


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


def group_jobs() -> int:
    """The most jobs one message carries."""
    return max(1, settings().group_jobs)


def group_tokens() -> int:
    """The most tokens (``max_tokens`` x ``n``, summed) one message's jobs may generate."""
    return max(1, settings().group_tokens)


def generation_budget(row: dict[str, Any]) -> int:
    """The most tokens a job may generate: its ``max_tokens`` (or the default) times ``n``."""
    params = row.get("params") if isinstance(row.get("params"), dict) else {}
    max_tokens, n = params.get("max_tokens"), params.get("n")
    max_tokens = max_tokens if isinstance(max_tokens, int) and max_tokens > 0 else DEFAULT_MAX_TOKENS
    return max_tokens * (n if isinstance(n, int) and n > 0 else 1)


def job_groups(rows: Sequence[dict[str, Any]], queue_of: Callable[[dict[str, Any]], str], *,
               max_jobs: int | None = None, max_tokens: int | None = None) -> list[list[dict[str, Any]]]:
    """Consecutive rows of one queue, grouped while a group stays within ``max_jobs`` jobs and
    ``max_tokens`` tokens to generate (a job over the budget travels alone); order is kept."""
    max_jobs = group_jobs() if max_jobs is None else max_jobs
    max_tokens = group_tokens() if max_tokens is None else max_tokens
    groups: list[list[dict[str, Any]]] = []
    current: list[dict[str, Any]] = []
    queue, tokens = None, 0
    for row in rows:
        cost, qname = generation_budget(row), queue_of(row)
        if current and (qname != queue or len(current) >= max_jobs or tokens + cost > max_tokens):
            groups.append(current)
            current, tokens = [], 0
        current.append(row)
        queue, tokens = qname, tokens + cost
    if current:
        groups.append(current)
    return groups


#: How long a group message's argsrepr may grow (what Flower and ``inspect`` show of it).
GROUP_ARGSREPR_CHARS = 4000


def group_args_repr(rows: Sequence[dict[str, Any]]) -> str:
    """A group message's arguments as Flower shows them: how many jobs, then each job's
    ``args_repr`` (so a job is found by its custom_id there too), cut at ``GROUP_ARGSREPR_CHARS``."""
    text = f"{len(rows)} jobs: " + "; ".join(args_repr(row) for row in rows)
    return text if len(text) <= GROUP_ARGSREPR_CHARS else text[: GROUP_ARGSREPR_CHARS - 1] + "…"


def publish_jobs(app, rows: Sequence[dict[str, Any]], queue_of: Callable[[dict[str, Any]], str], *,
                 retry: bool = True, grouped: bool = False) -> int:
    """Publish the jobs (rows with their id and what ``queue_of`` and grouping read:
    ``Store.message_rows``), one task message each or, ``grouped``, several short jobs to a
    message (``job_groups``); ``queue_of(row)`` names a row's queue. Returns the jobs published."""
    groups = job_groups(rows, queue_of) if grouped else [[row] for row in rows]
    return publish_groups(app, groups, queue_of, retry=retry)


def publish_groups(app, groups: Sequence[Sequence[dict[str, Any]]], queue_of: Callable[[dict[str, Any]], str], *,
                   retry: bool = True) -> int:
    """One task message per group of job rows (of one queue each: ``queue_of`` of its first
    row); a group of one is an ordinary job message. Returns the jobs published."""
    if not groups:
        return 0
    amqp = app.amqp
    queues: dict[str, Queue] = {}
    with app.producer_or_acquire() as producer, producer.batch(max_size=2000):
        # kombu >= 5.7 buffers these in one non-transactional Redis pipeline per 2000
        # commands (task LPUSH + task-sent event PUBLISH) instead of a round trip each.
        for group in groups:
            qname = queue_of(group[0])
            queue = queues.get(qname)
            if queue is None:
                queue = queues[qname] = Queue(qname, routing_key=qname)
            if len(group) == 1:
                row = group[0]
                name = TASK_NAME
                message = amqp.create_task_message(
                    row["id"], TASK_NAME, (row["id"],), {}, create_sent_event=True,
                    ignore_result=True, argsrepr=args_repr(row), kwargsrepr="{}",
                )
            else:
                name = GROUP_TASK_NAME
                message = amqp.create_task_message(
                    new_id(), GROUP_TASK_NAME, ([row["id"] for row in group],), {},
                    create_sent_event=True, ignore_result=True, kwargsrepr="{}",
                    argsrepr=group_args_repr(group),
                )
                message.headers[GROUP_HEADER] = [row["id"] for row in group]
            amqp.send_task_message(producer, name, message, queue=queue, declare=[queue],
                                   retry=retry, retry_policy=RETRY_POLICY)
    return sum(len(group) for group in groups)


def message_job_ids(entries: Any) -> list[str]:
    """The job ids a group message names, in order: its list of ids, or (a message published
    before messages carried ids only) the id of each ``[job id, payload]`` pair, the payload
    ignored. A hostile entry is logged and skipped: a real job it hid is still queued in the
    store, and the orphan sweep publishes it again."""
    ids: list[str] = []
    for entry in entries if isinstance(entries, list) else []:
        if isinstance(entry, (list, tuple)) and len(entry) == 2:
            entry = entry[0]
        if isinstance(entry, str):
            ids.append(entry)
        else:
            log.warning("group message entry ignored: %s", repr(entry)[:200])
    return ids


def queued_job_ids(redis_client, queue: str, limit: int = 1_000_000) -> set[str]:
    """Job ids of the messages waiting in ``queue``'s Redis lists (kombu keeps one list per
    queue, plus one per priority step), a group message's every job; reserved (unacked)
    messages are not counted."""
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
                    headers = json.loads(raw)["headers"]
                    group = headers.get(GROUP_HEADER)
                    if isinstance(group, list):
                        ids.update(job_id for job_id in group if isinstance(job_id, str))
                    else:
                        ids.add(headers["id"])
                except (ValueError, KeyError, TypeError, AttributeError):
                    continue
            start += page
    return ids

