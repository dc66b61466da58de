"""What ``specbatch status JOB`` prints: the job's JSON (its output line once it has ended) with
its attempts, each one's worker, end and cause, and how many were charged.

The attempts that ended without ending the job are ``job_attempts`` rows; the attempt that
holds or ended the job is the job row itself (see ``worker.store.models.JobAttempt``).
"""

from __future__ import annotations

from typing import Any

from worker.request.formats import output_line
from worker.store.models import QUEUED, TERMINAL


def attempts_view(job: Any, history: list[Any]) -> dict[str, Any]:
    """``{"total", "charged", "history": [...]}``: every attempt known, oldest first."""
    rows = [{"attempt": a.attempt, "worker": a.worker, "device": a.device, "end": a.outcome, "cause": a.cause,
             "started_at": a.started_at, "ended_at": a.ended_at, "charged": bool(a.charged)} for a in history]
    recorded = {a.attempt for a in history}
    if job.attempts and job.attempts not in recorded and job.status != QUEUED:
        ended = job.status in TERMINAL
        rows.append({"attempt": job.attempts, "worker": job.worker, "device": job.device, "end": job.status,
                     "cause": job.error if ended and job.status != "succeeded" else None,
                     "started_at": job.started_at, "ended_at": job.finished_at if ended else None,
                     "charged": True})
    return {"total": job.attempts, "charged": job.attempts - (job.attempts_forgiven or 0), "history": rows}


def job_status(job: Any, history: list[Any]) -> dict[str, Any]:
    """The JSON ``status JOB`` prints: an ended job's output line (as ``export`` writes it) with
    its attempts under ``specbatch``; a job still queued or running, its state and attempts."""
    attempts = attempts_view(job, history)
    if job.status in TERMINAL:
        line = output_line(job)
        line["specbatch"]["attempts"] = attempts
        return line
    return {"id": job.id, "custom_id": job.custom_id, "status": job.status, "worker": job.worker,
            "attempts": attempts}
