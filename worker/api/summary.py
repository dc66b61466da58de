"""Run summaries: throughput and latency percentiles over finished jobs."""

from __future__ import annotations

from array import array
from typing import Any, Iterable, Sequence

from worker.store.models import SUCCEEDED


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in [0, 100]); None for no values."""
    xs = sorted(v for v in values if v is not None)
    if not xs:
        return None
    k = (len(xs) - 1) * q / 100.0
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


#: The columns ``summarize`` reads (``Store.iter_job_columns`` gives just these, in chunks).
SUMMARY_COLUMNS = ("status", "error_type", "started_at", "finished_at", "num_output_tokens", "num_prompt_tokens",
                   "num_cached_tokens", "num_draft_tokens", "num_accepted_tokens", "queue_wait_s", "ttft_s",
                   "tpot_s", "max_batch_size")


class Summary:
    """``summarize`` in one pass: counts and sums as jobs stream by, and only the three latency
    columns kept (8 bytes a job each, for the percentiles)."""

    def __init__(self) -> None:
        self.jobs = 0
        self.by_status: dict[str, int] = {}
        self.ok = 0
        self.first_start: float | None = None
        self.last_end: float | None = None
        self.sums = dict.fromkeys(("out", "prompt", "cached", "drafts", "accepted"), 0)
        self.max_batch = 0
        self.lat = {k: array("d") for k in ("queue_wait_s", "ttft_s", "tpot_s")}

    def add(self, j: Any) -> None:
        self.jobs += 1
        self.by_status[j.status] = self.by_status.get(j.status, 0) + 1
        if j.status != SUCCEEDED:
            return
        self.ok += 1
        if j.started_at:
            self.first_start = j.started_at if self.first_start is None else min(self.first_start, j.started_at)
        if j.finished_at:
            self.last_end = j.finished_at if self.last_end is None else max(self.last_end, j.finished_at)
        for key, value in (("out", j.num_output_tokens), ("prompt", j.num_prompt_tokens),
                           ("cached", j.num_cached_tokens), ("drafts", j.num_draft_tokens),
                           ("accepted", j.num_accepted_tokens)):
            self.sums[key] += value or 0
        self.max_batch = max(self.max_batch, j.max_batch_size or 0)
        for key, values in self.lat.items():
            value = getattr(j, key)
            if value is not None:
                values.append(value)

    def result(self) -> dict[str, Any]:
        window = (self.last_end - self.first_start) if self.first_start and self.last_end else None
        out, drafts = self.sums["out"], self.sums["drafts"]
        return {
            "jobs": self.jobs,
            "by_status": self.by_status,
            "output_tokens": out,
            "prompt_tokens": self.sums["prompt"],
            "cached_tokens": self.sums["cached"],
            "wall_s": window,
            "tokens_per_s": out / window if window else None,
            "jobs_per_s": self.ok / window if window else None,
            "queue_wait_p50": percentile(self.lat["queue_wait_s"], 50),
            "queue_wait_p95": percentile(self.lat["queue_wait_s"], 95),
            "ttft_p50": percentile(self.lat["ttft_s"], 50),
            "ttft_p95": percentile(self.lat["ttft_s"], 95),
            "tpot_p50": percentile(self.lat["tpot_s"], 50),
            "acceptance_rate": self.sums["accepted"] / drafts if drafts else None,
            "max_batch_size": self.max_batch,
        }


def summarize(jobs: Iterable[Any]) -> dict[str, Any]:
    """Throughput and latency figures of jobs (rows, or anything with ``SUMMARY_COLUMNS``)."""
    s = Summary()
    for j in jobs:
        s.add(j)
    return s.result()
