"""Captured decode: padded persistent buffers compute what the eager step computes, a failing
capture falls back to eager for good, and on CUDA the replayed graphs give the eager tokens."""

import pytest
import torch

from engine import LLM, SamplingParams
from engine.decode_graphs import DecodeGraphs

# Three prompts: the decode batch of 3 is padded to the captured size 4.
PROMPTS = ["hello there", "the cat sat on the", "1 2 3 4 5"]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def tokens(llm: LLM, prompts=PROMPTS) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def eager_tokens(tiny_model_dir):
    return tokens(LLM(tiny_model_dir, device="cpu", max_num_seqs=8, decode_capture=False))


def with_static_graphs(tiny_model_dir) -> LLM:
    llm = LLM(tiny_model_dir, device="cpu", max_num_seqs=8)
    runner = llm.engine.runner
    assert runner.graphs is None  # the CPU never captures by default
    runner.graphs = DecodeGraphs(runner, 8, llm.engine.max_model_len, static=True)
    return llm


def test_padded_static_decode_gives_the_eager_tokens(tiny_model_dir, eager_tokens):
    llm = with_static_graphs(tiny_model_dir)
    calls = []
    run = llm.engine.runner.graphs.run
    llm.engine.runner.graphs.run = lambda inputs: calls.append(inputs.input_ids.shape[0]) or run(inputs)
    assert tokens(llm) == eager_tokens
    assert 3 in calls  # the batch of 3 went through the buffers padded to 4
    assert tokens(llm, PROMPTS[:1]) == eager_tokens[:1]  # batch 1


def decode_logits(llm: LLM) -> list[torch.Tensor]:
    seen = []
    llm.engine.logits_hook = lambda sched, inputs, logits: seen.append((inputs.metadata.max_query_len, logits.clone()))
    llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    return [logits for q, logits in seen if q == 1]


def test_padded_logits_equal_eager_logits(tiny_model_dir):
    eager = decode_logits(LLM(tiny_model_dir, device="cpu", max_num_seqs=8, decode_capture=False))
    padded = decode_logits(with_static_graphs(tiny_model_dir))
    assert len(padded) == len(eager) >= 5
    for got, want in zip(padded, eager):
        assert got.shape == want.shape == (3, want.shape[1])
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_failing_capture_falls_back_to_eager_for_good(tiny_model_dir, eager_tokens, caplog):
    llm = with_static_graphs(tiny_model_dir)
    graphs = llm.engine.runner.graphs

    def broken(size):
        raise RuntimeError("forced capture failure")

    graphs._forward = broken
    with caplog.at_level("WARNING"):
        assert tokens(llm) == eager_tokens
    assert llm.engine.runner.graphs is None
    assert "forced capture failure" in caplog.text
    assert "decode eager" in llm.engine.runner.describe()


def test_cuda_graph_decode_matches_eager(tiny_model_dir):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA on this machine: CUDA-graph decode is not exercised here; the CPU path ran "
                    "(the static-buffer and fallback tests above); bench/gpu_check.sh runs this on a GPU")
    eager = LLM(tiny_model_dir, device="cuda", dtype="float32", max_num_seqs=8, decode_capture=False)
    captured = LLM(tiny_model_dir, device="cuda", dtype="float32", max_num_seqs=8)
    want = tokens(eager)
    assert tokens(captured) == want
    assert tokens(captured, PROMPTS[:1]) == want[:1]
    graphs = captured.engine.runner.graphs
    assert graphs is not None and graphs.graphs, "no graph was captured (did capture fail and fall back?)"
