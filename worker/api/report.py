"""``specbatch report``: one batch from the store to one self-contained HTML page.

The page needs nothing but itself: plots are matplotlib PNGs (Agg) inlined as base64
``data:`` images, the CSS is inline, there is no script. Only the columns the plots need are
read, in chunks, into numpy arrays (a million-job batch never loads a prompt or an output);
the tables of slowest and failed jobs are ``LIMIT`` queries. Every user string (custom_id,
error, batch name) is HTML-escaped. Table cells carry ``id``/``data-*`` attributes holding the
exact numbers so a test or a script can read them back.
"""

from __future__ import annotations

import base64
import html
import io
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from worker.store.models import FAILED, QUEUED, RUNNING, STATUSES, SUCCEEDED, Batch
from worker.store.store import Store

#: Columns a report reads (never prompts or outputs); all numeric but the status.
METRIC_COLUMNS = ("status", "enqueued_at", "started_at", "first_scheduled_at", "first_token_at", "finished_at",
                  "queue_wait_s", "ttft_s", "tpot_s", "num_output_tokens", "num_draft_tokens",
                  "num_accepted_tokens", "max_batch_size", "num_prompt_tokens", "num_cached_tokens", "cached",
                  "duplicate_of")
SLOWEST, FAILED_SHOWN = 20, 100
MAX_SCATTER = 20_000  # points drawn per scatter plot (a random sample beyond that)


@dataclass(slots=True)
class Metrics:
    """The batch's per-job numbers as arrays (NaN where a job has no value)."""

    status: np.ndarray  # str
    cols: dict[str, np.ndarray]

    def __getitem__(self, name: str) -> np.ndarray:
        return self.cols[name]

    @property
    def ok(self) -> np.ndarray:
        return self.status == SUCCEEDED


def load_metrics(store: Store, batch_id: str) -> Metrics:
    statuses: list[np.ndarray] = []
    parts: dict[str, list[np.ndarray]] = {c: [] for c in METRIC_COLUMNS[1:]}
    for chunk in store.iter_job_columns(batch_id, METRIC_COLUMNS):
        statuses.append(np.array([r[0] for r in chunk], dtype=object))
        for i, name in enumerate(METRIC_COLUMNS[1:], start=1):
            parts[name].append(np.array([np.nan if r[i] is None else 1.0 if isinstance(r[i], str) else r[i]
                                         for r in chunk], dtype=np.float64))  # a string (an id): present
    status = np.concatenate(statuses) if statuses else np.array([], dtype=object)
    cols = {c: (np.concatenate(v) if v else np.array([], dtype=np.float64)) for c, v in parts.items()}
    return Metrics(status, cols)


def pct(values: np.ndarray, q: float) -> float | None:
    """Linear percentile of the finite values (as ``worker.api.summary.percentile``), None if none."""
    v = values[np.isfinite(values)]
    return float(np.percentile(v, q)) if v.size else None


def summarize(m: Metrics, counts: dict[str, int]) -> dict[str, Any]:
    """The page's headline numbers, defined as the run summary defines them (succeeded jobs;
    wall time from the first start to the last finish)."""
    ok = m.ok
    started, finished = m["started_at"][ok], m["finished_at"][ok]
    wall = float(np.nanmax(finished) - np.nanmin(started)) if ok.any() and np.isfinite(started).any() \
        and np.isfinite(finished).any() else None
    tokens = int(np.nansum(m["num_output_tokens"][ok])) if ok.any() else 0
    drafts = float(np.nansum(m["num_draft_tokens"][ok])) if ok.any() else 0.0
    accepted = float(np.nansum(m["num_accepted_tokens"][ok])) if ok.any() else 0.0
    latency = (m["finished_at"] - m["started_at"])[ok]
    cached = ok & (m["cached"] == 1.0)
    copies = ok & np.isfinite(m["duplicate_of"])
    computed = ok & ~cached & ~copies  # a cached answer or a copy carries its computing run's counts
    prompt = float(np.nansum(m["num_prompt_tokens"][computed]))
    return {
        "jobs": int(sum(counts.values())), **{s: counts.get(s, 0) for s in STATUSES},
        "output_tokens": tokens, "wall_s": wall,
        "tokens_per_s": tokens / wall if wall else None,
        "jobs_per_s": int(ok.sum()) / wall if wall else None,
        "acceptance": accepted / drafts if drafts else None,
        "answered_from_cache": int(cached.sum()), "duplicates_run_once": int(copies.sum()),
        "prefix_cache_hit_rate": float(np.nansum(m["num_cached_tokens"][computed])) / prompt if prompt else None,
        **{f"{name}_p{q}": pct(values, q)
           for name, values in (("ttft", m["ttft_s"][ok]), ("tpot", m["tpot_s"][ok]), ("latency", latency),
                                ("queue_wait", m["queue_wait_s"][ok]))
           for q in (50, 99)},
    }


# ---- plots ---------------------------------------------------------------------------------
def _png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=96, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _figure(width: float = 6.4, height: float = 3.4):
    import matplotlib

    matplotlib.use("Agg", force=True)  # no display, no GUI toolkit: PNG bytes only
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=(width, height))


def histogram(values: np.ndarray, title: str, xlabel: str, scale: float = 1e3) -> str | None:
    v = values[np.isfinite(values)] * scale
    if not v.size:
        return None
    fig, ax = _figure()
    ax.hist(v, bins=min(50, max(5, int(np.sqrt(v.size)))), color="#4c72b0", edgecolor="white")
    for q, style in ((50, "--"), (99, ":")):
        x = float(np.percentile(v, q))
        ax.axvline(x, color="#c44e52", linestyle=style, label=f"p{q} {x:.1f}")
    ax.set(title=title, xlabel=xlabel, ylabel="jobs")
    ax.legend()
    return _png(fig)


def _buckets(t0: float, t1: float, target: int = 60) -> np.ndarray:
    width = max((t1 - t0) / target, 1e-3)
    return t0 + width * np.arange(int(np.ceil((t1 - t0) / width)) + 1)


def throughput_plot(m: Metrics, t0: float) -> str | None:
    """Output tokens/s (each job's tokens spread over its first-token→finish span) and jobs
    finished per bucket."""
    ok = m.ok & np.isfinite(m["finished_at"])
    if not ok.any():
        return None
    end = m["finished_at"][ok]
    begin = np.where(np.isfinite(m["first_token_at"][ok]), m["first_token_at"][ok], end)
    tokens = np.nan_to_num(m["num_output_tokens"][ok])
    edges = _buckets(min(t0, float(begin.min())), float(end.max()))
    width = edges[1] - edges[0]
    span = np.maximum(end - begin, 0.0)
    tok_rate = np.zeros(len(edges) - 1)
    for i in range(len(edges) - 1):
        lo, hi = edges[i], edges[i + 1]
        overlap = np.clip(np.minimum(end, hi) - np.maximum(begin, lo), 0.0, None)
        share = np.where(span > 0, overlap / np.where(span > 0, span, 1.0), ((end >= lo) & (end < hi)) * 1.0)
        tok_rate[i] = float((tokens * share).sum()) / width
    done, _ = np.histogram(end, bins=edges)
    fig, ax = _figure(7.5, 3.6)
    x = edges[:-1] - t0
    ax.step(x, tok_rate, where="post", color="#4c72b0", label="output tokens/s")
    ax.set(title="throughput", xlabel="seconds since the first job started", ylabel="output tokens/s")
    ax.set_ylim(bottom=0)
    ax2 = ax.twinx()
    ax2.bar(x, done, width=width, align="edge", alpha=0.3, color="#55a868", label=f"jobs finished / {width:.2g} s")
    ax2.set_ylabel("jobs finished per bucket")
    lines = ax.get_legend_handles_labels()
    bars = ax2.get_legend_handles_labels()
    ax.legend(lines[0] + bars[0], lines[1] + bars[1], loc="upper left")
    return _png(fig)


def _occupancy(begin: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """How many [begin, end) intervals are open at each event time (a sweep)."""
    keep = np.isfinite(begin) & np.isfinite(end)
    times = np.concatenate([begin[keep], end[keep]])
    steps = np.concatenate([np.ones(keep.sum()), -np.ones(keep.sum())])
    order = np.lexsort((steps, times))  # at a tie, an end before a start
    return times[order], np.cumsum(steps[order])


def batch_size_plot(m: Metrics, t0: float) -> str | None:
    """Jobs held by workers (started→finished), in the engine (first scheduled→finished), and
    each job's largest engine batch (at its finish)."""
    fin = m["finished_at"]
    if not np.isfinite(fin).any() or not np.isfinite(m["started_at"]).any():
        return None
    fig, ax = _figure(7.5, 3.6)
    t, n = _occupancy(m["started_at"], fin)
    ax.step(t - t0, n, where="post", color="#8172b2", label="jobs running on workers")
    t, n = _occupancy(m["first_scheduled_at"], fin)
    if t.size:
        ax.step(t - t0, n, where="post", color="#4c72b0", label="jobs in the engine's batch")
    has = np.isfinite(m["max_batch_size"]) & np.isfinite(fin)
    idx = np.flatnonzero(has)
    if idx.size > MAX_SCATTER:
        idx = np.sort(np.random.default_rng(0).choice(idx, MAX_SCATTER, replace=False))
    if idx.size:
        ax.scatter(fin[idx] - t0, m["max_batch_size"][idx], s=8, color="#dd8452", label="a job's max engine batch")
    ax.set(title="batch size over time", xlabel="seconds since the first job started", ylabel="sequences")
    ax.set_ylim(bottom=0)
    ax.legend(loc="upper right")
    return _png(fig)


def acceptance_plot(m: Metrics) -> str | None:
    drafts, accepted = m["num_draft_tokens"], m["num_accepted_tokens"]
    has = m.ok & np.isfinite(drafts) & (np.nan_to_num(drafts) > 0)
    if not has.any():
        return None
    rate = np.nan_to_num(accepted[has]) / drafts[has]
    fig, ax = _figure()
    ax.hist(rate * 100, bins=20, range=(0, 100), color="#55a868", edgecolor="white")
    overall = float(np.nansum(accepted[has]) / np.nansum(drafts[has]))
    ax.axvline(overall * 100, color="#c44e52", linestyle="--", label=f"all jobs {overall * 100:.1f} %")
    ax.set(title="draft acceptance per job", xlabel="accepted / proposed draft tokens (%)", ylabel="jobs")
    ax.legend()
    return _png(fig)


# ---- HTML ----------------------------------------------------------------------------------
CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:2rem auto;max-width:1100px;
color:#222;padding:0 1rem}
h1{font-size:1.5rem;margin-bottom:.2rem} h2{font-size:1.15rem;margin-top:2rem;border-bottom:1px solid #ddd}
.meta{color:#666;font-size:.9rem} .meta code{word-break:break-all}
table{border-collapse:collapse;margin:.5rem 0;font-size:.9rem}
th,td{border:1px solid #ddd;padding:.25rem .6rem;text-align:left;vertical-align:top}
td.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap} th{background:#f5f5f5}
td.id,td.custom-id{font-family:ui-monospace,monospace;word-break:break-all}
td.error{max-width:32rem;white-space:pre-wrap;word-break:break-word}
.plots{display:flex;flex-wrap:wrap;gap:1rem} .plots figure{margin:0} img{max-width:100%}
.none{color:#888;font-style:italic}
"""


def _e(value: Any) -> str:
    return html.escape("" if value is None else str(value), quote=True)


def _num(value: float | None, digits: int = 1, scale: float = 1.0, unit: str = "") -> str:
    return "-" if value is None else f"{value * scale:.{digits}f}{unit}"


def _int(value: int | None) -> str:
    return "-" if value is None else str(value)


def _cell(value: float | int | None, shown: str, cls: str = "num", **attrs: str) -> str:
    """A table cell whose ``data-value`` holds the exact number (empty for none)."""
    extra = "".join(f' {k.replace("_", "-")}="{_e(v)}"' for k, v in attrs.items())
    raw = "" if value is None else repr(value)
    return f'<td class="{cls}" data-value="{_e(raw)}"{extra}>{_e(shown)}</td>'


def _img(b64: str | None, plot_id: str, alt: str, missing: str) -> str:
    if b64 is None:
        return f'<p class="none" id="{plot_id}-none">{_e(missing)}</p>'
    return (f'<figure><img id="{plot_id}" class="plot" alt="{_e(alt)}" '
            f'src="data:image/png;base64,{b64}"></figure>')


def summary_table(s: dict[str, Any]) -> str:
    rows: list[tuple[str, str, float | int | None, str]] = [
        ("jobs", "jobs", s["jobs"], str(s["jobs"])),
        *((st, f"jobs {st}", s[st], str(s[st])) for st in STATUSES),
        ("output-tokens", "output tokens (succeeded jobs)", s["output_tokens"], str(s["output_tokens"])),
        ("wall-s", "wall time (first start → last finish)", s["wall_s"], _num(s["wall_s"], 2, unit=" s")),
        ("tokens-per-s", "output tokens/s", s["tokens_per_s"], _num(s["tokens_per_s"], 1)),
        ("jobs-per-s", "jobs/s", s["jobs_per_s"], _num(s["jobs_per_s"], 2)),
        ("acceptance", "draft acceptance", s["acceptance"], _num(s["acceptance"], 1, 100, " %")),
        ("prefix-cache-hit-rate", "prefix-cache hit rate (prompt tokens of computed jobs)",
         s["prefix_cache_hit_rate"], _num(s["prefix_cache_hit_rate"], 1, 100, " %")),
        ("answered-from-cache", "answered from the result cache", s["answered_from_cache"],
         str(s["answered_from_cache"])),
        ("duplicates-run-once", "run once for an earlier job asking the same", s["duplicates_run_once"],
         str(s["duplicates_run_once"])),
    ]
    for name, label, scale, digits in (("queue_wait", "queue wait", 1e3, 1), ("ttft", "TTFT", 1e3, 1),
                                       ("tpot", "TPOT", 1e3, 2), ("latency", "latency (start → finish)", 1e3, 1)):
        for q in (50, 99):
            v = s[f"{name}_p{q}"]
            rows.append((f"{name.replace('_', '-')}-p{q}", f"{label} p{q}", v, _num(v, digits, scale, " ms")))
    body = "".join(f'<tr data-key="{key}"><th>{_e(label)}</th>{_cell(value, shown, id=f"summary-{key}")}</tr>'
                   for key, label, value, shown in rows)
    return f'<table id="summary">{body}</table>'


def failures_table(by_cause: dict[str, int]) -> str:
    if not by_cause:
        return '<p class="none" id="causes-none">no failed jobs</p>'
    rows = "".join(f'<tr><td class="cause">{_e(c)}</td>{_cell(n, str(n), cls="num count")}</tr>'
                   for c, n in sorted(by_cause.items(), key=lambda kv: (-kv[1], kv[0])))
    return f'<table id="causes"><tr><th>error_type</th><th>jobs</th></tr>{rows}</table>'


def slowest_table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return '<p class="none" id="slowest-none">no succeeded jobs</p>'
    head = ("<tr><th>#</th><th>custom_id</th><th>job id</th><th>line</th><th>latency</th><th>queue wait</th>"
            "<th>TTFT</th><th>TPOT</th><th>prompt tokens</th><th>output tokens</th><th>worker</th></tr>")
    body = "".join(
        f'<tr class="job" data-job-id="{_e(r["id"])}"><td class="num">{i}</td>'
        f'<td class="custom-id">{_e(r["custom_id"])}</td><td class="id">{_e(r["id"])}</td>'
        f'{_cell(r["line_no"], _int(r["line_no"]), cls="num line")}'
        f'{_cell(r["latency_s"], _num(r["latency_s"], 3, unit=" s"), cls="num latency")}'
        f'{_cell(r["queue_wait_s"], _num(r["queue_wait_s"], 3, unit=" s"), cls="num queue-wait")}'
        f'{_cell(r["ttft_s"], _num(r["ttft_s"], 1, 1e3, " ms"), cls="num ttft")}'
        f'{_cell(r["tpot_s"], _num(r["tpot_s"], 2, 1e3, " ms"), cls="num tpot")}'
        f'{_cell(r["num_prompt_tokens"], _int(r["num_prompt_tokens"]), cls="num prompt-tokens")}'
        f'{_cell(r["num_output_tokens"], _int(r["num_output_tokens"]), cls="num output-tokens")}'
        f'<td class="worker">{_e(r["worker"])}</td></tr>'
        for i, r in enumerate(rows, start=1))
    return f'<table id="slowest">{head}{body}</table>'


def failed_table(rows: list[dict[str, Any]], total: int) -> str:
    if not rows:
        return '<p class="none" id="failed-none">no failed jobs</p>'
    head = ("<tr><th>line</th><th>custom_id</th><th>job id</th><th>error_type</th><th>error</th><th>latency</th>"
            "<th>output tokens</th></tr>")
    body = "".join(
        f'<tr class="job" data-job-id="{_e(r["id"])}">'
        f'{_cell(r["line_no"], _int(r["line_no"]), cls="num line")}'
        f'<td class="custom-id">{_e(r["custom_id"])}</td><td class="id">{_e(r["id"])}</td>'
        f'<td class="error-type">{_e(r["error_type"])}</td><td class="error">{_e(r["error"])}</td>'
        f'{_cell(r["latency_s"], _num(r["latency_s"], 3, unit=" s"), cls="num latency")}'
        f'{_cell(r["num_output_tokens"], _int(r["num_output_tokens"]), cls="num output-tokens")}</tr>'
        for r in rows)
    more = f'<p class="meta">showing {len(rows)} of {total} failed jobs</p>' if total > len(rows) else ""
    return f'<table id="failed">{head}{body}</table>{more}'


def render_html(store: Store, batch: Batch, *, now: Callable[[], float] = time.time) -> str:
    """The whole page for ``batch``, from the store."""
    counts = store.batch_counts(batch.id)
    m = load_metrics(store, batch.id)
    s = summarize(m, counts)
    causes = store.failures_by_cause([batch.id])[batch.id]
    starts = m["started_at"][np.isfinite(m["started_at"])]
    t0 = float(starts.min()) if starts.size else batch.created_at
    plots = [
        _img(histogram(m["ttft_s"][m.ok], "time to first token", "TTFT (ms)"), "plot-ttft", "TTFT histogram",
             "no TTFT recorded (no job succeeded)"),
        _img(histogram(m["tpot_s"][m.ok], "time per output token", "TPOT (ms)"), "plot-tpot", "TPOT histogram",
             "no TPOT recorded (no job produced two tokens)"),
        _img(histogram(m["queue_wait_s"][m.ok], "queue wait (enqueued → claimed)", "queue wait (ms)"),
             "plot-queue-wait", "queue wait histogram", "no queue wait recorded"),
        _img(throughput_plot(m, t0), "plot-throughput", "throughput over time", "no job finished"),
        _img(batch_size_plot(m, t0), "plot-batch-size", "batch size over time", "no job ran"),
        _img(acceptance_plot(m), "plot-acceptance", "draft acceptance per job",
             "no draft tokens: speculative decoding was off (or proposed nothing)"),
    ]
    when = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(now()))
    live = counts[QUEUED] + counts[RUNNING]
    state = f"{live} job(s) still queued or running: a snapshot" if live else "finished"
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>specbatch report {_e(batch.id)}</title><style>{CSS}</style></head>
<body>
<h1>specbatch report</h1>
<p class="meta">batch <code id="batch-id">{_e(batch.id)}</code> · name <code id="batch-name">{_e(batch.name)}</code>
 · model <code>{_e(batch.model)}</code> · input <code>{_e(batch.input_file)}</code><br>
created {_e(time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(batch.created_at)))} · {_e(state)} ·
 report made {_e(when)}</p>
<h2>Summary</h2>
{summary_table(s)}
<h2>Failures by cause</h2>
{failures_table(causes)}
<h2>Latency</h2>
<div class="plots">{"".join(plots[:3])}</div>
<h2>Throughput and batch size over time</h2>
<div class="plots">{"".join(plots[3:5])}</div>
<h2>Speculative decoding</h2>
<div class="plots">{plots[5]}</div>
<h2>Slowest jobs (start → finish)</h2>
{slowest_table(store.slowest_jobs(batch.id, SLOWEST))}
<h2>Failed jobs</h2>
{failed_table(store.failed_jobs(batch.id, FAILED_SHOWN), counts[FAILED])}
</body></html>
"""


def write_report(store: Store, batch: Batch, path: str | Path) -> Path:
    path = Path(path)
    path.write_text(render_html(store, batch), encoding="utf-8")
    return path
