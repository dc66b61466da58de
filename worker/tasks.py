"""The one Celery task: generate a job on this process's engine, idempotently.

Check the store first (a job that already succeeded is never generated again), claim a new
attempt, submit to the running loop, wait while the process's one heartbeat keeps the lease
fresh (which is also how a cancel is noticed: see ``worker.heartbeat``), then write the result
fenced by the attempt number. The message is acked only after that write (``acks_late``); a
worker that dies before it leaves the job ``running`` with a lease that stops being refreshed,
and any worker's reaper puts it back in the queue (``worker.reaper``). A worker that cannot go
on (draining, a dead engine loop) gives its jobs back at once: queued, with a new message.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from celery.worker.control import control_command

from . import runtime
from .app import TASK_NAME, app
from .config import env, max_job_seconds, model_slug
from .dbretry import with_db_retry
from .logprobs import Pieces, pack
from .models import FAILED, SUCCEEDED
from .request import request_from_payload

log = logging.getLogger(__name__)


def lease_seconds() -> float:
    """A running attempt whose heartbeat is older than this is presumed dead."""
    return float(env("LEASE_SECONDS", "60"))


def heartbeat_seconds() -> float:
    return float(env("HEARTBEAT_SECONDS", "2"))


def max_attempts() -> int:
    return int(env("MAX_ATTEMPTS", "3"))


def hand_back(rt: runtime.Runtime, job_id: str, payload: dict[str, Any]) -> str:
    """Not taking this message (draining or dead): publish a copy, so it is acked, not lost."""
    from .publish import publish_jobs

    try:
        publish_jobs(app, [payload], lambda _row: rt.queue_of(payload))
    except Exception:  # Redis away too: the job is still queued in the store; the orphan sweep has it
        log.warning("could not hand back %s; the orphan sweep will", job_id, exc_info=True)
    return "handed back"


def give_back(rt: runtime.Runtime, store, job_id: str, attempt: int, payload: dict[str, Any], reason: str,
              *, forgive: bool) -> str:
    """Put a claimed job back in the queue at once (queued, a new message), not failed."""
    from .publish import publish_jobs

    if not with_db_retry("give back", lambda: store.give_back(job_id, attempt, reason, forgive=forgive)):
        return "fenced"
    try:
        publish_jobs(app, [dict(payload, id=job_id)], lambda _row: rt.queue_of(payload))
    except Exception:
        log.warning("could not publish given-back %s; the orphan sweep will", job_id, exc_info=True)
    log.info("job %s attempt %s given back: %s", job_id, attempt, reason)
    return "given back"


@app.task(name=TASK_NAME, bind=True, acks_late=True, ignore_result=True)
def generate(self, job_id: str, payload: dict[str, Any]) -> dict[str, Any]:
    """Returns a compact summary (Flower shows it as the task's result; the store has the rest)."""
    rt = runtime.get()
    store = runtime.store()
    if not isinstance(payload, dict):  # a hostile message: the job (if any) fails as invalid below
        payload = {"malformed_payload": repr(payload)[:200]}
    if rt.dead or rt.draining:
        return task_summary(job_id, payload, hand_back(rt, job_id, payload))
    worker = self.request.hostname or runtime.worker_name(rt.label)
    claim = with_db_retry("claim", lambda: store.claim(
        job_id, worker=worker, device=rt.label, lease_s=lease_seconds(), max_attempts=max_attempts(),
        payload=payload, queue=rt.queue_of(payload),
    ))
    if not claim.ok:
        log.info("job %s skipped: %s", job_id, claim.reason)
        return task_summary(job_id, payload, f"skipped: {claim.reason}")
    attempt = claim.attempt
    values: dict[str, Any] | None = None
    if model_slug(payload.get("model", rt.model)) != model_slug(rt.model):
        values = {"error_type": "wrong_model", "finished_at": time.time()}
        with_db_retry("fail", lambda: store.fail(
            job_id, attempt, f"this worker serves {rt.model!r}, not {payload.get('model')!r}", "wrong_model"))
        outcome = FAILED
    else:
        try:
            outcome, values = run_claimed(rt, store, job_id, attempt, payload)
        except Exception as exc:  # a worker-side fault, not the job's: give it back, counted
            log.exception("job %s attempt %s crashed in the worker", job_id, attempt)
            outcome = give_back(rt, store, job_id, attempt, payload, f"worker error: {exc!r}", forgive=False)
    if rt.metrics is not None:
        rt.metrics.observe_job(outcome.replace(" ", "_"), values, enqueued_at=claim.enqueued_at,
                               queue_wait_s=(claim.started_at - claim.enqueued_at) if claim.enqueued_at else None)
    return task_summary(job_id, payload, outcome, values)


def task_summary(job_id: str, payload: dict[str, Any], outcome: str,
                 values: dict[str, Any] | None = None) -> dict[str, Any]:
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
    summary.update(custom_id=payload.get("custom_id"), job=job_id)
    return summary


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def run_claimed(rt: runtime.Runtime, store, job_id: str, attempt: int,
                payload: dict[str, Any]) -> tuple[str, dict[str, Any] | None]:
    """Generate a claimed job; return what happened (succeeded, failed, given back, fenced) and
    the result columns written, if any."""
    from engine.loop import EngineDied  # lazily: Flower imports this module and needs no torch

    request_id = f"{job_id}#{attempt}"
    if rt.dead or rt.draining or not rt.loop.running:
        why = "drained: the worker is shutting down" if rt.draining else "worker stopping"
        return give_back(rt, store, job_id, attempt, payload, why, forgive=True), None
    try:
        req = request_from_payload(payload)
        handle = rt.loop.submit(req.prompt, messages=req.messages, params=req.params, request_id=request_id,
                                priority=req.priority)
    except ValueError as exc:  # bad input: fail this job only, never retry it
        with_db_retry("fail", lambda: store.fail(job_id, attempt, str(exc), "invalid_request"))
        return FAILED, {"error": str(exc), "error_type": "invalid_request", "finished_at": time.time()}
    except RuntimeError as exc:  # the loop is shutting down or dead
        return give_back(rt, store, job_id, attempt, payload, f"engine unavailable: {exc}", forgive=True), None
    rt.inflight[job_id] = request_id
    heartbeat = rt.heartbeats(store, heartbeat_seconds())  # one thread refreshes every job's lease
    heartbeat.track(job_id, attempt, request_id)
    deadline = time.time() + max_job_seconds()
    aborted_because: str | None = None
    try:
        while True:
            try:
                out = handle.result(timeout=heartbeat_seconds())
                break
            except TimeoutError:
                if aborted_because is None and time.time() > deadline:
                    aborted_because = f"exceeded the {max_job_seconds():.0f} s job limit"
                    rt.loop.abort(request_id)
            except EngineDied as exc:
                # Not this job's fault as far as we know; counted, so a job that kills every
                # engine it meets still ends (attempts exhausted).
                return give_back(rt, store, job_id, attempt, payload, str(exc), forgive=False), None
    finally:
        lost = heartbeat.untrack(job_id)
        rt.inflight.pop(job_id, None)
    aborted_because = aborted_because or lost
    values = result_values(out, logprobs=req.params.logprobs, pieces=rt.loop.token_pieces,
                           structured=req.params.structured_outputs)
    if values["finish_reason"] == "abort" and aborted_because is None and rt.draining:
        return give_back(rt, store, job_id, attempt, payload, "drained: the worker is shutting down",
                         forgive=True), None
    if aborted_because is not None and values["status"] == SUCCEEDED:
        values.update(status=FAILED, error=f"aborted: {aborted_because}", error_type="aborted")
    elif values["finish_reason"] == "abort" and values["status"] == SUCCEEDED:
        values.update(status=FAILED, error="aborted", error_type="aborted")
    if not with_db_retry("store result", lambda: store.finish(job_id, attempt, values)):
        log.info("job %s attempt %s result refused (cancelled or superseded)", job_id, attempt)
        return "fenced", values
    log.info("job %s attempt %s stored: %s", job_id, attempt, values["status"])
    return values["status"], values


def result_values(out, *, logprobs: int | None = None, pieces: Pieces | None = None,
                  structured=None) -> dict[str, Any]:
    """Store columns from a finished ``RequestOutput``: text, tokens, timings, counts.

    ``outputs`` holds every sample when there are several or when logprobs were asked for
    (``logprobs`` alternatives per position, packed with ``pieces``: see ``worker.logprobs``).
    ``structured`` (the request's ``StructuredOutputsParams``): a generated job succeeds only
    if every sample is complete and valid (``worker.structured``).
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
        from .structured import check_samples

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
