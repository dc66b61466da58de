"""Smoke test of an install made with the newest versions pyproject.toml allows (no lock).

README installs with ``constraints.txt``, the versions CI last passed with, so a new release of a
dependency cannot break its commands; this run is how such a release is seen the day it
appears. It imports everything a worker imports (Hugging Face's ``kernels`` beside ours), loads
a tiny random model through the engine offline, generates greedily and compares with HF
``generate``, and migrates a SQLite store. On failure it names the distribution the error was
raised in and every installed version that differs from the lock.

    python .ci/smoke.py [constraints.txt]
"""

from __future__ import annotations

import importlib.util
import re
import sys
import sysconfig
import tempfile
import traceback
from importlib import metadata
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def smoke(workdir: Path) -> None:
    import kernels  # noqa: F401  (Hugging Face's; transformers >= 5.25 needs it)
    import torch
    import transformers.integrations.hub_kernels  # noqa: F401

    import specbatch_kernels  # noqa: F401
    import worker.dispatch.app  # noqa: F401  (Celery app, kombu, redis)
    import worker.api.cli  # noqa: F401
    from engine import LLM, SamplingParams
    from engine.model_hub import load_causal_lm
    from worker.store.store import Store

    path = str(tiny_models().make_tiny_model(workdir / "tiny", logit_scale=8.0))
    prompt = "The quick brown fox"
    got = LLM(path, device="cpu", dtype="float32", max_num_seqs=4).generate([prompt], SamplingParams(temperature=0, max_tokens=12))
    ours = list(got[0].outputs[0].token_ids)
    hf = load_causal_lm(path, dtype=torch.float32).eval()
    ids = torch.tensor([got[0].prompt_token_ids])
    want = hf.generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1]:].tolist()
    assert ours == want[: len(ours)] and len(ours) > 0, f"greedy tokens differ from HF generate: {ours} vs {want}"
    Store(f"sqlite:///{workdir / 'smoke.db'}")  # creates and migrates the schema
    print(f"smoke ok: {len(ours)} greedy tokens equal to HF generate; store migrated")


def tiny_models() -> ModuleType:
    """The tests' tiny-model helper (``tests/helpers/tiny_models.py``), loaded from the checkout
    by its path: it is not installed, this runs from another directory, and a dependency that
    ships a top-level ``tests`` package must not hide it."""
    path = ROOT / "tests" / "helpers" / "tiny_models.py"
    spec = importlib.util.spec_from_file_location("specbatch_tiny_models", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def locked(constraints: Path) -> dict[str, str]:
    pins = {}
    for line in constraints.read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9_.\-]+)==([^\s;#]+)", line.strip())
        if m:
            pins[_norm(m.group(1))] = m.group(2)
    return pins


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def drift(pins: dict[str, str]) -> list[str]:
    """Installed distributions whose version is not the locked one (or that the lock lacks)."""
    out = []
    for dist in metadata.distributions():
        name = _norm(dist.metadata["Name"] or "")
        if name in ("specbatch", "pip", "setuptools", "wheel"):
            continue
        have, want = dist.version, pins.get(name)
        if want is None:
            out.append(f"{name} {have} (not in the lock)")
        elif have.split("+")[0] != want.split("+")[0]:
            out.append(f"{name} {want} -> {have}")
    return sorted(out)


def culprit(tb: traceback.StackSummary) -> str | None:
    """The distribution whose code raised: the deepest frame inside site-packages."""
    site = Path(sysconfig.get_paths()["purelib"]).resolve()
    owners = metadata.packages_distributions()
    for frame in reversed(tb):
        try:
            rel = Path(frame.filename).resolve().relative_to(site)
        except ValueError:
            continue
        top = rel.parts[0].removesuffix(".py")
        dists = owners.get(top)
        if dists:
            return f"{', '.join(sorted(set(dists)))} {metadata.version(dists[0])} ({frame.filename}:{frame.lineno})"
    return None


def main() -> int:
    constraints = Path(sys.argv[1] if len(sys.argv) > 1 else ROOT / "constraints.txt")
    pins = locked(constraints)
    changed = drift(pins)
    print("newest allowed versions differing from the lock:", "; ".join(changed) or "none")
    try:
        with tempfile.TemporaryDirectory() as tmp:
            smoke(Path(tmp))
    except BaseException as exc:  # noqa: BLE001  (report anything, then fail)
        traceback.print_exc()
        where = culprit(traceback.extract_tb(exc.__traceback__))
        print(f"SMOKE FAILED with the newest allowed versions: {type(exc).__name__}: {exc}")
        print(f"  raised in: {where or 'our own code (see the traceback)'}")
        print(f"  changed since the lock: {'; '.join(changed) or 'nothing'}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
