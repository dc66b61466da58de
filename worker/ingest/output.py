"""The output file of ``specbatch run``: results land in it while the batch runs, in input-line
order, and a crash at any moment leaves a valid JSONL file that a rerun completes.

The file is always an ordered prefix of the batch: a result is appended as soon as every line
before it has one (``Store.finished_prefix``; the pacer publishes in line order, so the lag is
about the in-flight window). That makes resuming exact without a record of what was written:
the last line of the file names its job, and so where to go on (each line exactly once), and
the file needs no sort at the end. Lines are appended with one ``write`` per group of whole
lines; a torn last line (a power cut) is cut off when the run resumes.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from worker.request.formats import output_line
from worker.store.store import Store

_BLOCK = 1 << 20


class OutputFile:
    def __init__(self, path: str | Path, store: Store, batch_id: str, *, fresh: bool = False) -> None:
        self.path = Path(path)
        self.store = store
        self.batch_id = batch_id
        self.after: tuple[int, str] | None = None
        self.lines = 0
        if fresh or not self._resume():
            self._truncate(0)

    def _resume(self) -> bool:
        """Go on after the file's last line if it is one of this batch's; False: start afresh."""
        if not self.path.exists():
            return False
        with open(self.path, "rb") as fh:
            end = fh.seek(0, os.SEEK_END)
            whole = _last_newline_end(fh, end)  # bytes up to the end of the last whole line
            if whole == 0:
                return False
            start = _last_newline_end(fh, whole - 1)
            fh.seek(start)
            last = fh.read(whole - start)
        try:
            meta = json.loads(last)["specbatch"]
            job_id, line_no = meta["job_id"], meta["line"]
        except (ValueError, KeyError, TypeError):
            return False
        job = self.store.get_job(job_id)
        if job is None or job.batch_id != self.batch_id or job.line_no != line_no:
            return False
        if whole != end:
            self._truncate(whole)
        self.after = (line_no, job_id)
        self.lines = _count_lines(self.path)
        return True

    def _truncate(self, size: int) -> None:
        with open(self.path, "ab") as fh:
            fh.truncate(size)

    def pump(self, limit: int = 1000) -> int:
        """Append every result now ready (the finished lines that follow the file's last one)."""
        written = 0
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            while True:
                rows = self.store.finished_prefix(self.batch_id, self.after, limit)
                if not rows:
                    return written
                data = "".join(_line(output_line(j)) for j in rows).encode("utf-8")
                view = memoryview(data)
                while view:  # a regular file takes it whole; loop in case it does not
                    view = view[os.write(fd, view):]
                self.after = (rows[-1].line_no, rows[-1].id)
                self.lines += len(rows)
                written += len(rows)
        finally:
            os.close(fd)

    def finish(self) -> int:
        """Append what is left; the lines the file holds."""
        self.pump()
        return self.lines

    def rewrite(self) -> int:
        """Write the whole file again from the store (e.g. the input changed between runs)."""
        self._truncate(0)
        self.after, self.lines = None, 0
        return self.pump()


def _line(row: dict[str, Any]) -> str:
    return json.dumps(row, ensure_ascii=False) + "\n"


def _last_newline_end(fh, end: int) -> int:
    """The offset just past the last ``\\n`` before ``end`` (0 if there is none)."""
    pos = end
    while pos > 0:
        start = max(0, pos - _BLOCK)
        fh.seek(start)
        block = fh.read(pos - start)
        i = block.rfind(b"\n")
        if i >= 0:
            return start + i + 1
        pos = start
    return 0


def _count_lines(path: Path) -> int:
    n = 0
    with open(path, "rb") as fh:
        while block := fh.read(_BLOCK):
            n += block.count(b"\n")
    return n
