"""The Celery tasks: generate a job (or a message's group of short jobs) on this process's
engine, idempotently.

Check the store first (a job that already succeeded is never generated again), claim a new
attempt (a group's in one write), submit to the running loop, wait while the process's one
heartbeat keeps the lease fresh (which is also how a cancel is noticed: see
``worker.run.heartbeat``), then write the result fenced by the attempt number (results finishing
together in one write). The message is acked only after every job of it is written
(``acks_late``); a worker that dies before it leaves the job ``running`` with a lease that
stops being refreshed, and any worker's reaper puts it back in the queue (``worker.run.reaper``).
A worker that cannot go on (draining, a dead engine loop) gives its jobs back at once: queued,
with a new message.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from concurrent.futures import FIRST_COMPLETED, wait
from dataclasses import dataclass, replace
from typing import Any, Iterator

from celery.worker.control import control_command

from . import runtime
from engine.errors import EngineDied
from engine.messages import well_formed
from worker.dispatch.app import GROUP_TASK_NAME, TASK_NAME, app
from worker.common.config import serves
from worker.store.dbretry import with_db_retry
from worker.request.logprobs import Pieces, pack
from worker.request.cache_key import cache_key
from worker.store.models import FAILED, SUCCEEDED
from worker.dispatch.publish import message_job_ids, publish_groups, publish_jobs
from worker.request.convert import WorkRequest, request_from_row
from worker.store.leases import Claim

log = logging.getLogger(__name__)


def hand_back(job_ids: list[str], queue: str) -> str:
    """Not taking this message (draining or dead): publish a copy, so it is acked, not lost."""
    try:
        publish_groups(app, [[{"id": job_id} for job_id in job_ids]], lambda _row: queue)
    except Exception:  # Redis away too: the jobs are still queued in the store; the orphan sweep has them
        log.warning("could not hand back %s; the orphan sweep will", ", ".join(job_ids)[:200], exc_info=True)
    return "handed back"


def give_back(rt: runtime.Runtime, store, job_id: str, attempt: int, job: dict[str, Any], reason: str,
              *, forgive: bool) -> str:
    """Put a claimed job back in the queue at once (queued, a new message), not failed."""
    death = engine_death(rt)
    if death is not None:  # whatever the task saw (a refused submit, a broken pipe), the death is why
        died = str(death) if isinstance(death, EngineDied) else f"engine loop died: {death!r}"
        reason = reason if died in reason else died
    at = time.time()  # the same on every retry: a give-back that went through unanswered is known by it
    if not with_db_retry("give back", lambda: store.give_back(job_id, attempt, reason, forgive=forgive, at=at),
                         until_written=True):
        return "fenced"
    try:
        publish_jobs(app, [{"id": job_id}], lambda _row: job.get("queue") or rt.queue)
    except Exception:
        log.warning("could not publish given-back %s; the orphan sweep will", job_id, exc_info=True)
    log.info("job %s attempt %s given back: %s", job_id, attempt, reason)
    return "given back"


@app.task(name=TASK_NAME, bind=True, acks_late=True, ignore_result=True)
def generate(self, job_id: str, _payload: Any = None) -> dict[str, Any]:
    """Returns a compact summary (Flower shows it as the task's result; the store has the rest).
    ``_payload``: what a message published before messages carried ids only still holds; ignored."""
    return run_jobs(self, [job_id])[0]


@app.task(name=GROUP_TASK_NAME, bind=True, acks_late=True, ignore_result=True)
def generate_group(self, jobs: list[Any]) -> dict[str, Any]:
    """Several short jobs of one message (``worker.dispatch.publish.job_groups``), each claimed, run and
    stored as if it had come alone; the message is acked once all of them are stored."""
    summaries = run_jobs(self, message_job_ids(jobs))
    return {"jobs": len(summaries), "status": dict(Counter(s["status"] for s in summaries)), "results": summaries}


def message_queue(task, rt: runtime.Runtime) -> str:
    """The queue this task's message came from: its jobs' queue, where their next message goes."""
    info = task.request.delivery_info or {}
    return info.get("routing_key") or rt.queue


@dataclass(slots=True)
class Running:
    """A claimed job in the engine, as its task waits for it."""

    index: int
    job_id: str
    attempt: int
    job: dict[str, Any]  # the claimed row's request columns (``Claim.job``)
    req: Any  # worker.request.convert.WorkRequest
    request_id: str
    handle: Any  # the engine loop's request handle (``.future``)
    deadline: float
    aborted_because: str | None = None


def run_jobs(task, job_ids: list[str]) -> list[dict[str, Any]]:
    """Claim, run and store each job; one summary per job, in order.

    Check the store first (a job that already succeeded is never generated again), claim new
    attempts (one write for all, which returns each job's request), submit them to the running
    loop, wait while the process's one heartbeat keeps the leases fresh, and write each result,
    fenced by its attempt, as it finishes (those finishing together in one write)."""
    if not job_ids:
        return []
    rt = runtime.get()
    store = runtime.store()
    queue = message_queue(task, rt)
    held = _Held(rt.group_slots if len(job_ids) > 1 else None)  # a lone job (interactive ones are) never waits here
    try:
        while held.slots is not None and not held.count and not (rt.dead or rt.draining):
            held.take(min(len(job_ids), held.slots.total))  # a group bigger than the bound still runs
        if rt.dead or rt.draining:
            outcome = hand_back(job_ids, queue)
            return [task_summary(job_id, outcome) for job_id in job_ids]
        return _run_held(task, rt, store, job_ids, queue, held)
    finally:
        held.release(held.count)


class _Held:
    """The process's group slots this task holds (``Runtime.group_slots``), one per job until
    that job is done."""

    def __init__(self, slots: runtime.JobSlots | None) -> None:
        self.slots = slots
        self.count = 0

    def take(self, n: int) -> None:
        if self.slots is not None and self.slots.take(n, timeout=1.0):  # wakes to notice a drain
            self.count = n

    def release(self, n: int = 1) -> None:
        n = min(n, self.count)
        if n > 0:
            self.slots.give(n)
            self.count -= n


def _run_held(task, rt: runtime.Runtime, store, job_ids: list[str], queue: str, held: _Held) -> list[dict[str, Any]]:
    worker = task.request.hostname or runtime.worker_name(rt.label)
    # The same time on every retry, and retried until the database answers: a claim that
    # committed before its answer was lost is known as ours on the retry. Given up on, it left
    # its job running nowhere until the reaper re-ran it as a second, charged attempt.
    claimed_at = time.time()
    claims = with_db_retry("claim", lambda: store.claim_many(
        job_ids, worker=worker, device=rt.label, lease_s=rt.settings.lease_seconds,
        max_attempts=rt.settings.max_attempts, queue=queue, at=claimed_at), until_written=True)
    outcomes: list[tuple[str, dict[str, Any] | None]] = [("skipped", None)] * len(job_ids)
    won: list[tuple[int, str, Claim]] = []
    for index, (job_id, claim) in enumerate(zip(job_ids, claims)):
        if isinstance(claim, Exception):
            log.warning("job %s not claimed: %r", job_id, claim)
            outcomes[index] = (f"skipped: claim failed: {claim!r}"[:200], None)
        elif not claim.ok:
            log.info("job %s skipped: %s", job_id, claim.reason)
            outcomes[index] = (f"skipped: {claim.reason}", None)
        else:
            won.append((index, job_id, claim))
    running: list[Running] = []
    for (index, _job_id, _claim), started in zip(won, start_claimed(rt, store, won)):
        if isinstance(started, Running):
            running.append(started)
        else:
            outcomes[index] = started
    held.release(len(job_ids) - len(running))
    if running:
        for index, outcome in wait_and_store(rt, store, running):
            outcomes[index] = outcome
            held.release()
    summaries = []
    for job_id, claim, (outcome, values) in zip(job_ids, claims, outcomes):
        won = isinstance(claim, Claim) and claim.ok
        if rt.metrics is not None and won:
            rt.metrics.observe_job(outcome.replace(" ", "_"), values, enqueued_at=claim.enqueued_at,
                                   queue_wait_s=(claim.started_at - claim.enqueued_at) if claim.enqueued_at else None)
        summaries.append(task_summary(job_id, outcome, values, custom_id=claim.job.get("custom_id") if won else None))
    return summaries


def task_summary(job_id: str, outcome: str, values: dict[str, Any] | None = None, *,
                 custom_id: str | None = None) -> dict[str, Any]:
    """The task's result as Flower shows it: what happened and the job's key figures, small."""
    summary: dict[str, Any] = {"status": outcome}
    if values:
        drafts = values.get("num_draft_tokens") or 0
        summary.update(
            tokens=values.get("num_output_tokens"),
            ttft_s=_round(values.get("ttft_s")),
            tpot_s=_round(values.get("tpot_s")),
            acceptance=round(values.get("num_accepted_tokens", 0) / drafts, 3) if drafts else None,
            finish_reason=values.get("finish_reason"),
        )
        if values.get("error"):
            summary["error"] = str(values["error"])[:200]
    summary.update(custom_id=custom_id, job=job_id)
    return summary


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


Started = Running | tuple[str, dict[str, Any] | None]


def start_claimed(rt: runtime.Runtime, store, claimed: list[tuple[int, str, Claim]]) -> list[Started]:
    """Submit a message's claimed jobs (index, job id, claim: whose ``job`` holds the request
    columns) to the engine in one call, so they join the same step; for each, its ``Running``
    or what happened to it at once (failed as invalid or for the wrong model, given back)."""
    started: list[Started | None] = [None] * len(claimed)
    submitting: list[tuple[int, Any]] = []  # (position in claimed, WorkRequest)
    for pos, (_index, job_id, claim) in enumerate(claimed):
        try:
            started[pos] = _refused(rt, store, job_id, claim.attempt, claim.job)
            if started[pos] is None:
                submitting.append((pos, request_from_row(claim.job)))
        except ValueError as exc:  # bad input: fail this job only, never retry it
            started[pos] = _invalid(store, job_id, claim.attempt, exc)
        except Exception as exc:  # a worker-side fault, not the job's: give it back, counted
            started[pos] = _crashed(rt, store, job_id, claim.attempt, claim.job, exc)
    if submitting:
        submitting = tokenized(rt.batch_tokenizer() if len(submitting) > 1 else rt.tokenizer, submitting)
        requests = [dict(prompt=req.prompt, messages=req.messages, params=req.params,
                         request_id=f"{claimed[pos][1]}#{claimed[pos][2].attempt}", priority=req.priority,
                         cache_salt=req.cache_salt)
                    for pos, req in submitting]
        try:
            handles: list[Any] = rt.loop.submit_many(requests)
            why = None
        except RuntimeError as exc:  # the loop is shutting down or dead
            why = f"engine unavailable: {exc}"
        except OSError as exc:  # the engine process's pipe broke: it is dying (``give_back`` names why)
            why = f"engine unavailable: {exc!r}"
        for n, (pos, req) in enumerate(submitting):
            index, job_id, claim = claimed[pos]
            try:
                if why is not None:
                    started[pos] = (give_back(rt, store, job_id, claim.attempt, claim.job, why, forgive=True), None)
                elif isinstance(handles[n], ValueError):
                    started[pos] = _invalid(store, job_id, claim.attempt, handles[n])
                else:
                    started[pos] = _running(rt, store, index, job_id, claim, req, requests[n]["request_id"], handles[n])
            except Exception as exc:
                started[pos] = _crashed(rt, store, job_id, claim.attempt, claim.job, exc)
    return started  # type: ignore[return-value]


def tokenized(tokenizer: Any, submitting: list[tuple[int, WorkRequest]]) -> list[tuple[int, WorkRequest]]:
    """The requests with their text prompts and conversations as token ids, tokenized in one
    batched call (``runtime.prompt_tokenizer``); a malformed conversation, an empty prompt or one
    the tokenizer fails on goes to the engine as it came, which refuses it in its own words."""
    todo = [n for n, (_pos, req) in enumerate(submitting)
            if well_formed(req.messages) or (req.messages is None and isinstance(req.prompt, str) and req.prompt)]
    if tokenizer is None or not todo:
        return submitting
    try:
        ids = tokenizer.tokenize_many([submitting[n][1] for n in todo])
    except Exception as exc:  # the batched call itself failed: the engine tokenizes each alone
        log.warning("tokenizing %d prompts for the engine failed (%r): the engine tokenizes them", len(todo), exc)
        return submitting
    out = list(submitting)
    for n, got in zip(todo, ids):
        if isinstance(got, list) and got:
            pos, req = submitting[n]
            out[n] = (pos, replace(req, prompt=got, messages=None))
    return out


def _refused(rt: runtime.Runtime, store, job_id: str, attempt: int, job: dict[str, Any]) -> Started | None:
    """What happens at once to a job this worker must not run (the wrong model; a worker that
    is draining or whose engine is gone), or None: it goes to the engine."""
    if not serves(rt.model, rt.settings.served_names, job["model"]):
        at = time.time()
        with_db_retry("fail", lambda: store.fail(
            job_id, attempt, f"this worker serves {rt.model!r}, not {job['model']!r}", "wrong_model", at),
            until_written=True)
        return FAILED, {"error_type": "wrong_model", "finished_at": at}
    if rt.dead or rt.draining or not rt.loop.running:
        why = "drained: the worker is shutting down" if rt.draining else "engine unavailable: worker stopping"
        return give_back(rt, store, job_id, attempt, job, why, forgive=True), None
    return None


def _invalid(store, job_id: str, attempt: int, exc: ValueError) -> Started:
    at = time.time()
    with_db_retry("fail", lambda: store.fail(job_id, attempt, str(exc), "invalid_request", at), until_written=True)
    return FAILED, {"error": str(exc), "error_type": "invalid_request", "finished_at": at}


def _crashed(rt: runtime.Runtime, store, job_id: str, attempt: int, job: dict[str, Any], exc: Exception) -> Started:
    log.error("job %s attempt %s crashed in the worker", job_id, attempt, exc_info=exc)
    return give_back(rt, store, job_id, attempt, job, f"worker error: {exc!r}", forgive=False), None


def _running(rt: runtime.Runtime, store, index: int, job_id: str, claim: Claim, req: Any, request_id: str,
             handle: Any) -> Running:
    rt.add_inflight(job_id, request_id)
    rt.heartbeats(store, rt.settings.heartbeat_seconds).track(job_id, claim.attempt, request_id)  # one thread refreshes every lease
    return Running(index, job_id, claim.attempt, claim.job, req, request_id, handle,
                   time.time() + rt.settings.max_job_seconds)


def engine_death(rt: runtime.Runtime, wait_s: float = 5.0) -> BaseException | None:
    """The engine's death, when it is dead or dying, else None (running, or stopped on purpose).

    A task meets a dying engine in many ways (a refused submit, a broken pipe, ``rt.dead``, a
    failed handle) before the engine has recorded why: its process's reader records the error
    only once the child has exited (up to 2 s), so wait for it up to ``wait_s``. An engine that
    refuses requests while nobody asked it to stop is dying, even while its process has not yet
    exited (``running`` still true): a job claimed again in that window was given back as
    "the engine is shutting down"."""
    loop = rt.loop
    if loop.error is None and ((loop.running and loop.accepting and not rt.dead) or loop.stop_requested):
        return None
    deadline = time.monotonic() + wait_s
    while loop.error is None and not loop.stop_requested and time.monotonic() < deadline:
        time.sleep(0.02)
    return loop.error


def wait_and_store(rt: runtime.Runtime, store,
                   running: list[Running]) -> Iterator[tuple[int, tuple[str, dict[str, Any] | None]]]:
    """Wait for the running jobs; store each result as it finishes (those finishing together
    in one write) and yield (index, (what happened, the result columns written))."""
    heartbeat = rt.heartbeats(store, rt.settings.heartbeat_seconds)
    pending = {r.request_id: r for r in running}
    try:
        while pending:
            wait([r.handle.future for r in pending.values()], timeout=rt.settings.heartbeat_seconds,
                 return_when=FIRST_COMPLETED)
            now = time.time()
            done: list[Running] = []
            for r in list(pending.values()):
                if r.handle.done():
                    done.append(pending.pop(r.request_id))
                elif r.aborted_because is None and now > r.deadline:
                    r.aborted_because = f"exceeded the {rt.settings.max_job_seconds:.0f} s job limit"
                    rt.loop.abort(r.request_id)
            to_store: list[tuple[Running, dict[str, Any]]] = []
            for r in done:
                # ``rt.inflight`` keeps the job until it is stored or given back: a dying worker
                # waits for that before it exits (``runtime._on_engine_death``); so does the
                # heartbeat (its lease stays fresh while the store retries through an outage).
                lost = heartbeat.lost(r.job_id, r.attempt)
                back: tuple[str, bool] | None = None  # (why, forgive) when the job goes back to the queue
                try:
                    out = r.handle.result(0)
                    values = result_values(out, logprobs=r.req.params.logprobs, pieces=rt.loop.token_pieces,
                                           structured=r.req.params.structured_outputs)
                except EngineDied as exc:
                    # Not this job's fault as far as we know; counted, so a job that kills every
                    # engine it meets still ends (attempts exhausted).
                    back = (str(exc), False)
                except Exception as exc:  # a worker-side fault, not the job's: give it back, counted
                    log.exception("job %s attempt %s crashed in the worker", r.job_id, r.attempt)
                    back = (f"worker error: {exc!r}", False)
                else:
                    aborted_because = r.aborted_because or lost
                    if values["finish_reason"] == "abort" and aborted_because is None and rt.draining:
                        back = ("drained: the worker is shutting down", True)
                    elif aborted_because is not None and values["status"] == SUCCEEDED:
                        values.update(status=FAILED, error=f"aborted: {aborted_because}", error_type="aborted")
                    elif values["finish_reason"] == "abort" and values["status"] == SUCCEEDED:
                        values.update(status=FAILED, error="aborted", error_type="aborted")
                if back is not None:
                    outcome = give_back(rt, store, r.job_id, r.attempt, r.job, back[0], forgive=back[1])
                    heartbeat.untrack(r.job_id, r.attempt)
                    rt.forget_inflight(r.job_id, r.request_id)
                    yield r.index, (outcome, None)
                    continue
                to_store.append((r, values))
            if to_store:
                cache = cache_entries(rt, store, to_store)
                stored = with_db_retry("store result", lambda: store.finish_many(
                    [(r.job_id, r.attempt, values) for r, values in to_store], cache), until_written=True)
                for (r, values), ok in zip(to_store, stored):
                    heartbeat.untrack(r.job_id, r.attempt)
                    rt.forget_inflight(r.job_id, r.request_id)
                    if ok:
                        log.info("job %s attempt %s stored: %s", r.job_id, r.attempt, values["status"])
                        yield r.index, (values["status"], values)
                    else:
                        log.info("job %s attempt %s result refused (cancelled or superseded)", r.job_id, r.attempt)
                        yield r.index, ("fenced", values)
    finally:
        for r in running:  # an error above: those not stored stay running; their leases expire
            heartbeat.untrack(r.job_id, r.attempt)
            rt.forget_inflight(r.job_id, r.request_id)


def cache_entries(rt: runtime.Runtime, store, results: list[tuple[Running, dict[str, Any]]]) -> dict[str, tuple[str, str]]:
    """job id -> (result cache key, model key) of the results that may be cached: greedy or
    seeded jobs (they have a request digest) on a model whose identity is known."""
    keyed = [r for r, _values in results if r.job.get("request_digest")]
    model = rt.cache_model(store) if keyed else None
    if model is None:
        return {}
    return {r.job_id: (cache_key(model, r.job["request_digest"]), model) for r in keyed}


def result_values(out, *, logprobs: int | None = None, pieces: Pieces | None = None,
                  structured=None) -> dict[str, Any]:
    """Store columns from a finished ``RequestOutput``: text, tokens, timings, counts.

    ``outputs`` holds every sample when there are several or when logprobs were asked for
    (``logprobs`` alternatives per position, packed with ``pieces``: see ``worker.request.logprobs``).
    ``structured`` (the request's ``StructuredOutputsParams``): a generated job succeeds only
    if every sample is complete and valid (``worker.request.structured``).
    """
    m = out.metrics
    first = out.outputs[0] if out.outputs else None
    finished = m.finished_time or m.last_token_time or time.time()
    if first is None:
        error = out.error or "no output"
    else:
        error = out.error or ("generation error" if first.finish_reason == "error" else None)
    gen_time = finished - m.arrival_time if m.arrival_time else None
    values: dict[str, Any] = {
        "status": FAILED if error else SUCCEEDED,
        "error": error,
        # A grammar that does not compile is the request's fault, not the worker's.
        "error_type": (None if not error else "invalid_request" if error.startswith("structured_outputs:")
                       else "generation_error"),
        "output_text": first.text if first else None,
        "output_token_ids": list(first.token_ids) if first else None,
        "outputs": _samples(out, logprobs, pieces),
        "finish_reason": first.finish_reason if first else "error",
        "first_scheduled_at": m.first_scheduled_time,
        "first_token_at": m.first_token_time,
        "finished_at": finished,
        "ttft_s": m.ttft,
        "tpot_s": m.tpot,
        "tokens_per_s": (m.num_output_tokens / gen_time) if gen_time and gen_time > 0 else None,
        "num_prompt_tokens": m.num_prompt_tokens or len(out.prompt_token_ids),
        "num_cached_tokens": m.num_cached_tokens,
        "num_output_tokens": m.num_output_tokens,
        "num_draft_tokens": m.num_draft_tokens,
        "num_accepted_tokens": m.num_accepted_tokens,
        "num_preemptions": m.num_preemptions,
        "num_steps": m.num_steps,
        "max_batch_size": m.max_batch_size,
        "num_waiting_steps": m.num_waiting_steps,
    }
    if structured is not None and values["status"] == SUCCEEDED and first.finish_reason != "abort":
        from worker.request.structured import check_samples

        problem = check_samples(structured, [(c.text, c.finish_reason, len(c.token_ids)) for c in out.outputs])
        if problem is not None:
            values.update(status=FAILED, error_type=problem[0], error=problem[1])
    return values


def _samples(out, logprobs: int | None, pieces: Pieces | None) -> list[dict[str, Any]] | None:
    want = logprobs is not None and pieces is not None
    if len(out.outputs) < 2 and not want:
        return None
    samples = []
    for c in out.outputs:
        sample = {"text": c.text, "token_ids": list(c.token_ids), "finish_reason": c.finish_reason}
        if want and c.logprobs is not None:
            sample.update(pack(sample["token_ids"], c.logprobs, logprobs, pieces))
        samples.append(sample)
    return samples


@control_command(args=[("job_ids", list)], signature="<job_id> [job_id …]")
def specbatch_cancel(state, job_ids: list[str] | None = None) -> dict[str, Any]:
    """Abort these jobs in this worker's engine loop if it is generating them."""
    rt = runtime.current()
    aborted = rt.abort_jobs(list(job_ids or [])) if rt is not None else []
    return {"ok": aborted}
