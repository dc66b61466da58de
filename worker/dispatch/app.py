"""The Celery app: Redis broker, JSON only, one queue per model, late acks.

Results live in our SQL store, so Celery's result backend is off (``ignore_result``).
Start Flower with ``specbatch flower`` (tasks read as jobs, auth enforced beyond loopback) or
``celery -A worker.dispatch.app flower``.
"""

from __future__ import annotations

import ssl
from urllib.parse import parse_qs, urlsplit

from celery import Celery
from kombu import Queue

from . import kombu_redis
from worker.common.config import settings
from worker.dispatch.lanes import lane_queues
from worker.common.quiet import silence_noise

kombu_redis.apply()  # a Redis restart must not stop the worker: see worker.dispatch.kombu_redis
silence_noise()  # ``celery -A worker.dispatch.app worker|flower`` too, not only ``specbatch``

FALLBACK_BROKER = "redis://127.0.0.1:6379/0"
TASK_NAME = "specbatch.generate"
#: One message for several short jobs of a batch (``worker.dispatch.publish.job_groups``).
GROUP_TASK_NAME = "specbatch.generate_group"

def broker_ssl(broker_url: str) -> dict | None:
    """TLS options for a ``rediss://`` URL that names none: verify the server against the
    system's CAs. (kombu reads ``ssl_cert_reqs``/``ssl_ca_certs``/... from the URL's query,
    but without them it connects with ``CERT_NONE``, i.e. encrypted yet unauthenticated.)"""
    parts = urlsplit(broker_url)
    query = parse_qs(parts.query)
    if parts.scheme != "rediss" or "ssl_cert_reqs" in query:
        return None
    files = {k: v[-1] for k, v in query.items() if k in ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile")}
    return {**files, "ssl_cert_reqs": ssl.CERT_REQUIRED}


def _settings(broker_url: str) -> dict:
    vt = settings().visibility_timeout()
    default_queue = settings().queue_name
    return dict(
        broker_url=broker_url,
        broker_use_ssl=broker_ssl(broker_url),
        broker_connection_retry_on_startup=True,
        broker_connection_retry=True,
        broker_connection_max_retries=None,  # a restarting Redis is waited for, never given up on
        # Redis redelivers unacked messages after this long; it must outlast the longest job,
        # and kombu/celery read it from three places (celery#7651), so set all of them.
        # "priority": BRPOP names the queues in the order given (interactive lane first) instead
        # of rotating them, so an urgent message is always taken before a bulk one.
        broker_transport_options={"visibility_timeout": vt, "queue_order_strategy": "priority"},
        result_backend_transport_options={"visibility_timeout": vt},
        visibility_timeout=vt,
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        event_serializer="json",
        task_acks_late=True,  # ack only after the result (or the give-back) is in the store
        # A task raises only when the store stayed unreachable past DB_RETRY_SECONDS; its message
        # is then dropped either way on Redis (reject without requeue is an ack), and the job,
        # still running or queued in the store, comes back through the reaper. The store decides.
        task_acks_on_failure_or_timeout=True,
        worker_prefetch_multiplier=1,  # with acks_late: one reserved message per thread
        worker_send_task_events=True,
        task_send_sent_event=True,
        task_track_started=True,
        task_ignore_result=True,
        result_backend=None,
        # Results are fenced by attempt, so a task outliving a broker reconnect just finishes;
        # its late ack is a no-op on a restarted Redis.
        worker_cancel_long_running_tasks_on_connection_loss=False,
        worker_pool="threads",  # one process, one engine; threads hand requests to its loop
        task_default_queue=default_queue,
        task_queues=[Queue(q, routing_key=q) for q in lane_queues(default_queue)],
        task_create_missing_queues=True,
        worker_hijack_root_logger=False,
        # Under an orchestrator (REMAP_SIGTERM=SIGQUIT), finish running jobs for this long
        # before a cold shutdown; keep it under the grace period (k8s: 30 s by default).
        worker_soft_shutdown_timeout=settings().soft_shutdown_timeout,
    )


def make_app(broker_url: str | None = None, *, include_tasks: bool = True) -> Celery:
    """A configured app. Producers (``Client``) make their own, bound to their broker, so
    several clients in one process never share connection pools or a control mailbox."""
    new = Celery("specbatch", include=["worker.run.tasks"] if include_tasks else [])
    new.conf.update(_settings(broker_url or settings().broker_url or FALLBACK_BROKER))
    if include_tasks:  # a worker's app: keep task threads free for the interactive lane
        from worker.dispatch.governor import LaneGovernor

        new.steps["consumer"].add(LaneGovernor)
    return new


def configure(broker_url: str | None = None) -> Celery:
    """(Re)point the module's app (the one workers and Flower use) before it connects."""
    url = broker_url or settings().broker_url or FALLBACK_BROKER
    if app.conf.get("broker_url") not in (None, url):
        app.close()
    app.conf.update(_settings(url))
    return app


#: The worker/Flower app: ``celery -A worker.dispatch.app worker|flower``.
app = make_app()
