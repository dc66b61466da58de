"""The compiled CPU decode step (``compile_step=True``): the eager tokens at every batch size as
requests come and go, decode-only steps really go through it, models it cannot take and any
failure fall back to eager with one warning, inductor's cache sits in the project's cache, and a
later start loads the graph the first one saved."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.compiled_step import CompiledDecode
from specbatch_kernels.cpu_ops import load_cpu_ops

ROOT = Path(__file__).resolve().parents[2]

@pytest.fixture(autouse=True, scope="module")
def _cpu_ops_built():
    """This project's machines and CI have a C++ compiler: an op that does not build is a failure."""
    assert load_cpu_ops(), "the specbatch CPU ops did not build (see the log above)"

PROMPTS = ["hello there", "the cat sat on the", "1 2 3 4 5", "a", "zzz zzz", "once upon a time"]


def tokens(llm: LLM, prompts=PROMPTS, max_tokens: int = 12) -> list[list[int]]:
    # Lengths differ per request so the decode batch shrinks as they finish (batch 6 down to 1).
    params = [SamplingParams(temperature=0, max_tokens=max_tokens - i, ignore_eos=True) for i in range(len(prompts))]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def eager_tokens(tiny_model_dir):
    return tokens(LLM(tiny_model_dir, device="cpu", dtype="float32", max_num_seqs=8))


@pytest.fixture(scope="module")
def compiled_llm(tiny_model_dir, tmp_path_factory):
    llm = LLM(tiny_model_dir, device="cpu", dtype="float32", max_num_seqs=8, compile_step=True)
    assert isinstance(llm.engine.runner.compiled, CompiledDecode), "the compiled step did not start"
    return llm


def test_compiled_decode_gives_the_eager_tokens(compiled_llm, eager_tokens):
    compiled = compiled_llm.engine.runner.compiled
    batches: list[int] = []
    run = compiled.run
    compiled.run = lambda inputs: batches.append(inputs.input_ids.shape[0]) or run(inputs)
    try:
        assert tokens(compiled_llm) == eager_tokens
        assert tokens(compiled_llm, PROMPTS[:1]) == eager_tokens[:1]
    finally:
        del compiled.run
    assert {1, 3, 6} <= set(batches)  # the dynamic graph at several sizes, batch 1 included
    assert compiled_llm.engine.runner.compiled is compiled  # nothing fell back


def test_one_graph_serves_batch_one_and_every_other_size(tiny_model_dir):
    """Batch 1 runs unpadded in the warm-up's graph: no graph traced after the warm-up."""
    from torch._dynamo.utils import counters

    llm = LLM(tiny_model_dir, device="cpu", dtype="float32", max_num_seqs=8, compile_step=True)
    graphs = counters["stats"]["unique_graphs"]  # the warm-up's graph (or an earlier one it reuses)
    batches: list[int] = []
    run = llm.engine.runner.compiled.run
    llm.engine.runner.compiled.run = lambda inputs: batches.append(inputs.input_ids.shape[0]) or run(inputs)
    tokens(llm)  # batches 6 down to 1
    assert {1, 2, 6} <= set(batches) and llm.engine.runner.compiled is not None
    assert counters["stats"]["unique_graphs"] == graphs and not counters["recompiles"]


def test_int8_runs_compiled_with_the_eager_int8_tokens(tiny_model_dir):
    """int8 linears are called by handle from the graph (quantized::linear_dynamic, as eager), and
    batch 1 has no padding row that could move the per-call activation scale."""
    want = tokens(LLM(tiny_model_dir, device="cpu", dtype="float32", max_num_seqs=8, quantization="int8"))
    llm = LLM(tiny_model_dir, device="cpu", dtype="float32", max_num_seqs=8, quantization="int8", compile_step=True)
    compiled = llm.engine.runner.compiled
    assert isinstance(compiled, CompiledDecode), "the int8 model did not take the compiled step"
    runs = []
    run = compiled.run
    compiled.run = lambda inputs: runs.append(1) or run(inputs)
    try:
        assert tokens(llm) == want
    finally:
        del compiled.run
    assert runs and llm.engine.runner.compiled is compiled


def test_compiled_logits_match_eager_logits(compiled_llm):
    runner = compiled_llm.engine.runner
    compiled = runner.compiled
    run = compiled.run
    diffs: list[float] = []

    def checked(inputs):
        got = run(inputs)
        want = runner.forward_eager(inputs)  # writes its own K/V into the same slots
        diffs.append(float((got - want).abs().max()))
        return got

    compiled.run = checked
    try:
        tokens(compiled_llm, PROMPTS[:4], max_tokens=6)
    finally:
        del compiled.run
    assert diffs and max(diffs) < 1e-4


def test_failure_falls_back_to_eager_once(tiny_model_dir, eager_tokens, caplog):
    llm = LLM(tiny_model_dir, device="cpu", dtype="float32", max_num_seqs=8, compile_step=True)
    calls = []

    def broken(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("forced compile failure")

    llm.engine.runner.compiled.compiled = broken
    with caplog.at_level(logging.WARNING, logger="engine.model_runner"):
        assert tokens(llm) == eager_tokens
    assert len(calls) == 1 and llm.engine.runner.compiled is None
    assert sum("compiled decode step failed" in r.message for r in caplog.records) == 1


def test_unsupported_model_runs_eagerly_with_one_warning(tiny_model_dir, eager_tokens, caplog):
    with caplog.at_level(logging.WARNING, logger="engine.model_runner"):
        llm = LLM(tiny_model_dir, device="cpu", dtype="float32", max_num_seqs=8, compile_step=True, fuse_layers=False)
    assert llm.engine.runner.compiled is None
    assert sum("compile_step:" in r.message for r in caplog.records) == 1
    assert tokens(llm) == eager_tokens


def test_inductor_cache_in_the_project_cache(compiled_llm):
    import os

    from engine.model_hub import cache_dir

    assert os.environ["TORCHINDUCTOR_CACHE_DIR"].startswith(str(cache_dir()))


def test_a_second_model_in_the_process_gets_its_own_graph(compiled_llm, tmp_path):
    """The graph calls packed weights by handle: another model of the same shapes must never run
    the first one's graph (its handles are guarded, so it compiles its own)."""
    from tests.helpers.tiny_models import make_tiny_model

    other = str(make_tiny_model(tmp_path / "other", seed=5, logit_scale=8.0))
    tokens(compiled_llm)  # the first model's graph exists and is warm
    want = tokens(LLM(other, device="cpu", dtype="float32", max_num_seqs=8))
    llm = LLM(other, device="cpu", dtype="float32", max_num_seqs=8, compile_step=True)
    assert tokens(llm) == want
    assert llm.engine.runner.compiled is not None


_START = """
import json, sys
from torch._dynamo.utils import counters
from engine import LLM, SamplingParams
llm = LLM(sys.argv[1], device="cpu", dtype="float32", max_num_seqs=8, compile_step=True)
compiled = llm.engine.runner.compiled
params = [SamplingParams(temperature=0, max_tokens=8 - i, ignore_eos=True) for i in range(4)]
outs = llm.generate(["hello there", "the cat sat on the", "1 2 3 4 5", "a"], params, use_tqdm=False)
print(json.dumps({"compiled": compiled is not None and llm.engine.runner.compiled is compiled,
                  "loaded": compiled.loaded, "saved": compiled.saved, "artifact": str(compiled.artifact),
                  "traced": counters["stats"]["unique_graphs"], "describe": compiled.describe(),
                  "tokens": [o.outputs[0].token_ids for o in outs]}))
"""


def _start(model: str, cache: Path) -> dict:
    """An engine start in a fresh process (as a worker's), its decode step compiled, over the
    project cache ``cache`` (its C++ ops and inductor's caches those of this machine's cache)."""
    from engine.compiled_step import use_cache_dir
    from engine.model_hub import cache_dir

    if not (cache / "cpu_ops").exists():
        cache.mkdir(parents=True, exist_ok=True)
        (cache / "cpu_ops").symlink_to(cache_dir() / "cpu_ops", target_is_directory=True)
    env = dict(os.environ, SPECBATCH_CACHE_DIR=str(cache), TORCHINDUCTOR_CACHE_DIR=use_cache_dir(cache_dir()))
    done = subprocess.run([sys.executable, "-c", _START, model], env=env, capture_output=True, text=True,
                          timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_later_start_loads_the_saved_graph_without_tracing(tiny_model_dir, tmp_path):
    """The first start compiles the graph ahead of time and saves it in the project cache; the
    next process loads it (dynamo traces nothing) and gives the eager tokens."""
    want = tokens(LLM(tiny_model_dir, device="cpu", dtype="float32", max_num_seqs=8), PROMPTS[:4], max_tokens=8)
    first = _start(tiny_model_dir, tmp_path / "cache")
    assert first["compiled"] and first["saved"] and not first["loaded"] and first["traced"] >= 1
    artifact = Path(first["artifact"])
    assert artifact.is_file() and artifact.parent == tmp_path / "cache" / "compiled_step"
    assert first["tokens"] == want

    second = _start(tiny_model_dir, tmp_path / "cache")
    assert second["compiled"] and second["loaded"] and second["traced"] == 0, second
    assert "loaded from its saved graph" in second["describe"]
    assert second["tokens"] == want


def test_a_saved_graph_that_does_not_load_is_reported_and_compiled_again(tmp_path, caplog):
    from engine.compiled_artifact import load
    from engine.compiled_step import DecodeModule

    cut = tmp_path / "cut.bin"
    cut.write_bytes(b"\x80\x04not a whole file")  # cut short, as by a full disk
    with caplog.at_level(logging.WARNING, logger="engine.compiled_artifact"):
        assert load(cut, DecodeModule.forward) is None  # warm_up then compiles and replaces it
        assert load(tmp_path / "none.bin", DecodeModule.forward) is None  # none yet: no warning
    assert [r.message for r in caplog.records if "did not load" in r.message and str(cut) in r.message]
    assert len(caplog.records) == 1


def test_the_saved_graph_is_named_by_all_it_bakes_in(tiny_model_dir, tmp_path):
    """Another model of the same shapes shares the file (weights are read at each call, and the
    second-model test above checks its tokens); a model whose graph differs (another rotary
    base: its frequencies are baked in) or another weights mode never does."""
    from engine.compiled_artifact import artifact_path
    from engine.compiled_step import DecodeModule
    from tests.helpers.tiny_models import make_tiny_model

    def path_of(model_dir, mode="packed"):
        llm = LLM(model_dir, device="cpu", dtype="float32", max_num_seqs=8)
        return artifact_path(tmp_path, DecodeModule(llm.engine.runner.model, mode), (mode,))

    def edited(name: str, edit) -> str:
        path = make_tiny_model(tmp_path / name, logit_scale=8.0)
        config = json.loads((path / "config.json").read_text())
        edit(config)
        (path / "config.json").write_text(json.dumps(config))
        return str(path)

    same_shapes = str(make_tiny_model(tmp_path / "same", seed=5, logit_scale=8.0))
    other_rope = edited("rope", lambda c: c["rope_parameters"].update(rope_theta=500.0))
    other_eps = edited("eps", lambda c: c.update(rms_norm_eps=1e-3))
    assert path_of(tiny_model_dir) == path_of(same_shapes)
    assert path_of(other_rope) != path_of(tiny_model_dir)
    assert path_of(other_eps) != path_of(tiny_model_dir)
    assert path_of(tiny_model_dir, "frozen") != path_of(tiny_model_dir)


def test_the_saved_graph_is_named_by_the_inputs_it_was_traced_for(tiny_model_dir, tmp_path):
    """The block table's width (the context bound) and the KV block size are static in the graph:
    an engine with another bound or block size never loads a graph traced for this one's."""
    def path_of(**config):
        llm = LLM(tiny_model_dir, device="cpu", dtype="float32", max_num_seqs=8, **config)
        return CompiledDecode(llm.engine.runner, 8, llm.engine.max_model_len, tmp_path).artifact

    assert path_of(max_model_len=256) == path_of(max_model_len=256)
    assert path_of(max_model_len=512) != path_of(max_model_len=256)
    assert path_of(max_model_len=256, block_size=32) != path_of(max_model_len=256)
