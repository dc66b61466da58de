"""The loop thread's decode latency while other threads encode: shared lock vs a private copy.

    python -m bench.detokenizer_threads

Why: ``engine.detokenizer`` gives the loop thread its own tokenizer copy instead of taking the
lock submitters encode under; this prints what each choice costs (SmolLM2's tokenizer).
"""

from __future__ import annotations

import copy
import threading
import time

from transformers import AutoTokenizer

from engine.memory import resident_bytes
from engine.model_hub import resolve_model


def decode_latencies(tokenizer, ids: list[int], lock: threading.Lock | None, n: int = 3000) -> tuple[float, float]:
    """Mean and p99 microseconds of ``n`` short decodes (an incremental detokenisation step)."""
    lat = []
    for i in range(n):
        start = time.perf_counter()
        if lock is not None:
            with lock:
                tokenizer.decode(ids[: 10 + i % 20])
        else:
            tokenizer.decode(ids[: 10 + i % 20])
        lat.append(time.perf_counter() - start)
    lat.sort()
    return sum(lat) / n * 1e6, lat[int(n * 0.99)] * 1e6


def main() -> None:
    tokenizer = AutoTokenizer.from_pretrained(resolve_model("SmolLM2-135M-Instruct"))
    before, start = resident_bytes(), time.perf_counter()
    private = copy.deepcopy(tokenizer)
    print(f"private copy: {(time.perf_counter() - start) * 1e3:.0f} ms, "
          f"+{((resident_bytes() or 0) - (before or 0)) / 2**20:.1f} MB resident")
    ids = tokenizer.encode("hello there, this is a generated answer with some words in it " * 3)
    long_prompt = "The quick brown fox jumps over the lazy dog. " * 200  # ~2k tokens
    lock = threading.Lock()
    for name, tok, loop_lock in (("shared lock", tokenizer, lock), ("private copy", private, None)):
        stop = threading.Event()

        def encode() -> None:
            while not stop.is_set():
                with lock:
                    tokenizer.encode(long_prompt)

        threads = [threading.Thread(target=encode) for _ in range(2)]
        for t in threads:
            t.start()
        mean, p99 = decode_latencies(tok, ids, loop_lock)
        stop.set()
        for t in threads:
            t.join()
        print(f"{name:12s} decode while 2 threads encode 2k-token prompts: mean {mean:.1f} us, p99 {p99:.1f} us")


if __name__ == "__main__":
    main()
