"""deploy/grafana's dashboard against what a worker really exports: every metric a panel or a
variable queries is on a real engine's ``/metrics`` page, and every exported family is shown."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from engine import LLM, EngineLoop
from worker.run.metrics import WorkerMetrics

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "specbatch-dashboard.json"


def queried_metrics(dashboard: dict) -> set[str]:
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    exprs += [v["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    return {m for e in exprs for m in re.findall(r"specbatch:[a-z0-9_]+", e)}


def test_the_dashboard_queries_only_and_all_the_metrics_a_worker_exports(tiny_model_dir):
    loop = EngineLoop(LLM(tiny_model_dir, device="cpu").engine).start()
    try:
        metrics = WorkerMetrics(model="tiny", worker="cpu@test", stats=loop.stats)
        handle = loop.submit("hello", params={"max_tokens": 4})
        handle.result(timeout=60)
        metrics.observe_step(0.01, 4, 1)
        metrics.observe_job("succeeded", {"ttft_s": 0.01, "tpot_s": 0.002, "finished_at": 2.0}, queue_wait_s=0.1,
                            enqueued_at=1.0)
        page = generate_latest(metrics.registry).decode()
    finally:
        loop.shutdown(drain_timeout=5)
    exported = {s.name for f in text_string_to_metric_families(page) for s in f.samples}
    families = {f.name for f in text_string_to_metric_families(page) if not f.name.endswith("_created")}
    dashboard = json.loads(DASHBOARD.read_text())
    queried = queried_metrics(dashboard)
    assert queried - exported == set(), "the dashboard queries metrics no worker exports"
    shown = {f for f in families if any(q == f or q.startswith(f + "_") for q in queried)}
    assert families - shown == set(), "exported metrics the dashboard never shows"
    assert all(p["datasource"]["uid"] == "${datasource}" for p in dashboard["panels"])
