"""Exit codes a worker process leaves with, and which of them a supervisor should retry.

All are non-zero, so systemd, Kubernetes and compose restart the worker; ``specbatch run``'s
own local worker is restarted the same way, except after a *permanent* exit, whose cause will
not change by trying again (it is shown to the user at once instead).
"""

from __future__ import annotations

import re

EXIT_ENGINE_BUILD_FAILED = 3  # the engine cannot be built here (bad model, device, option)
EXIT_ENGINE_DIED = 4  # the engine died mid-run: transient, restart with backoff
EXIT_STORE_UNREACHABLE = 5  # the database stayed unreachable through the start-up retries
EXIT_STOP_HUNG = 6  # a stop (e.g. Celery's "Unrecoverable error" after a broker loss) never finished
EXIT_METRICS_PORT = 7  # --metrics-port could not be bound (taken: one port per worker process)

#: Exits that a restart cannot cure: the same inputs fail the same way.
PERMANENT_EXITS = frozenset({EXIT_ENGINE_BUILD_FAILED, EXIT_METRICS_PORT})

#: The line ``runtime._exit`` logs last: "worker exiting with 3: engine could not be built: …".
_EXIT_LINE = re.compile(r"worker exiting with (\d+): (.*)")


def exit_cause(log_text: str) -> str | None:
    """The cause the worker logged with its last exit, on one line (None if it logged none)."""
    causes = _EXIT_LINE.findall(log_text)
    if not causes:
        return None
    return " ".join(causes[-1][1].split())
