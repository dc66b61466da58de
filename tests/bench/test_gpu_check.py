"""The GPU check's dry mode runs end to end on the CPU (tiny shapes, Triton interpreted), so the
driver a lent GPU will run cannot rot between GPU sessions; and its offline pieces (GGUF parts,
carried wheels) do what they claim."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import zipfile
from pathlib import Path

from bench.gpu_check import BUDGET_S, PLAN, use_wheels
from bench.gpu_models import reassemble

ROOT = Path(__file__).resolve().parents[2]


def test_dry_run_passes_every_stage_within_its_limit(tmp_path):
    proc = subprocess.run([sys.executable, "bench/gpu_check.py", "--dry", "--out", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=400)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["dry"] is True
    assert sum(limit for _, limit, _ in PLAN) <= BUDGET_S <= 9 * 60
    for name, limit, _ in PLAN:
        record = report["stages"][name]
        assert record["status"] == "ok", (name, record)
        assert record["limit_s"] == limit and 0 <= record["elapsed_s"] <= limit
        assert f"=== {name} (limit {limit} s)" in log  # every stage shows its limit
        assert record["summary"], name  # and has lines in the closing table
    stages = report["stages"]
    for run in stages["parity"]["runs"].values():  # sharp random models: every token equals HF's
        assert run["identical"] == run["prompts"] and not run["divergences"]
    for model in stages["throughput"]["models"].values():
        for mode in ("graphs", "eager", "hf_static"):
            assert set(model[mode]) == {"1", "3"}
    assert all(run["identical_to_none"] == 4 for run in stages["speculation"]["runs"].values())
    assert stages["speculation"]["runs"]["ngram k=4"]["draft_tokens"] > 0
    assert stages["priority"]["bulk_mixed_tok_s"] > 0
    assert stages["kv_memory"]["models"]["llama-8b"]["full_batch_ok"]
    assert log.rstrip().endswith("gpu_check: all stages ok")
    assert log.index("stage        status") > log.index("=== kv_memory ok")  # the table comes last


def write_parts(folder: Path, data: bytes, checksum: str | None) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "part-1").write_bytes(data[:5])
    (folder / "part-2").write_bytes(data[5:])
    if checksum is not None:
        (folder / "SHA256").write_text(f"{checksum}  model.gguf\n")


def test_parts_from_two_folders_are_joined_when_the_checksum_matches(tmp_path):
    data = b"GGUF-0123456789"
    write_parts(tmp_path / "a", data, hashlib.sha256(data).hexdigest())
    (tmp_path / "a" / "part-2").rename(tmp_path / "b-part-2")
    (tmp_path / "b").mkdir()
    (tmp_path / "b-part-2").rename(tmp_path / "b" / "part-2")  # the second call's carry
    target = tmp_path / "out" / "model.gguf"
    assert "checksum ok" in reassemble([tmp_path / "a", tmp_path / "b"], target)
    assert target.read_bytes() == data
    assert "present, checksum ok" in reassemble([tmp_path / "a", tmp_path / "b"], target)


def test_parts_with_a_wrong_checksum_or_none_are_not_used(tmp_path):
    data = b"GGUF-0123456789"
    write_parts(tmp_path / "bad", data, hashlib.sha256(b"other").hexdigest())
    target = tmp_path / "model.gguf"
    assert "not used" in reassemble([tmp_path / "bad"], target)
    assert not target.exists() and not target.with_name("model.gguf.part").exists()
    write_parts(tmp_path / "nosum", data, None)
    assert "no SHA256" in reassemble([tmp_path / "nosum"], target) and not target.exists()
    assert reassemble([tmp_path / "missing"], target) == "no parts found"


def test_a_carried_wheel_is_used_only_where_the_machine_lacks_its_package(tmp_path, monkeypatch):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    with zipfile.ZipFile(wheels / "gpu_check_probe_pkg-1.0-py3-none-any.whl", "w") as zf:
        zf.writestr("gpu_check_probe_pkg/__init__.py", "VALUE = 42\n")
        zf.writestr("gpu_check_probe_pkg-1.0.dist-info/METADATA", "Name: gpu_check_probe_pkg\nVersion: 1.0\n")
    with zipfile.ZipFile(wheels / "pytest-0.0-py3-none-any.whl", "w") as zf:  # the machine has pytest
        zf.writestr("pytest/__init__.py", "raise ImportError('the carried copy must not be used')\n")
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("PYTHONPATH", "")
    used = use_wheels(wheels, tmp_path / "site")
    assert used["gpu_check_probe_pkg"].startswith("wheel ") and used["pytest"].startswith("machine ")
    assert not (tmp_path / "site" / "pytest").exists()
    import gpu_check_probe_pkg

    assert gpu_check_probe_pkg.VALUE == 42
    sys.modules.pop("gpu_check_probe_pkg")
