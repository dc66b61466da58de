"""Models for the GPU check: real shapes with random weights made on the device, or the real
SmolLM2 when its GGUF arrived in parts.

Why random weights: a lent GPU has no network and each call carries at most 64 MiB, so an 8B
checkpoint can never arrive; its *shape* is what decides speed and memory. Weights are drawn
on the device from a seeded generator (seconds for 8B), the final norm is scaled up so the
output distribution is sharp (greedy parity then compares clear choices, not near-ties), and a
word-level tokenizer covers the whole vocabulary (ids ``w0 .. wN``).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
#: Where ``bench/gpu_prepare.py`` puts the GGUF parts and the wheels (both ignored by git).
PARTS_DIR = ROOT / ".gpu-model"
WHEELS_DIR = ROOT / ".whl"
#: Parts carried by an earlier call may have been moved here (outside the copied tree).
PARTS_HOME = Path(os.environ.get("SPECBATCH_CACHE_DIR", Path.home() / ".cache" / "specbatch")) / "gpu-parts"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class Shape:
    """A Llama-family architecture (no weights)."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tied: bool
    max_positions: int = 8192

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def params(self) -> int:
        """Parameters, tied embeddings counted once (the bytes a decode step reads)."""
        attn = self.hidden * self.head_dim * (self.heads * 2 + self.kv_heads * 2)
        mlp = 3 * self.hidden * self.intermediate
        norms = (2 * self.layers + 1) * self.hidden
        embed = self.vocab * self.hidden * (1 if self.tied else 2)
        return self.layers * (attn + mlp) + norms + embed

    def kv_bytes_per_token(self, itemsize: int) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * itemsize


# SmolLM2-135M, Llama-3.2-1B and Llama-3.1-8B (their config.json values).
SHAPES = {
    "smollm2-135m": Shape("smollm2-135m", 576, 30, 9, 3, 1536, 49152, True),
    "llama-1b": Shape("llama-1b", 2048, 16, 32, 8, 8192, 128256, True),
    "llama-8b": Shape("llama-8b", 4096, 32, 32, 8, 14336, 128256, False),
}
# Dry mode: the same code over tiny shapes (CPU, Triton interpreted).
DRY_SHAPES = {
    "smollm2-135m": Shape("smollm2-135m", 64, 2, 4, 2, 128, 384, True, 1024),
    "llama-1b": Shape("llama-1b", 64, 3, 4, 2, 160, 384, True, 1024),
    "llama-8b": Shape("llama-8b", 128, 2, 4, 2, 256, 384, False, 1024),
}

SHARPEN = 4.0  # final-norm scale: logits' spread grows 4x, so a random model's top choice is clear


def word_tokenizer(vocab: int):
    """A tokenizer whose ids ``0 .. vocab-1`` are the words ``w0 .. w{vocab-1}``; EOS is the last."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {f"w{i}": i for i in range(vocab)}
    backend = Tokenizer(models.WordLevel(vocab=words, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.Metaspace(replacement=" ", prepend_scheme="never")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=f"w{vocab - 1}",
                                        pad_token=f"w{vocab - 2}", unk_token="w0")
    return tokenizer


def hf_config(shape: Shape):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim, max_position_embeddings=shape.max_positions, rope_theta=500000.0,
        tie_word_embeddings=shape.tied, bos_token_id=None, eos_token_id=shape.vocab - 1,
        pad_token_id=shape.vocab - 2,
    )


@torch.no_grad()
def random_model(shape: Shape, dtype: torch.dtype, device: str | torch.device, seed: int = 0):
    """transformers' Llama of ``shape`` with seeded N(0, 0.02) weights drawn on ``device``.

    The same seed gives the same weights in any dtype (drawn in fp32, then cast), so an fp32
    and a bf16 copy are the same model.
    """
    from transformers import LlamaForCausalLM

    device = torch.device(device)
    with torch.device(device):
        model = LlamaForCausalLM._from_config(hf_config(shape), dtype=dtype)
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(SHARPEN if name == "model.norm.weight" else 1.0)
        else:
            draw = torch.empty(param.shape, dtype=torch.float32, device=device).normal_(0.0, 0.02, generator=gen)
            param.copy_(draw)
            del draw
    model.generation_config.eos_token_id = shape.vocab - 1
    model.generation_config.pad_token_id = shape.vocab - 2
    return model.eval().requires_grad_(False)


def engine_over(model, tokenizer, device: str | torch.device, **config):
    """An ``LLM`` over an already-built model (prepared in place: fused, our attention)."""
    from engine import LLM
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.loader import prepare_model

    engine_config = EngineConfig(model=model.config.name_or_path or "random", device=device,
                                 dtype=next(model.parameters()).dtype, **config)
    prepared = prepare_model(model, engine_config.device, engine_config.fuse_layers, engine_config.quantization)
    return LLM.from_engine(LLMEngine(engine_config, model=prepared, tokenizer=tokenizer))


# ------------------------------------------------------------------ the real SmolLM2, in parts
def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def reassemble(parts_dirs: list[Path], target: Path) -> str:
    """Join ``part-*`` files (sorted by name) into ``target`` if their SHA256 matches ``SHA256``.

    Returns a one-line account. The parts may be spread over several folders (one call's
    carry each); the checksum file may be in any of them. A mismatch writes nothing.
    """
    parts: dict[str, Path] = {}
    expected = None
    for folder in parts_dirs:
        if not folder.is_dir():
            continue
        for path in folder.glob("part-*"):
            parts.setdefault(path.name, path)
        if (folder / "SHA256").is_file():
            expected = (folder / "SHA256").read_text().split()[0]
    if target.is_file() and expected and sha256_of(target) == expected:
        return f"present, checksum ok ({target})"
    if not parts:
        return "no parts found"
    if expected is None:
        return f"{len(parts)} part(s) but no SHA256 file: not used"
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".part")
    with open(tmp, "wb") as out:
        for name in sorted(parts):
            out.write(parts[name].read_bytes())
    got = sha256_of(tmp)
    if got != expected:
        tmp.unlink()
        return f"{len(parts)} part(s) ({', '.join(sorted(parts))}) give sha256 {got[:12]}, expected {expected[:12]}: not used"
    os.replace(tmp, target)
    return f"reassembled from {len(parts)} parts, checksum ok"


def real_smollm2() -> tuple[str | None, str]:
    """(safetensors directory or None, account): the real SmolLM2 where its GGUF is here or in parts.

    Never downloads: converting needs only the ``gguf`` package (the machine's or a carried wheel).
    """
    from engine import model_hub

    gguf = model_hub.cache_dir() / "gguf" / GGUF_NAME
    account = reassemble([PARTS_DIR, PARTS_HOME], gguf)
    if not gguf.is_file():
        return None, f"real SmolLM2: GGUF {account}"
    try:
        return str(model_hub.convert_gguf(gguf, model_hub.cache_dir() / "models" / model_hub.DEFAULT_MODEL)), \
            f"real SmolLM2: GGUF {account}, converted"
    except Exception as exc:  # e.g. no gguf package: the random-weight shape stands in
        return None, f"real SmolLM2: GGUF {account}, conversion failed ({type(exc).__name__}: {exc})"
