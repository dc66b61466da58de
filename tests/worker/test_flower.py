"""Flower runs against our Celery app and the real Redis: operators' live view comes up."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.integration


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=2) as response:
        return response.read().decode()


def test_flower_serves_health_and_metrics(redis_url):
    port = free_port()
    env = dict(os.environ, REDIS_URL=redis_url, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "worker.app", "flower", f"--port={port}", "--address=127.0.0.1"],
        env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    try:
        deadline = time.time() + 60
        while True:
            try:
                assert get(f"http://127.0.0.1:{port}/healthcheck") == "OK"
                break
            except OSError:
                assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
                assert time.time() < deadline, "flower did not come up"
                time.sleep(0.5)
        assert "flower_events_total" in get(f"http://127.0.0.1:{port}/metrics")
    finally:
        proc.terminate()
        proc.wait(timeout=10)
