"""``specbatch status`` tells the truth about workers and fits 80 columns when piped: a worker
whose heartbeat is older than a lease is ``lost`` (a SIGKILL records nothing), one that recorded
its exit is ``exited N``; neither is ever ``ready``."""

from __future__ import annotations

import re
import time

from click.testing import CliRunner

from tests.worker.test_report import make_batch, run_job
from worker.api.cli import cli
from worker.store.models import FAILED
from worker.store.rows import job_row
from worker.store.store import Store


def _status(url: str, *args: str, env: dict[str, str] | None = None) -> str:
    res = CliRunner().invoke(cli, ["--database-url", url, "status", *args, "--once"], env=env)
    assert res.exit_code == 0, res.output
    return res.stdout


def _state(out: str, name: str) -> str:
    """The state shown after a worker's name (its first line: ``name  state``)."""
    (line,) = [line for line in out.splitlines() if line.startswith(name + " ")]
    return line[len(name):].strip()


def _details(out: str, name: str) -> str:
    lines = out.splitlines()
    (i,) = [i for i, line in enumerate(lines) if line.startswith(name + " ")]
    return " ".join(lines[i + 1:i + 3])


def test_a_silent_worker_is_lost_and_an_exited_one_says_its_code(sqlite_url):
    store = Store(sqlite_url, auto_upgrade=True)
    for name in ("alive@h", "killed@h", "crashed@h", "fine@h"):
        store.worker_starting(name, host="h", pid=1, device="cpu", queue="gen.m", model="m")
        store.worker_state(name, "ready")
    with store._write() as conn:  # killed@h stopped heartbeating 84 s ago (SIGKILL: nothing recorded)
        conn.exec_driver_sql("UPDATE workers SET heartbeat_at = heartbeat_at - 84 WHERE name = 'killed@h'")
    store.worker_exited("crashed@h", 6, "the worker's stop did not finish")
    store.worker_exited("fine@h", 0)
    out = _status(sqlite_url, env={"SPECBATCH_LEASE_SECONDS": "60"})
    assert _state(out, "alive@h") == "ready"
    # 84 s, plus the seconds ``status`` took to start on a loaded machine.
    ago = re.search(r"heartbeat (\d+) s ago", _details(out, "killed@h"))
    assert _state(out, "killed@h") == "lost" and ago and 84 <= int(ago.group(1)) <= 100
    assert _state(out, "crashed@h") == "exited 6" and "fails 1" in _details(out, "crashed@h")
    assert "last error: the worker's stop did not finish" in _details(out, "crashed@h")
    assert _state(out, "fine@h") == "exited 0" and "fails 0" in _details(out, "fine@h")
    # A restart of the same name is alive again.
    store.worker_starting("crashed@h", host="h", pid=2, device="cpu", queue="gen.m", model="m")
    assert _state(_status(sqlite_url), "crashed@h") == "starting"


def test_status_piped_fits_80_columns(sqlite_url):
    store = Store(sqlite_url, auto_upgrade=True)
    store.worker_starting("local-0a1b2c@a-rather-long-host-name.example.internal", host="h", pid=1,
                          device="cpu:1", queue="gen.smollm2-135m-instruct-q8.interactive", model="m")
    store.worker_state("local-0a1b2c@a-rather-long-host-name.example.internal", "failed",
                       "engine could not be built: " + "x" * 200)
    batch_id, ids = make_batch(store, n_ok=6, n_invalid=2, name="a-batch-with-a-long-descriptive-name-2026-12-04")
    for job_id in ids[:3]:
        run_job(store, job_id, end=time.time())
    run_job(store, ids[3], status=FAILED, error_type="structured_output_incomplete")
    job = job_row(model="a-model-with-a-long-name/SmolLM2-135M-Instruct", prompt="hi",
                  custom_id="a-custom-id-that-is-long")
    store.upsert_jobs([job])
    single = job["id"]
    for args in ((), (batch_id,)):
        out = _status(sqlite_url, *args)
        too_wide = [line for line in out.splitlines() if len(line) > 80]
        assert not too_wide, too_wide
        assert sqlite_url in "".join(out.splitlines())  # a long database URL folds, whole
        assert batch_id in out  # ids are never cut
    assert "local-0a1b2c@a-rather-long-host-name.example.internal" in _status(sqlite_url)
    assert single in _status(sqlite_url)


def test_status_without_a_broker_says_how_to_name_the_workers_redis(sqlite_url):
    Store(sqlite_url, auto_upgrade=True)
    res = CliRunner().invoke(cli, ["--database-url", sqlite_url, "status", "--once"],
                             env={"REDIS_URL": None, "SPECBATCH_BROKER_URL": None})
    assert res.exit_code == 0, res.output
    assert "no broker configured" in " ".join(res.stderr.split()) and "note" not in res.stdout
    named = CliRunner().invoke(cli, ["--database-url", sqlite_url, "--broker-url", "redis://127.0.0.1:6379/0",
                                     "status", "--once"])
    assert "no broker configured" not in named.stderr
