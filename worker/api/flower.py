"""``specbatch flower``: Flower against the app and broker, showing tasks as jobs.

Flower's defaults hide what an operator needs: its Tasks page shows no arguments or results,
and it serves anyone who can reach it. Here a task reads as its job (its arguments are the job
id, batch, custom_id and line, never the prompt: ``worker.dispatch.publish.args_repr``; its result is a
compact summary: ``worker.run.tasks.task_summary``), the Broker page lists the model queues with
their lengths, and a non-loopback address is refused unless basic auth is on.
"""

from __future__ import annotations

import ipaddress
import socket

#: Tasks page columns: the job (args), its outcome (result) and the usual timings.
TASKS_COLUMNS = "name,uuid,state,args,result,received,started,runtime,worker"


def is_loopback(address: str) -> bool:
    """True for addresses only this host can reach (127.0.0.0/8, ::1, localhost)."""
    if address in ("localhost", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:  # a host name: what it resolves to decides
        try:
            return all(ipaddress.ip_address(info[4][0]).is_loopback
                       for info in socket.getaddrinfo(address, None))
        except (OSError, ValueError):
            return False


def check_exposure(address: str, basic_auth: str | None, auth_provider: str | None = None) -> None:
    """Refuse to serve Flower beyond this host without authentication (it can cancel and
    shut down workers, and it shows every job's arguments)."""
    if not is_loopback(address) and not basic_auth and not auth_provider:
        raise ValueError(f"refusing to serve Flower on {address!r} without authentication: pass "
                         "--basic-auth user:password (or FLOWER_BASIC_AUTH), or bind 127.0.0.1")
    if basic_auth:
        for pair in basic_auth.split(","):
            user, sep, password = pair.partition(":")
            if not sep or not user or not password:
                raise ValueError("--basic-auth takes user:password (several separated by commas)")


def flower_argv(*, port: int, address: str, basic_auth: str | None, extra: tuple[str, ...] = ()) -> list[str]:
    """The ``celery flower`` command line for these settings."""
    argv = ["flower", f"--port={port}", f"--address={address}", f"--tasks_columns={TASKS_COLUMNS}"]
    if basic_auth:
        argv.append(f"--basic-auth={basic_auth}")
    return argv + list(extra)
