"""One settings object: every variable read once into ``Settings``, README's table generated from
it, and child processes handed their settings as flags."""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest

from worker.common.config import ENGINE_VARIABLES, Settings, settings, settings_table, use_settings

ROOT = Path(__file__).resolve().parents[2]


def test_readme_settings_table_is_the_generated_one():
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"<!-- settings table: begin -->\n(.*?)<!-- settings table: end -->", readme, re.S)
    assert block, "README.md has no generated settings table"
    assert block.group(1) == settings_table(), "README's settings table drifted: python -m worker.common.config --table"


def test_every_variable_the_code_reads_is_in_the_table():
    """No ``SPECBATCH_*`` read anywhere but through ``Settings`` or the engine's own list."""
    known = {f"SPECBATCH_{f.metadata['env']}" for f in fields(Settings)}
    known |= {f"SPECBATCH_{name}" for name, _, _ in ENGINE_VARIABLES}
    for path in [*ROOT.glob("worker/**/*.py"), *ROOT.glob("engine/**/*.py"), *ROOT.glob("kernels/**/*.py")]:
        text = path.read_text()
        read = set(re.findall(r'(?:environ\.get|getenv|environ\[|env\.get)\(?"(SPECBATCH_[A-Z0-9_]+)"', text))
        assert read <= known, f"{path.relative_to(ROOT)} reads {sorted(read - known)} outside Settings"
        if path.parts[-2:] != ("common", "config.py"):
            assert "os.environ[\"SPECBATCH_" not in text, f"{path.relative_to(ROOT)} writes a setting into os.environ"


def test_engine_defaults_in_the_table_are_the_engines():
    from engine.process import ENGINE_SPINCOUNT

    assert dict((n, d) for n, d, _ in ENGINE_VARIABLES)["ENGINE_SPINCOUNT"] == ENGINE_SPINCOUNT


def test_flags_win_over_the_environment_which_wins_over_defaults(monkeypatch):
    monkeypatch.setenv("SPECBATCH_PACING_WINDOW", "7")
    monkeypatch.setenv("SPECBATCH_ENGINE_PROCESS", "0")
    monkeypatch.setenv("REDIS_URL", "redis://elsewhere:6379/0")
    monkeypatch.delenv("SPECBATCH_BROKER_URL", raising=False)
    s = Settings.resolve(pacing_window=None, max_num_seqs=8)
    assert (s.pacing_window, s.engine_process, s.max_num_seqs) == (7, False, 8)
    assert s.broker_url == "redis://elsewhere:6379/0"
    assert s.lease_seconds == 60.0  # the default
    assert Settings.resolve(broker_url="redis://mine:1/2").broker_url == "redis://mine:1/2"


def test_a_malformed_variable_names_itself(monkeypatch):
    monkeypatch.setenv("SPECBATCH_LEASE_SECONDS", "soon")
    with pytest.raises(ValueError, match="SPECBATCH_LEASE_SECONDS='soon'"):
        Settings()


def test_the_process_settings_are_read_once(monkeypatch):
    monkeypatch.setenv("SPECBATCH_GROUP_JOBS", "5")
    first = settings()
    monkeypatch.setenv("SPECBATCH_GROUP_JOBS", "6")
    assert settings() is first and settings().group_jobs == 5
    use_settings(first.but(group_jobs=9))
    assert settings().group_jobs == 9


def test_a_local_worker_gets_its_settings_as_flags(tmp_path, monkeypatch):
    """``specbatch run``'s local worker: broker, database, model, queue and speculation on its
    command line, none of them in its environment."""
    import os

    from worker.run.local import LocalWorker

    for name in [k for k in os.environ if k.startswith("SPECBATCH_") or k == "REDIS_URL"]:
        monkeypatch.delenv(name)
    s = Settings(broker_url="redis://127.0.0.1:6379/3", database_url=f"sqlite:///{tmp_path}/x.db",
                 model=str(tmp_path / "no-model"), queue="gen.q", speculative="ngram:4")
    worker = LocalWorker(s, max_num_seqs=8, log_path=str(tmp_path / "worker.log"))
    try:
        cmd = list(worker.proc.args)  # what the process was started with
        environ = [f"{k}={v}" for k, v in worker._env.items()]  # and the environment it was given
    finally:
        worker.stop(timeout=10)
    assert cmd[:3] == [sys.executable, "-m", "worker.api.cli"]
    for flag, value in [("--broker-url", s.broker_url), ("--database-url", s.database_url), ("--model", s.model),
                        ("--queue", "gen.q"), ("--speculative", "ngram:4"), ("--max-num-seqs", "8")]:
        assert cmd[cmd.index(flag) + 1] == value, cmd
    assert not [v for v in environ if v.startswith(("SPECBATCH_", "REDIS_URL="))], environ


def test_the_worker_command_reads_its_flags_into_the_process_settings(tmp_path):
    """A real ``specbatch worker`` process whose engine cannot be built: its settings (flags over
    environment) reach the runtime, which names the model it tried."""
    proc = subprocess.run([sys.executable, "-m", "worker.api.cli", "--database-url", f"sqlite:///{tmp_path}/s.db",
                           "--broker-url", "redis://127.0.0.1:6379/9", "worker", "--model", str(tmp_path / "no-model"),
                           "--max-num-seqs", "3"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "no-model" in proc.stdout + proc.stderr


def test_the_workers_batch_default_is_the_engines(monkeypatch):
    """``max_num_seqs`` has one default: the engine's (the worker's setting restates it so that
    reading settings never imports torch)."""
    from engine.config import EngineConfig

    monkeypatch.delenv("SPECBATCH_MAX_NUM_SEQS", raising=False)
    assert Settings().max_num_seqs == EngineConfig.max_num_seqs
