"""Prometheus metrics of one worker process, served on its own port (``--metrics-port``).

Names follow vLLM's (``vllm:num_requests_running`` → ``specbatch:num_requests_running``) where
one exists, so dashboards and alerts written for vLLM read ours. Three sources:
- the engine's state and cumulative counters, read at scrape time (``EngineCollector``): no
  bookkeeping on the loop thread beyond the counters the engine keeps anyway;
- every engine step (``observe_step``, the loop's ``on_step`` hook): step time, tokens per step;
- every job this worker ends (``observe_job``): jobs by final status, queue wait, TTFT, TPOT and
  end-to-end latency (enqueue to result stored).
One HTTP port per worker process: Prometheus tells workers apart by their ``instance``; two
workers on one host need two ports (e.g. 9400 + GPU index), and a taken port fails at start.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
                   1800.0, 3600.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.0)
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)

#: Engine counters (``engine.stats`` keys) exported as Prometheus counters, with vLLM's names.
ENGINE_COUNTERS = {
    "prompt_tokens": ("specbatch:prompt_tokens", "Prompt tokens of requests scheduled for the first time."),
    "sampled_tokens": ("specbatch:generation_tokens", "Output tokens generated."),
    "cached_prompt_tokens": ("specbatch:prefix_cache_hits", "Prompt tokens found in the prefix cache."),
    "spec_draft_tokens": ("specbatch:spec_decode_num_draft_tokens", "Draft tokens proposed and verified."),
    "spec_accepted_tokens": ("specbatch:spec_decode_num_accepted_tokens", "Draft tokens accepted."),
    "steps": ("specbatch:engine_steps", "Engine steps run."),
}


class EngineCollector(Collector):
    """Reads the running loop's state when Prometheus scrapes (``stats`` returns plain ints)."""

    def __init__(self, stats: Callable[[], dict[str, Any]], labels: dict[str, str]) -> None:
        self._stats = stats
        self._labels = labels

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(name, doc, labels=list(self._labels))
        family.add_metric(list(self._labels.values()), value)
        return family

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        family = CounterMetricFamily(name, doc, labels=list(self._labels))
        family.add_metric(list(self._labels.values()), value)
        return family

    def collect(self) -> Iterable[Any]:
        try:
            stats = self._stats()
        except Exception:  # the engine is not built yet or has gone: export nothing rather than fail the scrape
            log.debug("engine stats unavailable", exc_info=True)
            return
        used = stats["num_blocks"] - stats["free_blocks"]
        yield self._gauge("specbatch:num_requests_running", "Sequences in the running batch.", stats["running"])
        yield self._gauge("specbatch:num_requests_waiting", "Sequences waiting for the engine.", stats["waiting"])
        yield self._gauge("specbatch:kv_cache_blocks_used", "KV-cache blocks held by sequences.", used)
        yield self._gauge("specbatch:kv_cache_blocks_free", "KV-cache blocks free (empty or cached).",
                          stats["free_blocks"])
        yield self._gauge("specbatch:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1).",
                          used / stats["num_blocks"] if stats["num_blocks"] else 0.0)
        yield self._counter("specbatch:num_preemptions", "Running sequences preempted (recomputed later).",
                            stats.get("preemptions", 0))
        yield self._counter("specbatch:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                            stats.get("prompt_tokens", 0))
        for key, (name, doc) in ENGINE_COUNTERS.items():
            yield self._counter(name, doc, stats.get(key, 0))


class ResultCacheCollector(EngineCollector):
    """The result cache's figures (``Store.cache_stats``: one aggregate query) when Prometheus
    scrapes. They are the store's, shared by every worker on it: take ``max``, not ``sum``,
    across workers."""

    def describe(self) -> Iterable[Any]:
        """Nothing: registering must not query the store (the worker registers its metrics while
        it builds the store the query would need)."""
        return []

    def collect(self) -> Iterable[Any]:
        try:
            stats = self._stats()
        except Exception:  # the database is away: export nothing rather than fail the scrape
            log.debug("result cache stats unavailable", exc_info=True)
            return
        yield self._counter("specbatch:result_cache_hits", "Jobs answered from the result cache at ingest.",
                            stats["hits"])
        yield self._counter("specbatch:result_cache_misses", "Greedy or seeded jobs not in the result cache.",
                            stats["misses"])
        yield self._counter("specbatch:result_cache_duplicates",
                            "Jobs run once for an earlier job of their batch asking the same.", stats["duplicates"])
        yield self._gauge("specbatch:result_cache_entries", "Results in the result cache.", stats["entries"])
        yield self._gauge("specbatch:result_cache_bytes", "Bytes of the result cache's entries.", stats["bytes"])


class WorkerMetrics:
    """The process's registry: engine collector, step and job observations, and its HTTP server."""

    def __init__(self, *, model: str, worker: str, stats: Callable[[], dict[str, Any]],
                 cache_stats: Callable[[], dict[str, Any]] | None = None) -> None:
        self.labels = {"model_name": model, "worker": worker}
        names = list(self.labels)
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(EngineCollector(stats, self.labels))
        if cache_stats is not None:
            self.registry.register(ResultCacheCollector(cache_stats, self.labels))
        r = self.registry
        self.step_seconds = Histogram("specbatch:step_duration_seconds", "Wall time of one engine step.",
                                      names, buckets=STEP_BUCKETS, registry=r)
        self.step_tokens = Histogram("specbatch:iteration_tokens", "Tokens scheduled in one engine step.",
                                     names, buckets=TOKEN_BUCKETS, registry=r)
        self.step_batch = Histogram("specbatch:iteration_batch_size", "Sequences in one engine step.",
                                    names, buckets=TOKEN_BUCKETS, registry=r)
        self.jobs = Counter("specbatch:jobs", "Jobs this worker ended, by final status (and error type).",
                            names + ["status", "error_type"], registry=r)
        self.queue_time = Histogram("specbatch:request_queue_time_seconds",
                                    "Queue wait: enqueued to claimed by this worker.", names,
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("specbatch:time_to_first_token_seconds", "First token time, from engine arrival.",
                              names, buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("specbatch:time_per_output_token_seconds", "Mean time per output token after the first.",
                              names, buckets=TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("specbatch:e2e_request_latency_seconds",
                             "A job's whole life: enqueued to result stored.", names,
                             buckets=LATENCY_BUCKETS, registry=r)
        self.server = None

    def serve(self, port: int, address: str = "0.0.0.0") -> None:
        """Expose ``/metrics`` on ``address:port`` (a daemon thread; a taken port raises here)."""
        self.server, _thread = start_http_server(port, addr=address, registry=self.registry)

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server = None

    def observe_step(self, seconds: float, tokens: int, batch_size: int) -> None:
        labels = self.labels
        self.step_seconds.labels(**labels).observe(seconds)
        self.step_tokens.labels(**labels).observe(tokens)
        self.step_batch.labels(**labels).observe(batch_size)

    def observe_job(self, status: str, values: dict[str, Any] | None = None, *, queue_wait_s: float | None = None,
                    enqueued_at: float | None = None) -> None:
        """A job this worker ended: ``status`` (succeeded, failed, given_back, …) and its result columns."""
        values = values or {}
        labels = self.labels
        self.jobs.labels(**labels, status=status, error_type=values.get("error_type") or "").inc()
        if queue_wait_s is not None:
            self.queue_time.labels(**labels).observe(max(0.0, queue_wait_s))
        if values.get("ttft_s") is not None:
            self.ttft.labels(**labels).observe(values["ttft_s"])
        if values.get("tpot_s") is not None:
            self.tpot.labels(**labels).observe(values["tpot_s"])
        if enqueued_at is not None and values.get("finished_at") is not None:
            self.e2e.labels(**labels).observe(max(0.0, values["finished_at"] - enqueued_at))
