"""Shared fixtures: tiny random models (fast) and the real SmolLM2-135M-Instruct (where it proves something)."""

from __future__ import annotations

import os

# Triton reads TRITON_INTERPRET when a kernel is defined: set it before anything imports one,
# so every test on the CPU runs Triton kernels through the interpreter.
if os.environ.get("SPECBATCH_TEST_DEVICE", "cpu") == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"

# Under pytest-xdist each of its processes gets its share of the cores, for its own torch and
# for the engine processes its tests start: torch threads spinning in OpenMP barriers on
# oversubscribed cores made CPU-bound tests ten times slower.
if os.environ.get("PYTEST_XDIST_WORKER"):
    _share = max(1, len(os.sched_getaffinity(0)) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    os.environ.setdefault("OMP_NUM_THREADS", str(_share))
    os.environ.setdefault("SPECBATCH_ENGINE_THREADS", str(_share))

import pytest  # noqa: E402

from engine.model_hub import resolve_model  # noqa: E402
from tests.helpers.tiny_models import make_tiny_model  # noqa: E402
from tests.ordering import waiting_tests_first  # noqa: E402


def pytest_collection_modifyitems(config, items) -> None:
    workers = getattr(config, "workerinput", {}).get("workercount", 1)
    items[:] = waiting_tests_first(items, workers)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """A 2-layer random Llama whose greedy choices are far from ties (sharp logits)."""
    return str(make_tiny_model(tmp_path_factory.mktemp("tiny"), logit_scale=8.0))


@pytest.fixture(scope="session")
def flat_model_dir(tmp_path_factory) -> str:
    """A tiny model with a flat output distribution, for sampling tests."""
    return str(make_tiny_model(tmp_path_factory.mktemp("flat"), seed=1, logit_scale=0.5))


@pytest.fixture(scope="session")
def smollm2_dir() -> str:
    return resolve_model("SmolLM2-135M-Instruct")


@pytest.fixture(scope="session")
def smol_llm(smollm2_dir):
    from engine import LLM

    # float32: the tests that use it hold the engine to HF's float32 reference and to float32
    # near-ties (dtype "auto" picks bfloat16 on CPUs with native bf16).
    return LLM(smollm2_dir, device="cpu", dtype="float32", max_num_seqs=64)


@pytest.fixture
def browser():
    """Headless Debian Chromium through selenium (see tests/browser.py); closed after the test."""
    from tests.browser import chromium

    driver = chromium()
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture(autouse=True)
def _settings_read_afresh():
    """Each test's process settings are read from the environment it sets up (``monkeypatch.setenv``
    before the first ``settings()``), never left over from another test's."""
    from worker.common.config import forget_settings

    forget_settings()
    yield
    forget_settings()
