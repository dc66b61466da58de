"""A short greedy generation through the Triton kernels (interpreted on the CPU) gives the same
tokens as through the torch references, and so does a seeded sampled one with n-gram
speculation (the coupled sampling kernel samples every row, drafts' verification included).

The engine picks its kernels once, from ``specbatch_kernels.kernel_backend(device)`` when the model runner
starts, so forcing ``SPECBATCH_KERNEL_BACKEND=triton`` before building ``LLM`` routes every
``write_kv`` and ``paged_attention`` call of the forward through our kernels.
"""

from __future__ import annotations


from paged_cases import DEVICE, spy

from engine import LLM, SamplingParams
from tests.helpers.tiny_models import make_tiny_model

PROMPTS = [
    "Hello, paged world!",  # prefill of 19 tokens then decodes: crosses a 16-token block
    "a",  # a one-token prompt
    "The quick brown fox jumps over the lazy dog, again and again and again.",
]


def _generate(model_dir, backend: str, monkeypatch, params=None, **engine_args) -> list[list[int]]:
    monkeypatch.setenv("SPECBATCH_KERNEL_BACKEND", backend)
    llm = LLM(str(model_dir), device=DEVICE, dtype="float32", **engine_args)  # fp32 on GPU too: no bf16 ties
    params = params or SamplingParams(temperature=0, max_tokens=8)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def test_greedy_tokens_match_between_backends(tmp_path, monkeypatch):
    from specbatch_kernels import _triton_attention, _triton_cache

    model_dir = make_tiny_model(tmp_path / "tiny", logit_scale=4.0)  # sharp: no greedy near-ties
    want = _generate(model_dir, "torch", monkeypatch)

    calls: list[str] = []
    for module, name in ((_triton_attention, "decode"), (_triton_attention, "varlen"),
                         (_triton_cache, "write_kv")):
        spy(monkeypatch, module, name, calls)
    got = _generate(model_dir, "triton", monkeypatch)

    assert {"decode", "varlen", "write_kv"} <= set(calls), "the engine did not reach the Triton kernels"
    assert got == want
    assert all(1 <= len(tokens) <= 8 for tokens in want)


def test_seeded_sampled_tokens_match_between_backends(tmp_path, monkeypatch):
    from specbatch_kernels import _triton_sampling

    model_dir = make_tiny_model(tmp_path / "flat", seed=1, logit_scale=0.5)  # flat: many tokens drawn
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=5, max_tokens=8, ignore_eos=True)
    spec = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1}
    want = _generate(model_dir, "torch", monkeypatch, params, speculative_config=spec)
    calls: list[str] = []
    spy(monkeypatch, _triton_sampling, "coupled_sample", calls)
    got = _generate(model_dir, "triton", monkeypatch, params, speculative_config=spec)
    assert "coupled_sample" in calls, "the engine did not reach the Triton sampling kernel"
    assert got == want
    assert _generate(model_dir, "torch", monkeypatch, params) == want  # and speculation changed nothing
