"""One heartbeat for all the jobs a worker process is generating.

Each running attempt holds a lease that must be refreshed while it runs (a job whose heartbeat
grows old is presumed lost and re-queued), and a refresh that no longer matches tells the
worker the job was cancelled or superseded, so it aborts the generation. Refreshing each job
from its own task thread cost one database write per job per interval: 64 running jobs at 2 s
were 32 writes/s, enough CPU to slow the engine on a 2-core machine (queue/in-process 0.90x
with per-job beats, 0.99x with almost none). One thread refreshes them all in one transaction.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

from worker.common.periodic import PeriodicThread


class Heartbeat(PeriodicThread):
    """Refresh the leases of this process's running attempts every ``interval`` seconds."""

    def __init__(self, store: Any, abort: Callable[[str], None], interval: float) -> None:
        self.store = store
        self.abort = abort  # aborts an engine request by id
        self.interval = interval
        self._owned: dict[str, tuple[int, str]] = {}  # job id -> (attempt, engine request id)
        self._lost: dict[str, str] = {}  # job id -> why the tracked attempt no longer owns it
        self._superseded: dict[tuple[str, int], str] = {}  # (job id, older attempt) -> why, until untracked
        self._lock = threading.Lock()
        # A failed beat (the database is away) is logged and the next one tried: leases simply age meanwhile.
        super().__init__("specbatch-heartbeat", interval, self.beat, first_now=False)
        self.start()

    def track(self, job_id: str, attempt: int, request_id: str) -> None:
        """Refresh this attempt's lease from now on. An older attempt of the same job still
        tracked here (re-queued by a reaper after an outage, then claimed again by this very
        process) no longer owns the job: it is aborted, and its ``untrack`` says why."""
        with self._lock:
            older = self._owned.get(job_id)
            self._owned[job_id] = (attempt, request_id)
            self._lost.pop(job_id, None)
            if older is not None and older[0] != attempt:
                self._superseded[(job_id, older[0])] = f"superseded by attempt {attempt} in this worker"
        if older is not None and older[1] != request_id:
            self.abort(older[1])

    def lost(self, job_id: str, attempt: int) -> str | None:
        """Why this attempt no longer owns its job (cancelled, superseded), or None; it stays
        tracked. A finished attempt keeps its lease fresh until its result is stored: a store
        retried through a database outage otherwise let the lease expire, and the reaper re-ran
        a job whose result was waiting to be written (an attempt spent on an outage)."""
        with self._lock:
            superseded = self._superseded.get((job_id, attempt))
            if superseded is not None:
                return superseded
            if self._owned.get(job_id, (None, None))[0] != attempt:
                return None
            return self._lost.get(job_id)

    def untrack(self, job_id: str, attempt: int) -> str | None:
        """Stop refreshing this attempt; return why it was lost, if it was. A newer attempt
        of the job tracked meanwhile stays tracked."""
        with self._lock:
            superseded = self._superseded.pop((job_id, attempt), None)
            if superseded is not None:
                return superseded
            if self._owned.get(job_id, (None, None))[0] != attempt:
                return None
            del self._owned[job_id]
            return self._lost.pop(job_id, None)

    def beat(self) -> list[str]:
        """One refresh of every tracked attempt; abort and return the jobs no longer owned."""
        with self._lock:
            owned = dict(self._owned)
        if not owned:
            return []
        lost = self.store.heartbeat_many({job_id: attempt for job_id, (attempt, _) in owned.items()})
        aborted = []
        for job_id in lost:
            with self._lock:
                if self._owned.get(job_id) != owned[job_id]:
                    # Finished meanwhile, or finished and claimed again by this process (a new
                    # attempt: the refresh above was for the old one, which that attempt superseded).
                    continue
                self._lost[job_id] = "cancelled or superseded"
            self.abort(owned[job_id][1])
            aborted.append(job_id)
        return aborted
