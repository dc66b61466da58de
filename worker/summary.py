"""Run summaries: throughput and latency percentiles over finished jobs."""

from __future__ import annotations

from typing import Any, Iterable, Sequence

from .models import SUCCEEDED


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in [0, 100]); None for no values."""
    xs = sorted(v for v in values if v is not None)
    if not xs:
        return None
    k = (len(xs) - 1) * q / 100.0
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summarize(jobs: Iterable[Any]) -> dict[str, Any]:
    jobs = list(jobs)
    ok = [j for j in jobs if j.status == SUCCEEDED]
    starts = [j.started_at for j in ok if j.started_at]
    ends = [j.finished_at for j in ok if j.finished_at]
    window = (max(ends) - min(starts)) if starts and ends else None
    out_tokens = sum(j.num_output_tokens or 0 for j in ok)
    drafts = sum(j.num_draft_tokens or 0 for j in ok)
    accepted = sum(j.num_accepted_tokens or 0 for j in ok)
    by_status: dict[str, int] = {}
    for j in jobs:
        by_status[j.status] = by_status.get(j.status, 0) + 1
    return {
        "jobs": len(jobs),
        "by_status": by_status,
        "output_tokens": out_tokens,
        "prompt_tokens": sum(j.num_prompt_tokens or 0 for j in ok),
        "cached_tokens": sum(j.num_cached_tokens or 0 for j in ok),
        "wall_s": window,
        "tokens_per_s": out_tokens / window if window else None,
        "jobs_per_s": len(ok) / window if window else None,
        "queue_wait_p50": percentile([j.queue_wait_s for j in ok], 50),
        "queue_wait_p95": percentile([j.queue_wait_s for j in ok], 95),
        "ttft_p50": percentile([j.ttft_s for j in ok], 50),
        "ttft_p95": percentile([j.ttft_s for j in ok], 95),
        "tpot_p50": percentile([j.tpot_s for j in ok], 50),
        "acceptance_rate": accepted / drafts if drafts else None,
        "max_batch_size": max((j.max_batch_size or 0 for j in ok), default=0),
    }
