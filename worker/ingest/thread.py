"""Reading a batch's input on a thread of its own, so ``specbatch run`` can start a worker and
follow progress (and write results) while the file is still being read."""

from __future__ import annotations

import gc
import threading
from pathlib import Path
from typing import Any

from worker.ingest.stream import IngestResult


class IngestThread:
    """``Client.submit_batch`` on a daemon thread; ``first_chunk()`` waits for its first chunk
    to be written, ``join()`` for all of it (re-raising what it raised)."""

    def __init__(self, client: Any, source: str | Path, **kwargs: Any) -> None:
        self._first = threading.Event()
        self._work = threading.Event()  # a chunk enqueued jobs to run, or the reading ended
        self._enqueued = False
        self.lines_read = 0  # so far, for a progress line
        self._first_result: IngestResult | None = None
        self._sub: Any = None
        self._error: BaseException | None = None
        # Everything imported so far is long-lived: keep the collector from walking it again
        # and again while the reader allocates a million small objects.
        gc.freeze()
        self._thread = threading.Thread(target=self._run, args=(client, source, kwargs), name="specbatch-ingest",
                                        daemon=True)
        self._thread.start()

    def _run(self, client: Any, source: str | Path, kwargs: dict[str, Any]) -> None:
        def on_chunk(result: IngestResult) -> None:
            self.lines_read = result.num_lines
            if not self._first.is_set():
                self._first_result = IngestResult(result.batch_id, enqueued=result.enqueued)
                self._first.set()
            if result.enqueued:
                self._enqueued = True
                self._work.set()

        try:
            self._sub = client.submit_batch(source, on_chunk=on_chunk, **kwargs)
        except BaseException as exc:  # handed to the caller's thread in join()
            self._error = exc
        finally:
            self._first.set()
            self._work.set()

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def first_chunk(self) -> IngestResult:
        """The batch id and what the first chunk enqueued (the whole input, if that was all)."""
        self._first.wait()
        if self._first_result is None:
            self.join()  # failed before its first chunk: raise that
            return self._sub.ingest
        return self._first_result

    def has_work(self) -> bool:
        """Wait until some chunk enqueued jobs to run (True) or the input ended without any
        (False): a rerun whose lines all succeeded needs no worker."""
        self._work.wait()
        return self._enqueued

    def join(self):
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._sub
