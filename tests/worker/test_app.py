"""Celery settings that reliability depends on, queue naming, and device pinning."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from worker.dispatch.app import make_app
from worker.common.config import queue_name, settings
from worker.run.runtime import pin_device, worker_name

ROOT = Path(__file__).resolve().parents[2]


def test_celery_settings():
    app = make_app("redis://127.0.0.1:6379/0", include_tasks=False)
    c = app.conf
    assert c.task_acks_late and c.worker_prefetch_multiplier == 1
    assert c.task_serializer == "json" and c.accept_content == ["json"]
    assert c.worker_send_task_events and c.task_send_sent_event and c.task_track_started
    assert c.task_ignore_result and not c.worker_cancel_long_running_tasks_on_connection_loss
    assert c.broker_connection_max_retries is None  # a restarting Redis is waited for
    assert c.worker_pool == "threads"
    vt = settings().visibility_timeout()
    assert c.broker_transport_options["visibility_timeout"] == vt == c.visibility_timeout
    assert vt > 2 * float(os.environ.get("SPECBATCH_MAX_JOB_SECONDS", 3 * 3600))


def test_queue_per_model():
    assert queue_name("SmolLM2-135M-Instruct") == "gen.smollm2-135m-instruct"
    assert queue_name("/models/Qwen/Qwen2.5-0.5B/") == "gen.qwen2.5-0.5b"


def test_pin_device_sets_cuda_visible_devices(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert pin_device("cuda:1") == ("cuda:0", "cuda1")
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "1"
    assert pin_device("cpu") == ("cpu", "cpu")
    assert worker_name("cuda:1", "host") == "cuda1@host" and worker_name("cpu", "host") == "cpu@host"
    with pytest.raises(ValueError, match="device"):
        pin_device("tpu")


def test_worker_command_pins_before_torch():
    """`specbatch worker --device cuda:1` must set the variable before torch is imported."""
    code = (
        "import sys, worker.api.cli as cli, worker.dispatch.app as a\n"
        "a.app.worker_main = lambda argv: print('ARGV', ' '.join(argv), 'TORCH', 'torch' in sys.modules)\n"
        "import os; cli.cli(['--broker-url', 'redis://127.0.0.1:6379/0', 'worker', '--device', 'cuda:1',"
        " '--model', 'm'], standalone_mode=False)\n"
        "print('CVD', os.environ['CUDA_VISIBLE_DEVICES'])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         env=dict(os.environ, PYTHONPATH=str(ROOT))).stdout
    assert "CVD 1" in out and "TORCH False" in out
    assert "-n cuda1@" in out and "-P threads" in out and "-Q gen.m" in out
