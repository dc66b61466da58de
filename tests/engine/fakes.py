"""Requests and sequences without a model, for block-manager and scheduler tests."""

from __future__ import annotations

from engine.outputs import RequestMetrics
from engine.sampling_params import SamplingParams
from engine.sequence import Request, Sequence


def make_seq(tokens: list[int], request_id: str = "r", n: int = 1) -> Sequence:
    request = Request(
        request_id=request_id,
        prompt=None,
        prompt_token_ids=list(tokens),
        params=SamplingParams(n=n, max_tokens=64),
        metrics=RequestMetrics(arrival_time=0.0, num_prompt_tokens=len(tokens)),
    )
    for i in range(n):
        request.seqs.append(Sequence(request=request, index=i, token_ids=list(tokens), num_prompt_tokens=len(tokens)))
    return request.seqs[0]
