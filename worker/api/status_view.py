"""What ``specbatch status`` shows: workers, and per batch its progress, recent throughput, ETA
and failures by cause, as rich renderables refreshed in a ``Live`` view or printed once.

Every number is an aggregate query on the store (``Store.counts_by_batch``,
``finished_stats``, ``failures_by_cause``): a refresh never reads job rows, so watching a
million-job batch costs the same as watching ten. Throughput is measured over a recent
window (the last ``window_s`` seconds; a finished batch's whole run), so the ETA follows the
current pace, not the average since a slow start.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Sequence

from rich import box
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from worker.common.config import settings
from worker.store.models import CANCELLED, FAILED, QUEUED, RUNNING, SUCCEEDED, W_EXITED, W_FAILED, W_STOPPED, Batch
from worker.store.store import Store
from worker.api.summary import percentile

DEFAULT_WINDOW_S = 60.0


@dataclass(slots=True)
class BatchView:
    """One batch's live numbers (rates None while nothing has finished in the window)."""

    id: str
    name: str | None
    model: str
    counts: dict[str, int]
    failures: dict[str, int] = field(default_factory=dict)
    output_tokens: int = 0
    jobs_per_s: float | None = None
    tokens_per_s: float | None = None
    window_s: float | None = None
    finished_at: float | None = None
    reading: bool = False  # its input is still being read (more jobs are on their way)
    ttft_p50: float | None = None
    tpot_p50: float | None = None

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    @property
    def done(self) -> int:
        return self.counts[SUCCEEDED] + self.counts[FAILED] + self.counts[CANCELLED]

    @property
    def left(self) -> int:
        return self.counts[QUEUED] + self.counts[RUNNING]

    @property
    def eta_s(self) -> float | None:
        """Seconds to go at the recent pace: 0 when done, None when nothing moves."""
        if self.left == 0:
            return 0.0
        return self.left / self.jobs_per_s if self.jobs_per_s else None


@dataclass(slots=True)
class Snapshot:
    taken_at: float
    batches: list[BatchView]
    workers: list[Any]  # worker.store.models.Worker rows
    running_by_worker: dict[str, int]
    single_jobs: list[dict[str, Any]] = field(default_factory=list)  # newest jobs outside any batch
    lease_s: float = 60.0  # a worker whose heartbeat is older is shown ``lost``
    cache: dict[str, Any] | None = None  # ``Store.cache_stats()``

    @property
    def active(self) -> bool:
        return any(b.left or b.reading for b in self.batches)


def batch_views(store: Store, batches: Sequence[Batch], now: float, window_s: float = DEFAULT_WINDOW_S,
                latencies: bool = False) -> list[BatchView]:
    """Numbers for ``batches`` in three grouped queries (plus recent latencies if asked)."""
    ids = [b.id for b in batches]
    counts = store.counts_by_batch(ids)
    failures = store.failures_by_cause(ids)
    stats = store.finished_stats(ids, since=now - window_s)
    views = []
    for b in batches:
        v = BatchView(b.id, b.name, b.model, counts[b.id], failures[b.id], finished_at=b.finished_at,
                      reading=b.ingested_at is None)
        s = stats.get(b.id)
        if s is not None:
            v.output_tokens = int(s["output_tokens"] or 0)
            first, last = s["first_started"], s["last_finished"]
            if v.left:  # live: the last window_s seconds (or since the first start, if later)
                span = min(window_s, now - first) if first is not None else None
                jobs, tokens = s["recent_jobs"], s["recent_output_tokens"]
            else:  # done: its whole run
                span = (last - first) if first is not None and last is not None else None
                jobs, tokens = s["jobs"], s["output_tokens"]
            if span and span > 0:
                v.window_s = span
                v.jobs_per_s = jobs / span
                v.tokens_per_s = tokens / span
        if latencies:
            since = now - window_s if v.left else 0.0
            rows = store.recent_latencies(b.id, since)
            v.ttft_p50 = percentile([r[0] for r in rows if r[0] is not None], 50)
            v.tpot_p50 = percentile([r[1] for r in rows if r[1] is not None], 50)
        views.append(v)
    return views


def take_snapshot(store: Store, batch: Batch | None = None, *, window_s: float = DEFAULT_WINDOW_S,
                  limit: int = 20) -> Snapshot:
    """Workers plus one batch (with its recent latencies) or the ``limit`` newest batches."""
    now = time.time()
    batches = [batch] if batch is not None else store.batches(limit)
    return Snapshot(now, batch_views(store, batches, now, window_s, latencies=batch is not None),
                    store.workers(), store.running_counts_by_worker(),
                    store.single_jobs(limit) if batch is None else [], lease_s=settings().lease_seconds,
                    cache=store.cache_stats())


# ---- rendering -----------------------------------------------------------------------------
def fmt_duration(s: float | None) -> str:
    if s is None:
        return "-"
    s = int(round(s))
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h}:{m:02d}:{sec:02d}" if h else f"{m}:{sec:02d}"


def fmt_rate(v: float | None, unit: str, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f} {unit}"


def fmt_failures(failures: dict[str, int]) -> str:
    return ", ".join(f"{cause} {n}" for cause, n in sorted(failures.items(), key=lambda kv: (-kv[1], kv[0]))) or "none"


def shown_state(worker: Any, now: float, lease_s: float) -> str:
    """A worker's state as its heartbeat tells it: ``exited N`` once its exit was recorded,
    ``lost`` once its heartbeat is older than a lease (a SIGKILL, an OOM kill, a lost host
    record nothing: the last state they wrote was ``ready``), else the state it recorded."""
    if worker.state == W_EXITED:
        return f"exited {worker.exit_code}" if worker.exit_code is not None else "exited"
    if worker.state in (W_STOPPED, W_FAILED):
        return worker.state
    if worker.heartbeat_at is None or now - worker.heartbeat_at > lease_s:
        return "lost"
    return worker.state


def workers_table(snap: Snapshot) -> RenderableType | None:
    """Workers by node name, two lines each so any name fits 80 columns whole: the name and
    the state its heartbeat tells, then device, running jobs, heartbeat age, starts, failures
    and queue; a crash-looping one shows many starts and failures, and its last error."""
    if not snap.workers:
        return None
    lines: list[RenderableType] = [Text("workers", style="bold")]
    for w in snap.workers:
        beat = f"{snap.taken_at - w.heartbeat_at:.0f} s ago" if w.heartbeat_at else "-"
        shown = shown_state(w, snap.taken_at, snap.lease_s)
        dead = shown == "lost" or (shown.startswith("exited") and shown != "exited 0")
        if w.failures >= 3 and (dead or shown in ("failed", "starting")):
            shown += " (crash loop?)"
        lines.append(Text.assemble((w.name, "bold"), "  ", (shown, "red" if dead or "crash" in shown else "green")))
        lines.append(Text(f"  {w.device or '-'}  running {snap.running_by_worker.get(w.name, 0)}  heartbeat {beat}"
                          f"  starts {w.starts}  fails {w.failures}  queue {w.queue or '-'}", overflow="fold"))
        if w.error:
            lines.append(Text.assemble("  last error: ", (w.error[:300], "red"), overflow="fold"))
    return Group(*lines)


def batch_line(b: BatchView) -> RenderableType:
    """One batch in two lines: its whole id and name, then bar, counts, pace, ETA, failures."""
    head = Text.assemble((b.id, "bold cyan"), f"  {b.name or ''}  ", (f"model {b.model}", "dim"))
    row = Table.grid(padding=(0, 1))
    row.add_column(no_wrap=True)
    row.add_column(no_wrap=True)
    row.add_column(overflow="fold")
    pct = 100.0 * b.done / b.total if b.total else 100.0
    eta = "reading input" if b.reading else "done" if not b.left else fmt_duration(b.eta_s)
    facts = (f"{b.done}/{b.total} ({pct:.0f} %)  failed {b.counts[FAILED]}  {fmt_rate(b.jobs_per_s, 'jobs/s', 2)}  "
             f"{fmt_rate(b.tokens_per_s, 'tok/s')}  ETA {eta}")
    if b.failures:
        facts += f"  ({fmt_failures(b.failures)})"
    row.add_row(" ", ProgressBar(total=max(b.total, 1), completed=b.done, width=20), facts)
    return Group(head, row)


def batches_list(snap: Snapshot) -> RenderableType:
    if not snap.batches:
        return Text("no batches", style="dim")
    return Group(Text("batches", style="bold"), *(batch_line(b) for b in snap.batches))


def batch_detail(b: BatchView) -> RenderableType:
    """One batch in full: a block of short lines that stays readable at 80 columns."""
    pct = 100.0 * b.done / b.total if b.total else 100.0
    rows = Table.grid(padding=(0, 2))
    rows.add_column(style="bold", no_wrap=True)
    rows.add_column(overflow="fold")
    c = b.counts
    rows.add_row("jobs", f"succeeded {c[SUCCEEDED]}  failed {c[FAILED]}  cancelled {c[CANCELLED]}  "
                         f"running {c[RUNNING]}  queued {c[QUEUED]}")
    window = "whole run" if not b.left else f"last {fmt_duration(b.window_s)}" if b.window_s else "no job finished yet"
    rows.add_row("throughput", f"{fmt_rate(b.jobs_per_s, 'jobs/s', 2)}  {fmt_rate(b.tokens_per_s, 'output tok/s')}  "
                               f"({window})")
    rows.add_row("output tokens", str(b.output_tokens))
    rows.add_row("latency p50", f"TTFT {fmt_rate(None if b.ttft_p50 is None else b.ttft_p50 * 1e3, 'ms')}  "
                                f"TPOT {fmt_rate(None if b.tpot_p50 is None else b.tpot_p50 * 1e3, 'ms', 2)}")
    rows.add_row("ETA", "- (still reading its input)" if b.reading else "done" if not b.left else fmt_duration(b.eta_s) if b.eta_s is not None else "- (nothing finished lately)")
    rows.add_row("failures", fmt_failures(b.failures))
    bar = Table.grid(padding=(0, 1))
    bar.add_column(no_wrap=True)
    bar.add_column(no_wrap=True)
    bar.add_row(ProgressBar(total=max(b.total, 1), completed=b.done, width=40), f"{b.done}/{b.total} ({pct:.0f} %)")
    head = Text.assemble(("batch ", "bold"), (b.id, "bold cyan"), f"  {b.name or ''}  model {b.model}")
    return Group(head, bar, rows)


def jobs_table(snap: Snapshot) -> RenderableType | None:
    """Jobs submitted alone (``specbatch submit``), newest first: whole ids, within 80 columns."""
    if not snap.single_jobs:
        return None
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True, show_edge=False)
    table.add_column("job", no_wrap=True)  # an id: never cut
    table.add_column("status", no_wrap=True)
    table.add_column("age", justify="right", no_wrap=True)
    table.add_column("model / custom_id", overflow="fold")
    for j in snap.single_jobs:
        age = fmt_duration(snap.taken_at - j["enqueued_at"]) if j["enqueued_at"] else "-"
        label = j["model"] + (f" / {j['custom_id']}" if j["custom_id"] else "")
        table.add_row(j["id"], j["status"], age, label)
    return Group(Text("single jobs", style="bold"), table)


def cache_line(stats: dict[str, Any], max_bytes: int | None = None) -> str:
    """The result cache in one line: entries and size (of its bound), hits, misses, duplicates."""
    size = f"{stats['bytes'] / 2**10:,.1f} KiB" + (f" of {max_bytes / 2**20:,.0f} MiB" if max_bytes else "")
    rate = "-" if stats["hit_rate"] is None else f"{100 * stats['hit_rate']:.0f} %"
    return (f"result cache: {stats['entries']} entries, {size}; hits {stats['hits']}, misses {stats['misses']} "
            f"(hit rate {rate}), duplicates run once {stats['duplicates']}")


def render(snap: Snapshot, detail: bool) -> RenderableType:
    parts: list[RenderableType] = []
    workers = workers_table(snap)
    if workers is not None:
        parts.append(workers)
    if detail:
        parts += [batch_detail(b) for b in snap.batches]
    else:
        parts.append(batches_list(snap))
        jobs = jobs_table(snap)
        if jobs is not None:
            parts.append(jobs)
    if snap.cache is not None and (snap.cache["entries"] or snap.cache["hits"] or snap.cache["misses"]):
        parts.append(Text(cache_line(snap.cache, settings().cache_max_bytes)))
    parts.append(Text(time.strftime("as of %Y-%m-%d %H:%M:%S", time.localtime(snap.taken_at)), style="dim"))
    return Group(*parts)


def show(store: Store, console: Console, batch: Batch | None = None, *, watch: bool = False, interval: float = 1.0,
         window_s: float = DEFAULT_WINDOW_S) -> None:
    """Print one snapshot, or refresh it live until the batch is done (Ctrl-C ends it too;
    without a batch, only Ctrl-C ends it)."""
    detail = batch is not None
    snap = take_snapshot(store, batch, window_s=window_s)
    if not watch:
        console.print(render(snap, detail))
        return
    try:
        with Live(render(snap, detail), console=console, auto_refresh=False, transient=False) as live:
            while not (detail and not snap.active):
                time.sleep(interval)
                snap = take_snapshot(store, batch, window_s=window_s)
                live.update(render(snap, detail), refresh=True)
    except KeyboardInterrupt:
        pass
