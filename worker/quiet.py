"""Silence what says nothing to a user of specbatch (issue 33), each at its source:

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


def silence_noise() -> None:
    """The first two: cheap, idempotent, safe in any process (worker, Flower, CLI, tests)."""
    from celery.exceptions import SecurityWarning

    warnings.filterwarnings("ignore", message=_ROOT_WARNING, category=SecurityWarning)
    quiet_alembic()


def quiet_alembic() -> None:
    """alembic's plugin setup lines; call it before alembic is imported (``worker.migrate``)."""
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
