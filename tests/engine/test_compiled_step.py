"""The compiled CPU decode step (``compile_step=True``): the eager tokens at every batch size as
requests come and go, decode-only steps really go through it, models it cannot take and any
failure fall back to eager with one warning, and inductor's cache sits in the project's cache."""

from __future__ import annotations

import logging

import pytest
import torch

from engine import LLM, SamplingParams
from engine.compiled_step import CompiledDecode
from specbatch_kernels.cpu_ops import load_cpu_ops

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
    return tokens(LLM(tiny_model_dir, device="cpu", max_num_seqs=8))


@pytest.fixture(scope="module")
def compiled_llm(tiny_model_dir, tmp_path_factory):
    llm = LLM(tiny_model_dir, device="cpu", max_num_seqs=8, compile_step=True)
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
    assert {1, 3, 6} <= set(batches)  # batch 1 (its own graph) and the dynamic graph at several sizes
    assert compiled_llm.engine.runner.compiled is compiled  # nothing fell back


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
    llm = LLM(tiny_model_dir, device="cpu", max_num_seqs=8, compile_step=True)
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
        llm = LLM(tiny_model_dir, device="cpu", max_num_seqs=8, compile_step=True, fuse_layers=False)
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
    want = tokens(LLM(other, device="cpu", max_num_seqs=8))
    llm = LLM(other, device="cpu", max_num_seqs=8, compile_step=True)
    assert tokens(llm) == want
    assert llm.engine.runner.compiled is not None
