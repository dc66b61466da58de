"""Noise that says nothing to a user is gone (issue 33), each checked in a fresh interpreter
beside the same code without the silencing, so each test can fail."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))


def test_celerys_root_warning_is_silenced():
    check = "from celery.platforms import check_privileges; check_privileges({'json'})"
    plain = _python(check)
    ours = _python("import worker.dispatch.app\n" + check)
    assert ours.returncode == 0 and "superuser privileges" not in ours.stderr, ours.stderr
    if os.geteuid() == 0:  # Celery warns only a root process: then it must have warned without us
        assert "superuser privileges" in plain.stderr, plain.stderr


def test_alembics_plugin_setup_lines_are_silenced(tmp_path):
    migrate = (f"import logging; logging.basicConfig(level=logging.INFO)\n"
               f"from worker.store.store import Store; Store('sqlite:///{tmp_path}/q.db', auto_upgrade=True)\n")
    ours = _python(migrate)
    assert ours.returncode == 0, ours.stderr
    assert "setup plugin" not in ours.stderr and "Running upgrade" in ours.stderr  # other INFO lines stay
    plain = _python("import logging; logging.basicConfig(level=logging.INFO)\nimport alembic.command")
    assert "setup plugin" in plain.stderr


#: An object that writes to stderr as the interpreter finalizes, as nanobind's leak report does.
_LATE_WRITER = """
import os
class Late:
    def __del__(self):
        os.write(2, b"nanobind: leaked 3 instances of triton\\n")
keep = Late()
"""


def test_what_the_interpreter_writes_after_the_exit_handlers_is_silenced():
    plain = _python(_LATE_WRITER + "import atexit; atexit.register(lambda: print('bye', flush=True))")
    assert "nanobind: leaked" in plain.stderr and "bye" in plain.stdout
    ours = _python("from worker.common.quiet import quiet_finalization; quiet_finalization()\n" + _LATE_WRITER
                   + "import atexit, sys; atexit.register(lambda: print('bye', file=sys.stderr, flush=True))")
    assert "nanobind" not in ours.stderr and "bye" in ours.stderr  # other exit handlers still speak


#: Celery's worker logging setup (``app.log.setup``: warnings "always") then a connection loss.
_CONNECTION_LOSS = """
import warnings
from celery import signals
from celery.exceptions import CPendingDeprecationWarning
from celery.worker.consumer.consumer import CANCEL_TASKS_BY_DEFAULT
warnings.filterwarnings('always', category=CPendingDeprecationWarning)
signals.celeryd_after_setup.send(sender='w@host', instance=None, conf=None)
warnings.warn(CANCEL_TASKS_BY_DEFAULT, CPendingDeprecationWarning)
"""


def test_celerys_notice_on_each_connection_loss_is_silenced():
    plain = _python(_CONNECTION_LOSS)
    assert "In Celery 5.1 we introduced" in plain.stderr, plain.stderr
    ours = _python("import worker.dispatch.app\n" + _CONNECTION_LOSS)
    assert ours.returncode == 0 and "In Celery 5.1" not in ours.stderr, ours.stderr
