"""Where settings come from: flags, then environment (``SPECBATCH_*``, ``REDIS_URL``,
``DATABASE_URL``), then embedded defaults. One place so the CLI, the Celery app and the
worker subprocess all agree."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
DEFAULT_DATABASE_URL = "sqlite:///specbatch.db"
#: The longest a single job may run in a worker before it is aborted and failed. The Redis
#: visibility timeout is derived from it (see :func:`visibility_timeout`).
DEFAULT_MAX_JOB_SECONDS = 3 * 3600.0


def env(name: str, default: str | None = None) -> str | None:
    """``SPECBATCH_<NAME>`` from the environment, else ``default``."""
    value = os.environ.get(f"SPECBATCH_{name}")
    return value if value not in (None, "") else default


def broker_url_from_env() -> str | None:
    """The broker URL the environment names, or None (then an embedded Redis is used)."""
    return env("BROKER_URL") or os.environ.get("REDIS_URL") or None


def database_url_from_env() -> str:
    return env("DATABASE_URL") or os.environ.get("DATABASE_URL") or DEFAULT_DATABASE_URL


def model_from_env() -> str:
    return env("MODEL", DEFAULT_MODEL)  # type: ignore[return-value]


def max_job_seconds() -> float:
    return float(env("MAX_JOB_SECONDS", str(DEFAULT_MAX_JOB_SECONDS)))  # type: ignore[arg-type]


def lease_seconds() -> float:
    """A running attempt (or a worker) whose heartbeat is older than this is presumed dead."""
    return float(env("LEASE_SECONDS", "60"))


def heartbeat_seconds() -> float:
    """How often a worker refreshes the leases of its running jobs (well under the lease)."""
    return float(env("HEARTBEAT_SECONDS", "2"))


def max_attempts() -> int:
    """A job whose attempts fail this many times ends failed."""
    return int(env("MAX_ATTEMPTS", "3"))


def visibility_timeout() -> float:
    """Redis redelivers an unacked message this long after a worker *reserved* it.

    A reserved message may wait for a free thread and then run for up to ``max_job_seconds``,
    so twice that (plus a margin) keeps a live job from ever being handed to a second worker.
    """
    return 2.0 * max_job_seconds() + 300.0


_SECRET_QUERY_KEYS = frozenset({"password", "passwd", "pass", "secret", "token"})


def redact_url(url: str | None) -> str | None:
    """``url`` fit to print or log: the password (``user:pw@`` or a ``password=`` query value)
    becomes ``***``. Every URL the CLI or a worker shows goes through here."""
    if not url:
        return url
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparseable URL>"
    netloc = parts.netloc
    userinfo, at, host = netloc.rpartition("@")
    if at and ":" in userinfo:
        netloc = f"{userinfo.split(':', 1)[0]}:***@{host}"
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        if any(k.lower() in _SECRET_QUERY_KEYS for k, _ in pairs):
            query = urlencode([(k, "***" if k.lower() in _SECRET_QUERY_KEYS else v) for k, v in pairs], safe="/*")
    if (netloc, query) == (parts.netloc, parts.query):
        return url  # nothing secret (and ``scheme:///path`` keeps its form)
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def model_slug(model: str) -> str:
    """A queue-safe name for a model: the last path part, lower-cased, odd characters as '-'."""
    base = model.rstrip("/").split("/")[-1] or model
    slug = re.sub(r"[^a-z0-9._-]+", "-", base.lower()).strip("-")
    return slug or "model"


def queue_name(model: str) -> str:
    """One queue per model: ``gen.<model-slug>`` (override with ``SPECBATCH_QUEUE``)."""
    return env("QUEUE") or f"gen.{model_slug(model)}"


@dataclass(slots=True)
class Settings:
    """Resolved settings for one CLI invocation or worker."""

    broker_url: str | None
    database_url: str
    model: str
    device: str = "cpu"
    queue: str | None = None

    @property
    def queue_name(self) -> str:
        return self.queue or queue_name(self.model)

    @classmethod
    def resolve(
        cls,
        *,
        broker_url: str | None = None,
        database_url: str | None = None,
        model: str | None = None,
        device: str | None = None,
        queue: str | None = None,
    ) -> "Settings":
        return cls(
            broker_url=broker_url or broker_url_from_env(),
            database_url=database_url or database_url_from_env(),
            model=model or model_from_env(),
            device=device or env("DEVICE", "cpu"),  # type: ignore[arg-type]
            queue=queue or env("QUEUE"),
        )
