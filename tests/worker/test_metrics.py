"""A real worker's Prometheus ``/metrics`` (``--metrics-port``), scraped while it runs jobs: the
counters move with the jobs, and at the end jobs succeeded and generation tokens equal the
store's figures; a second worker asking for the same port exits with a clear error."""

from __future__ import annotations

import socket
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from worker.common.config import Settings
from worker.run.local import LocalWorker
from worker.store.models import FAILED, SUCCEEDED

pytestmark = pytest.mark.integration

N_JOBS = 40


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """Every sample on the page as {(name, sorted label items): value}."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def total(samples: dict, name: str, **labels: str) -> float:
    """Sum of ``name``'s samples whose labels include ``labels``."""
    return sum(v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= set(ls))


def test_worker_metrics_move_with_the_jobs_and_end_equal_to_the_store(sqlite_url, redis_url, unique_queue,
                                                                      tiny_model_dir, tmp_path):
    from worker.api.client import Client
    from worker.store.store import Store

    port = free_port()
    store = Store(sqlite_url, auto_upgrade=True)
    client = Client(broker_url=redis_url, database_url=sqlite_url, model=tiny_model_dir, queue=unique_queue,
                    store=store)
    settings = Settings(broker_url=redis_url, database_url=sqlite_url, model=tiny_model_dir, device="cpu",
                        queue=unique_queue)
    worker = LocalWorker(settings, max_num_seqs=8, concurrency=8, loglevel="info",
                         log_path=str(tmp_path / "worker.log"), extra_env={"SPECBATCH_METRICS_PORT": str(port)})
    try:
        deadline = time.monotonic() + 120
        while not client.workers_consuming(unique_queue, timeout=0.5):
            assert worker.alive, (tmp_path / "worker.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "worker did not come up"
        before = scrape(port)
        assert total(before, "specbatch:generation_tokens_total") == 0
        assert total(before, "specbatch:num_requests_running") == 0
        assert total(before, "specbatch:kv_cache_blocks_free") > 0

        lines = [{"custom_id": f"m{i}", "prompt": f"count to {i}", "max_tokens": 24 + i % 8, "ignore_eos": True}
                 for i in range(N_JOBS)]
        batch = client.submit_batch(lines, name=unique_queue)
        # A job for a model this worker does not serve ends failed (wrong_model), counted as such.
        stranger = Client(broker_url=redis_url, database_url=sqlite_url, model="some-other-model",
                          queue=unique_queue, store=store)
        wrong = stranger.submit("hello", params={"max_tokens": 4})

        seen_tokens, seen_running, seen_steps = [], 0.0, []
        deadline = time.monotonic() + 180
        while True:
            counts = store.batch_counts(batch.batch_id)
            done = counts.get(SUCCEEDED, 0) + counts.get(FAILED, 0) == N_JOBS
            samples = scrape(port)
            seen_tokens.append(total(samples, "specbatch:generation_tokens_total"))
            seen_steps.append(total(samples, "specbatch:step_duration_seconds_count"))
            seen_running = max(seen_running, total(samples, "specbatch:num_requests_running"))
            if done and store.get_job(wrong).status == FAILED:
                break
            assert time.monotonic() < deadline, counts
            time.sleep(0.05)
        # The counters moved during the run, never backwards.
        assert seen_tokens == sorted(seen_tokens) and seen_steps == sorted(seen_steps)
        assert len(set(seen_tokens)) >= 3, seen_tokens
        assert seen_running >= 1

        time.sleep(0.5)  # the last task thread counts its job right after the store write
        end = scrape(port)
        jobs = store.jobs(batch.batch_id)
        succeeded = [j for j in jobs if j.status == SUCCEEDED]
        assert len(succeeded) == N_JOBS
        assert total(end, "specbatch:jobs_total", status="succeeded") == len(succeeded)
        assert total(end, "specbatch:jobs_total", status="failed", error_type="wrong_model") == 1
        assert total(end, "specbatch:generation_tokens_total") == sum(j.num_output_tokens for j in succeeded)
        assert total(end, "specbatch:prompt_tokens_total") == sum(j.num_prompt_tokens for j in succeeded)
        for hist in ("time_to_first_token_seconds", "time_per_output_token_seconds", "e2e_request_latency_seconds",
                     "request_queue_time_seconds"):
            assert total(end, f"specbatch:{hist}_count") >= N_JOBS, hist
        assert total(end, "specbatch:iteration_tokens_sum") >= total(end, "specbatch:generation_tokens_total")
        assert total(end, "specbatch:num_requests_running") == 0
        assert total(end, "specbatch:kv_cache_usage_perc") == 0.0

        # The result cache: greedy rows computed once, then answered from it, as the store counts.
        from worker.request.validate import TokenCounter

        counter = TokenCounter(tiny_model_dir)
        greedy = [{"custom_id": f"g{i}", "prompt": f"greedy {i}", "max_tokens": 4, "temperature": 0} for i in range(4)]
        for name in ("computed", "answered"):
            sub = client.submit_batch(greedy, name=f"{unique_queue}-{name}", count_tokens=counter,
                                      max_model_len=counter.max_model_len)
            client.wait(sub.batch_id, timeout=60)
        cache = scrape(port)
        assert total(cache, "specbatch:result_cache_misses_total") == 4
        assert total(cache, "specbatch:result_cache_hits_total") == 4 == sub.ingest.cached
        assert total(cache, "specbatch:result_cache_entries") == 4

        # One port per worker process: a second worker on the same port exits, saying why.
        clash = LocalWorker(settings, max_num_seqs=2, loglevel="info", log_path=str(tmp_path / "clash.log"),
                            extra_env={"SPECBATCH_METRICS_PORT": str(port)})
        assert clash.proc.wait(timeout=120) == 7
        assert "give every worker process a port of its own" in (tmp_path / "clash.log").read_text()
    finally:
        worker.stop(timeout=30)
