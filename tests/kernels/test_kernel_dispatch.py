"""Backend choice and dispatch: the public entry points really reach the Triton kernels."""

from __future__ import annotations

import pytest
import torch

import specbatch_kernels
from specbatch_kernels import kernel_backend
from paged_cases import assert_close, make_case, spy


def test_backend_by_device(monkeypatch):
    monkeypatch.delenv("SPECBATCH_KERNEL_BACKEND", raising=False)
    assert kernel_backend("cpu") == "torch"
    assert kernel_backend(torch.device("cpu")) == "torch"
    assert kernel_backend("cuda") == "triton"
    assert kernel_backend("cuda:1") == "triton"


@pytest.mark.parametrize("forced", ["torch", "triton"])
def test_backend_env_override(monkeypatch, forced):
    monkeypatch.setenv("SPECBATCH_KERNEL_BACKEND", forced)
    assert kernel_backend("cpu") == forced
    assert kernel_backend("cuda:0") == forced


def test_backend_env_rejects_unknown(monkeypatch):
    monkeypatch.setenv("SPECBATCH_KERNEL_BACKEND", "cuda")
    with pytest.raises(ValueError, match="SPECBATCH_KERNEL_BACKEND"):
        kernel_backend("cpu")
    with pytest.raises(ValueError):
        specbatch_kernels.write_kv(backend="tritonn")


def _spy(monkeypatch, module, name: str) -> list[str]:
    calls: list[str] = []
    spy(monkeypatch, module, name, calls)
    return calls


def test_paged_attention_dispatch_runs_triton(monkeypatch):
    from specbatch_kernels import _triton_attention

    decode = _spy(monkeypatch, _triton_attention, "decode")
    varlen = _spy(monkeypatch, _triton_attention, "varlen")
    for q_lens in ([1, 1], [4, 1]):
        case = make_case([20, 33], q_lens, seed=7)
        want = specbatch_kernels.paged_attention(*case.args(), backend="torch")
        got = specbatch_kernels.paged_attention(*case.args(), backend="triton")
        assert_close(got, want, torch.float32)
    assert decode == ["decode"] and varlen == ["varlen"]  # the wrapper's per-step choice


def test_triton_hints_are_accepted_by_both_backends():
    """The engine may pass host-side maxima on any backend; the torch path ignores them."""
    case = make_case([20, 33], [1, 1], seed=7)
    hints = dict(max_query_len=1, max_context_len=33)
    want = specbatch_kernels.paged_attention(*case.args(), backend="torch", **hints)
    got = specbatch_kernels.paged_attention(*case.args(), backend="triton", kv_split_len=16, **hints)
    assert_close(got, want, torch.float32)


def test_cache_dispatch_runs_triton(monkeypatch):
    from specbatch_kernels import _triton_cache

    calls = [_spy(monkeypatch, _triton_cache, "write_kv")]
    case = make_case([20], [1], seed=2)
    results = {}
    for backend in ("torch", "triton"):
        k, v = case.k_cache.clone(), case.v_cache.clone()
        new = torch.ones(2, *k.shape[2:], device=k.device)
        specbatch_kernels.write_kv(new, -new, k, v, torch.tensor([3, -1], device=k.device), backend=backend)
        results[backend] = (k, v)
    for want, got in zip(results["torch"], results["triton"]):
        assert torch.equal(got, want)
    assert calls == [["write_kv"]]
