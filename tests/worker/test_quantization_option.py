"""``specbatch worker --quantization int8`` (or ``SPECBATCH_QUANTIZATION``) reaches the engine's
config as one keyword."""

from click.testing import CliRunner

from worker.api.cli import cli
from worker.common.config import Settings
from worker.run.runtime import engine_kwargs


def test_quantization_setting_becomes_an_engine_kwarg(monkeypatch):
    monkeypatch.delenv("SPECBATCH_QUANTIZATION", raising=False)
    assert "quantization" not in engine_kwargs(Settings())  # default: exact
    assert engine_kwargs(Settings(quantization="int8"))["quantization"] == "int8"
    monkeypatch.setenv("SPECBATCH_QUANTIZATION", "int8")
    assert engine_kwargs(Settings())["quantization"] == "int8"


def test_worker_accepts_only_known_quantizations():
    runner = CliRunner()
    help_text = runner.invoke(cli, ["worker", "--help"]).output
    assert "--quantization" in help_text
    bad = runner.invoke(cli, ["worker", "--quantization", "int3"])
    assert bad.exit_code != 0 and "int3" in bad.output
