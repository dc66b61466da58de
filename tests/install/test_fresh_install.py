"""What a fresh install meets: Hugging Face's ``kernels`` (a dependency of transformers >= 5.25)
beside ours, loading with no network, and a wheel installed in a fresh venv that migrates and
runs the main job from another directory.

Each check runs a real interpreter in a subprocess, from the directory a user would be in:
the import-name clash depended on ``sys.path[0]`` (the current directory), which a test process
of its own cannot reset.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import sys
import sysconfig
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: Imports transformers' hub-kernels integration (which imports Hugging Face's ``kernels``),
#: our engine and our kernels in one process, then says where each came from.
BOTH_IMPORTS = """
import json, kernels, specbatch_kernels
import transformers.integrations.hub_kernels as hub
from transformers.utils.import_utils import is_kernels_available
from engine.llm_engine import LLMEngine
from engine.model_runner import ModelRunner
from specbatch_kernels import kernel_backend, paged_attention
print(json.dumps({"theirs": kernels.__file__, "ours": specbatch_kernels.__file__,
                  "theirs_has_mode": hasattr(kernels, "Mode"), "available": is_kernels_available(),
                  "backend": kernel_backend("cpu")}))
"""


def clean_env(**extra: str) -> dict[str, str]:
    """The user's environment: no PYTHONPATH pointing into the checkout."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env.update(extra)
    return env


def test_hugging_face_kernels_is_installed_beside_ours():
    """The install under test has the distribution that used to clash (transformers needs it)."""
    assert metadata.version("kernels"), "Hugging Face's kernels is not installed"
    requires = metadata.requires("transformers") or []
    from packaging.version import Version

    if Version(metadata.version("transformers")) >= Version("5.25"):
        assert any(r.startswith("kernels") and "extra ==" not in r for r in requires), requires


@pytest.mark.parametrize("where", ["repository root", "another directory"])
def test_their_kernels_and_ours_import_in_one_process(where, tmp_path):
    cwd = ROOT if where == "repository root" else tmp_path
    done = subprocess.run([sys.executable, "-c", BOTH_IMPORTS], cwd=cwd, env=clean_env(), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert not Path(seen["theirs"]).resolve().is_relative_to(ROOT), seen  # theirs, from site-packages
    assert seen["theirs_has_mode"] and seen["available"], seen
    assert Path(seen["ours"]).parent.name == "specbatch_kernels" and seen["backend"] == "torch", seen


def test_pytest_from_the_root_imports_their_kernels_too():
    """pytest's ``pythonpath`` puts the repository root first: the root must hold no ``kernels``
    package that would shadow theirs (transformers' first ``from kernels import …`` failed)."""
    import kernels

    assert not (ROOT / "kernels" / "__init__.py").exists()
    assert not Path(kernels.__file__).resolve().is_relative_to(ROOT), kernels.__file__
    assert hasattr(kernels, "Mode")


LOAD_OFFLINE = """
import json, socket, sys
try:
    socket.create_connection(("pypi.org", 443), timeout=5).close()
    reached = True
except OSError:
    reached = False
from engine import LLM, SamplingParams
llm = LLM(sys.argv[1], device="cpu", max_num_seqs=2)
out = llm.generate(["hello there"], SamplingParams(temperature=0, max_tokens=4))[0].outputs[0]
print(json.dumps({"reached": reached, "tokens": len(out.token_ids),
                  "use_kernels": bool(getattr(llm.engine.model, "use_kernels", False))}))
"""


def test_engine_loads_with_the_network_unreachable(tiny_model_dir, tmp_path):
    """In a network namespace of its own (no interface up), with no offline switch set, the
    engine loads and generates: nothing at load time reaches for the hub."""
    if shutil.which("unshare") is None or subprocess.run(["unshare", "-n", "true"]).returncode != 0:
        pytest.skip("`unshare -n` (a network namespace) is not permitted here: needs root or user namespaces")
    done = subprocess.run(["unshare", "-n", sys.executable, "-c", LOAD_OFFLINE, tiny_model_dir], cwd=tmp_path,
                          env=clean_env(), capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen == {"reached": False, "tokens": 4, "use_kernels": False}, seen


def test_every_model_load_turns_hub_kernels_off(tiny_model_dir):
    from engine.model_hub import load_causal_lm

    assert load_causal_lm(tiny_model_dir).use_kernels is False
    direct = "AutoModelForCausalLM" + ".from_pretrained("  # split: this file must not match itself
    offenders = [str(p.relative_to(ROOT)) for folder in ("engine", "worker", "bench", "tests")
                 for p in (ROOT / folder).rglob("*.py") if direct in p.read_text() and p.name != "model_hub.py"]
    assert not offenders, f"load models through engine.model_hub.load_causal_lm: {offenders}"


# ---------------------------------------------------------------- a wheel in a fresh venv


@pytest.fixture(scope="module")
def wheel_venv(tmp_path_factory) -> Path:
    """A fresh venv holding only the built wheel; the dependencies come from this environment's
    site-packages through a ``.pth`` line (whose own ``.pth`` files, the editable install's
    among them, are not processed), so nothing of the checkout is importable there."""
    from filelock import FileLock

    base = tmp_path_factory.mktemp("wheel")
    # pip builds a local tree in its ``build/`` folder: two test processes building at once (the
    # module's tests can land in two) raced there ("error: [Errno 2] No such file or directory").
    with FileLock(str(Path(tempfile.gettempdir()) / f"specbatch-wheel-build-{ROOT.name}.lock")):
        built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(base / "dist"),
                                str(ROOT)], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = (base / "dist").glob("specbatch-*.whl")
    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    purelib = Path(subprocess.check_output([str(venv / "bin" / "python"), "-c",
                                            "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                           text=True).strip())
    (purelib / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    installed = subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install",
                                "--no-deps", "-q", str(wheel)], capture_output=True, text=True, timeout=300)
    assert installed.returncode == 0, installed.stderr[-3000:]
    return venv


def test_a_wheel_holds_every_package_and_the_migrations(wheel_venv, tmp_path):
    where = subprocess.run([str(wheel_venv / "bin" / "python"), "-c", (
        "import json, engine, worker, specbatch_kernels, specbatch_migrations, kernels\n"
        "from worker.store.migrate import migrations_dir\n"
        "print(json.dumps({m.__name__: m.__file__ for m in (engine, worker, specbatch_kernels, specbatch_migrations,"
        " kernels)} | {'dir': str(migrations_dir())}))")],
        cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=120)
    assert where.returncode == 0, where.stderr[-3000:]
    files = json.loads(where.stdout)
    for name in ("engine", "worker", "specbatch_kernels", "specbatch_migrations"):
        assert Path(files[name]).resolve().is_relative_to(wheel_venv.resolve()), files
    assert sorted(p.name for p in (Path(files["dir"]) / "versions").glob("0*.py")) == \
        sorted(p.name for p in (ROOT / "migrations" / "versions").glob("0*.py"))
    assert not Path(files["kernels"]).resolve().is_relative_to(ROOT), files


def test_a_wheel_install_migrates_then_runs_the_main_job(wheel_venv, tmp_path):
    """`specbatch db upgrade` (the k8s migration Job) from another directory, then the main job
    on the default model with embedded Redis, as README's first command runs it."""
    specbatch = str(wheel_venv / "bin" / "specbatch")
    db = f"sqlite:///{tmp_path / 'wheel.db'}"
    env = clean_env(SPECBATCH_WORKER_LOG=str(tmp_path / "worker.log"))
    env.pop("REDIS_URL", None)
    env.pop("DATABASE_URL", None)
    upgraded = subprocess.run([specbatch, "--database-url", db, "db", "upgrade"], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=120)
    assert upgraded.returncode == 0, upgraded.stdout + upgraded.stderr
    import sqlalchemy

    with sqlalchemy.create_engine(db).connect() as conn:
        tables = set(sqlalchemy.inspect(conn).get_table_names())
        version = conn.execute(sqlalchemy.text("SELECT version_num FROM alembic_version")).scalar_one()
    assert {"batches", "jobs", "workers"} <= tables
    from worker.store.migrate import head_revision

    assert version == head_revision()

    prompts = tmp_path / "prompts.jsonl"
    shutil.copy(ROOT / "examples" / "prompts.jsonl", prompts)
    ran = subprocess.run([specbatch, "--database-url", db, "run", str(prompts), "-o", "out.jsonl"], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=400)
    log = (tmp_path / "worker.log").read_text() if (tmp_path / "worker.log").exists() else ""
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:] + log[-3000:]
    lines = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    inputs = [line for line in prompts.read_text().splitlines() if line.strip()]
    assert len(lines) == len(inputs) and all(row["response"] and not row.get("error") for row in lines)
