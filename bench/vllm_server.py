"""Runs inside vLLM's own venv (see bench/vllm_env.py): loads a model once, then answers
generation requests read as JSON lines on stdin with JSON lines on stdout.

Request: {"prompts": [[token ids], ...], "max_tokens": [...], "ignore_eos": bool}
Answer:  {"elapsed": seconds of llm.generate, "token_ids": [[...], ...]}
It imports nothing from specbatch: its interpreter has vLLM's torch and transformers.
"""

from __future__ import annotations

import json
import os
import sys
import time


def main() -> None:
    model, dtype, max_num_seqs = sys.argv[1], sys.argv[2], int(sys.argv[3])
    out = sys.stdout
    sys.stdout = sys.stderr  # vLLM's own prints must not corrupt the answer stream
    from vllm import LLM, SamplingParams

    llm = LLM(model=model, dtype=dtype, max_num_seqs=max_num_seqs, max_model_len=2048, seed=0)
    import vllm

    out.write(json.dumps({"ready": True, "vllm": vllm.__version__, "pid": os.getpid()}) + "\n")
    out.flush()
    for line in sys.stdin:
        req = json.loads(line)
        params = [
            SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=req.get("ignore_eos", False))
            for m in req["max_tokens"]
        ]
        prompts = [{"prompt_token_ids": ids} for ids in req["prompts"]]
        start = time.perf_counter()
        results = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        tokens = [list(r.outputs[0].token_ids) for r in results]
        out.write(json.dumps({"elapsed": elapsed, "token_ids": tokens}) + "\n")
        out.flush()


if __name__ == "__main__":
    main()
