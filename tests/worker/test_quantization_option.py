"""``specbatch worker --quantization int8`` reaches the engine's config as one keyword."""

from click.testing import CliRunner

from worker.api.cli import cli
from worker.run.runtime import engine_kwargs_from_env


def test_quantization_env_becomes_an_engine_kwarg(monkeypatch):
    monkeypatch.delenv("SPECBATCH_QUANTIZATION", raising=False)
    assert "quantization" not in engine_kwargs_from_env()  # default: exact
    monkeypatch.setenv("SPECBATCH_QUANTIZATION", "int8")
    assert engine_kwargs_from_env()["quantization"] == "int8"


def test_worker_accepts_only_known_quantizations():
    runner = CliRunner()
    help_text = runner.invoke(cli, ["worker", "--help"]).output
    assert "--quantization" in help_text
    bad = runner.invoke(cli, ["worker", "--quantization", "int3"])
    assert bad.exit_code != 0 and "int3" in bad.output
