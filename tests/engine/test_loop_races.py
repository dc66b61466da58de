"""EngineLoop under races: submissions racing shutdown, and the loop decoding while others encode."""

import threading
from concurrent.futures import TimeoutError as FutureTimeout

import pytest

from engine import EngineLoop, LLMEngine, SamplingParams
from engine.config import EngineConfig
from engine.sequence import Request, Sequence
from engine.outputs import RequestMetrics


@pytest.fixture(scope="module")
def engine_config(tiny_model_dir):
    return EngineConfig(model=tiny_model_dir, device="cpu")


def test_submit_after_shutdown_raises_at_once(engine_config):
    loop = EngineLoop(LLMEngine(engine_config)).start()
    loop.shutdown(drain_timeout=1)
    with pytest.raises(RuntimeError, match="shutting down"):
        loop.submit("too late")


@pytest.mark.parametrize("drain_timeout", [0.0, 0.05])
def test_submissions_racing_shutdown_resolve_or_raise(engine_config, drain_timeout):
    """Every accepted handle resolves (finished, aborted or failed) and every refused submit raises."""
    engine = LLMEngine(engine_config)
    loop = EngineLoop(engine).start()
    long_prompt = "a long prompt so that tokenising it takes a while " * 30
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    accepted, refused, unexpected = [], [], []
    go = threading.Barrier(9)

    def submitter(i: int) -> None:
        go.wait()
        for j in range(1000):
            try:
                accepted.append(loop.submit(long_prompt if j % 2 else f"t{i} r{j}", params=params))
            except RuntimeError:
                refused.append(i)
                return
            except Exception as exc:  # pragma: no cover - surfaced by the assert below
                unexpected.append(exc)
                return

    threads = [threading.Thread(target=submitter, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    go.wait()
    while len(accepted) < 20:
        threading.Event().wait(0.001)
    loop.shutdown(drain_timeout=drain_timeout)
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    assert not unexpected and len(refused) == 8  # every thread was eventually refused
    outcomes = {"finished": 0, "aborted": 0, "failed": 0}
    for handle in accepted:
        try:
            out = handle.result(timeout=30)
        except FutureTimeout:  # pragma: no cover - the bug this test is about
            pytest.fail(f"handle {handle.request_id} never resolved")
        except RuntimeError:
            outcomes["failed"] += 1
            continue
        assert out.finished
        outcomes["aborted" if out.outputs[0].finish_reason == "abort" else "finished"] += 1
    assert sum(outcomes.values()) == len(accepted)
    # Every token stream ends as well (iterating a handle must never block forever).
    drained = threading.Thread(target=lambda: [list(h) for h in accepted], daemon=True)
    drained.start()
    drained.join(timeout=30)
    assert not drained.is_alive()


def _request(token_ids: list[int]) -> Sequence:
    request = Request("r", None, list(token_ids), SamplingParams(stop=["\x00never"]), RequestMetrics(0.0))
    seq = Sequence(request, 0, list(token_ids[:1]), 1)
    request.seqs.append(seq)
    return seq


def test_the_loop_decodes_correctly_while_other_threads_encode(engine_config):
    """The stop checker decodes with its own tokenizer: other threads' encodes (even ones that change
    the shared tokenizer's truncation settings) cannot disturb the loop's text."""
    engine = LLMEngine(engine_config)
    tokenizer = engine.tokenizer
    assert engine.stop_checker.tokenizer is not tokenizer
    text = "concurrent détokenisation ✓ " * 8
    ids = tokenizer.encode(text)
    stop = threading.Event()
    errors: list[str] = []

    def encoder(truncate: bool) -> None:
        while not stop.is_set():
            got = tokenizer(text, truncation=truncate, max_length=16)["input_ids"]
            if not truncate and got != ids:
                errors.append("encode")
            engine.make_request(text)

    threads = [threading.Thread(target=encoder, args=(k % 2 == 0,)) for k in range(3)]
    for t in threads:
        t.start()
    try:
        for _ in range(30):
            seq = _request(ids)
            for token in ids[1:]:
                engine.stop_checker.append(seq, token)
            want = text[len(tokenizer.decode(ids[:1])) :]
            if seq.text != want or engine.stop_checker.final_text(seq) != want:
                errors.append("decode")
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert "decode" not in errors
