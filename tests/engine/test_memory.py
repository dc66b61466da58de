"""Memory accounting: the KV cache is sized for the batch, weights are held once, the start reports both."""

import logging
import sys

from safetensors import safe_open

from engine.cpu_linear import PackedLinear
from engine import LLMEngine
from engine.config import EngineConfig
from engine.memory import CPU_TOKENS_PER_SEQ, default_cpu_kv_blocks, tensor_bytes
from tests.helpers.tiny_models import make_tiny_model


def test_default_kv_blocks_follow_the_batch_and_the_free_memory():
    per_block = 1000
    # 8 sequences of a typical length (plus a block of slack each).
    typical = CPU_TOKENS_PER_SEQ // 16 + 1
    assert default_cpu_kv_blocks(per_block, 16, 8, 4096, None) == 8 * typical
    # Short contexts need less per sequence.
    assert default_cpu_kv_blocks(per_block, 16, 8, 64, None) == 8 * 5
    # One sequence of the full context always fits when memory allows.
    assert default_cpu_kv_blocks(per_block, 16, 1, 4096, None) == 4096 // 16 + 1
    # Never more than the fraction of the available memory.
    assert default_cpu_kv_blocks(per_block, 16, 8, 4096, available=100_000) == 50


def _checkpoint_bytes(path) -> int:
    """Bytes of every tensor in the (float32) checkpoint, read from its header."""
    total = 0
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        for key in f.keys():
            tensor_slice = f.get_slice(key)
            assert tensor_slice.get_dtype() == "F32"
            numel = 1
            for dim in tensor_slice.get_shape():
                numel *= dim
            total += 4 * numel
    return total


def test_start_reports_the_breakdown_and_holds_the_weights_once(tmp_path, caplog):
    path = make_tiny_model(tmp_path / "tiny")
    with caplog.at_level(logging.INFO, logger="engine.memory"):
        engine = LLMEngine(EngineConfig(model=str(path), device="cpu", dtype="float32", max_num_seqs=4))
    lines = [r.getMessage() for r in caplog.records if r.name == "engine.memory"]
    assert len(lines) == 1 and "weights" in lines[0] and "KV cache" in lines[0]
    mem = engine.memory
    kv_allocated = sum(t.numel() * t.element_size() for pair in engine.runner.kv_caches for t in pair)
    assert mem.kv_cache_bytes == kv_allocated
    assert mem.num_blocks == engine.block_manager.num_blocks
    assert f"{mem.num_blocks} blocks, {mem.num_blocks * 16} tokens" in lines[0]
    # Fused and prepacked, the model holds exactly the checkpoint's bytes (plus its rotary tables
    # and the zero rows that pad packed weights to whole blocks): no original kept beside a fused
    # or packed copy.
    buffers = sum(b.numel() * b.element_size() for b in engine.model.buffers())
    padding = sum((m.small_weight.numel() - m.out_features * m.in_features) * m.small_weight.element_size()
                  for m in engine.model.modules() if isinstance(m, PackedLinear) and m.small_weight is not None)
    assert 0 <= padding < _checkpoint_bytes(path) // 10
    assert mem.weights_bytes == tensor_bytes(engine.model) == _checkpoint_bytes(path) + buffers + padding
    if sys.platform.startswith("linux"):
        # ... and the checkpoint's memory map is gone (its touched pages were a second copy).
        with open("/proc/self/maps") as f:
            assert str(path) not in f.read()


def test_explicit_kv_cache_memory_bytes_wins(tiny_model_dir):
    per_block = 2 * 2 * 16 * 2 * 16 * 4  # K and V, 2 layers, 16 tokens, 2 KV heads of 16, float32
    config = EngineConfig(model=tiny_model_dir, device="cpu", dtype="float32", max_num_seqs=1,
                          kv_cache_memory_bytes=per_block * 5000)
    engine = LLMEngine(config)
    assert engine.runner.bytes_per_block == per_block
    # Far more than one sequence could use: the user's budget still decides.
    assert engine.block_manager.num_blocks == 5000 > default_cpu_kv_blocks(per_block, 16, 1, 2048, None)
