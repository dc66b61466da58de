"""Silence what says nothing to a user of specbatch (issue 33), each at its source:

- Celery's notice, on every broker connection loss, that 6.0 will cancel acks_late tasks (we set
  that switch ourselves).
- Celery's ``SecurityWarning`` for a worker run as root (the usual case in a container): it
  warns about pickle, which we never accept (JSON only), and asks for ``--uid``.
- alembic's "setup plugin ..." lines, logged at INFO whenever alembic is imported under a
  configured root logger (Flower's: 7 lines on every start).
- nanobind's "leaked N instances/types/functions ... triton" report, ~30 lines written to stderr
  while the interpreter finalizes after torch loaded triton; nothing leaks that outlives the
  process, and a real error never comes that late.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import warnings

_ROOT_WARNING = r"You're running the worker with superuser privileges"
#: Celery's notice on every broker connection loss that 6.0 will cancel acks_late tasks then: we
#: set ``worker_cancel_long_running_tasks_on_connection_loss`` ourselves (False: running jobs go
#: on generating through a Redis restart), so the notice says nothing to a user.
_CANCEL_ON_LOSS = r"\s*In Celery 5\.1 we introduced an optional breaking change"


def silence_noise() -> None:
    """The first two: cheap, idempotent, safe in any process (worker, Flower, CLI, tests)."""
    from celery.exceptions import SecurityWarning

    from celery import signals

    warnings.filterwarnings("ignore", message=_ROOT_WARNING, category=SecurityWarning)
    quiet_alembic()
    quiet_connection_loss_notice()
    # Celery's worker logging setup files CPendingDeprecationWarning under "always" (ahead of
    # ours), after worker_init: the filter goes in again once that setup is done.
    signals.celeryd_after_setup.connect(quiet_connection_loss_notice, weak=False)


def quiet_connection_loss_notice(*_: object, **__: object) -> None:
    """Celery's "In Celery 5.1 we introduced an optional breaking change" on every connection loss."""
    from celery.exceptions import CPendingDeprecationWarning

    warnings.filterwarnings("ignore", message=_CANCEL_ON_LOSS, category=CPendingDeprecationWarning)


def quiet_alembic() -> None:
    """alembic's plugin setup lines; call it before alembic is imported (``worker.store.migrate``)."""
    logging.getLogger("alembic.runtime.plugins").setLevel(logging.WARNING)


def quiet_finalization() -> None:
    """Send stderr to /dev/null once every exit handler has run: what comes after is the
    interpreter finalizing (triton's nanobind leak report), never a result or an error of the
    command. Call it first thing in a CLI command: exit handlers run last registered first, so
    this one runs after all the others."""
    def redirect() -> None:
        try:
            sys.stderr.flush()
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 2)
        except OSError:
            pass

    atexit.register(redirect)
