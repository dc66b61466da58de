"""Start a worker subprocess for ``specbatch run`` when nobody consumes the model's queue.

A subprocess (not a thread) because a Celery worker wants its own main thread and signal
handlers; it reaches the same broker (embedded or not) and database through the environment.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

from worker.common.config import Settings
from worker.run.exit_codes import PERMANENT_EXITS, exit_cause

ROOT = Path(__file__).resolve().parent.parent


class WorkerCannotStart(RuntimeError):
    """The local worker left with a permanent exit: restarting it would fail the same way."""

    def __init__(self, code: int, cause: str | None, log_path: str | None):
        self.code, self.cause, self.log_path = code, cause, log_path
        where = f"; log: {log_path}" if log_path else ""
        super().__init__(f"the local worker cannot start (exit {code}): {cause or 'no cause logged'}{where}")


class LocalWorker:
    def __init__(self, settings: Settings, *, concurrency: int | None = None, max_num_seqs: int | None = None,
                 loglevel: str = "warning", log_path: str | None = None, extra_env: dict[str, str] | None = None):
        self.settings = settings
        env = dict(os.environ)
        env.update(extra_env or {})
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
        # A unique node name so this worker never clashes with a long-running one; restarts
        # keep it, so the store's workers table counts them.
        self.node = f"local-{uuid.uuid4().hex[:6]}@{socket.gethostname()}"
        # Its settings travel as flags (the rest of the environment is the user's own).
        cmd = [sys.executable, "-m", "worker.api.cli", "--database-url", settings.database_url]
        if settings.broker_url:
            cmd += ["--broker-url", settings.broker_url]
        cmd += ["worker", "--device", settings.device, "--model", settings.model, "--queue", settings.queue_name,
                "--loglevel", loglevel, "--name", self.node]
        for name in settings.served_names:
            cmd += ["--served-model-name", name]
        if settings.speculative:
            cmd += ["--speculative", settings.speculative]
        if settings.draft_model:
            cmd += ["--draft-model", settings.draft_model]
        if concurrency:
            cmd += ["--concurrency", str(concurrency)]
        if max_num_seqs:
            cmd += ["--max-num-seqs", str(max_num_seqs)]
        self.log_path = log_path
        self._cmd, self._env = cmd, env
        self._log = open(log_path, "ab") if log_path else subprocess.DEVNULL
        self.restarts = 0
        self.last_exit: int | None = None  # the code of the last exit seen (the process may be restarted since)
        self._next_start = 0.0
        self.proc = self._spawn()

    def _spawn(self) -> subprocess.Popen:
        return subprocess.Popen(self._cmd, env=self._env, stdout=self._log, stderr=self._log, cwd=os.getcwd())

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def exit_cause(self) -> str | None:
        """The cause the worker logged with its last exit, one line (None without a log)."""
        if not self.log_path:
            return None
        try:
            return exit_cause(Path(self.log_path).read_text(errors="replace"))
        except OSError:
            return None

    def keep_alive(self, max_restarts: int = 10) -> bool:
        """Restart the worker if it exited, with exponential backoff (1, 2, 4 … 30 s), as a
        supervisor would; False once it has been restarted ``max_restarts`` times. A permanent
        exit (the engine cannot be built here) raises ``WorkerCannotStart`` at once: trying
        again would only hide its cause for minutes."""
        if self.alive:
            return True
        self.last_exit = self.proc.returncode
        if self.last_exit in PERMANENT_EXITS:
            raise WorkerCannotStart(self.last_exit, self.exit_cause(), self.log_path)
        now = time.monotonic()
        if self._next_start == 0.0:
            if self.restarts >= max_restarts:
                return False
            self._next_start = now + min(30.0, 2.0 ** self.restarts)
        if now >= self._next_start:
            self.restarts += 1
            self._next_start = 0.0
            self.proc = self._spawn()
        return True

    def stop(self, timeout: float = 30.0) -> int | None:
        """Warm shutdown (SIGTERM: finish running tasks), then kill after ``timeout``."""
        if self.alive:
            self.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + timeout
            while self.alive and time.monotonic() < deadline:
                time.sleep(0.1)
            if self.alive:
                self.proc.kill()
        rc = self.proc.wait()
        if self._log is not subprocess.DEVNULL:
            self._log.close()
        return rc
