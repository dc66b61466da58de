"""Parsing a bulk file in a process of its own, so ingest uses a second core.

The ingesting process is CPU-bound on one core (the GIL): parsing and validating a line,
checking its prompt and building its row took about as long as storing it. A child process
starts with the ingest (its imports and tokenizer take a few seconds, while the parent parses
on its own), says it is ready, is told the last line the parent parsed, and from the next line
on streams back ``worker.ingest.parse`` entries, one pickled chunk at a time on its stdout; the
parent then only deduplicates and stores them. The pipe's buffer is the only queue: the child
parses at most a chunk ahead of the parent, so memory stays at a few chunks however large the
file.

The child never outlives the parent: it asks the kernel for SIGKILL when its parent dies
(``PR_SET_PDEATHSIG``, Linux), and any write to a pipe whose reader is gone kills it too.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import pickle
import select
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import IO, Any, Iterator, Sequence

from worker.ingest.parse import Entry, chunked, numbered_lines, parse_chunk

PR_SET_PDEATHSIG = 1


READY = b"R"


class ParseProcess:
    """Parent side: start the child on ``path``; once ``ready()``, ``chunks(after)`` streams its
    entries of the lines after ``after``."""

    def __init__(self, path: str | Path, *, model: str, priority: int, chunk: int,
                 counter_model: str | None = None, max_model_len: int | None = None,
                 served: Sequence[str] = (), table_format: str | None = None,
                 recipe: dict[str, Any] | None = None, cache: bool = True, prefix_order: bool = True) -> None:
        """``table_format`` and ``recipe``: ``path`` is a table whose rows the recipe builds
        (``worker.ingest.tables``, ``worker.request.table_rows``), else Batch JSONL lines."""
        spec = {"path": str(path), "model": model, "priority": priority, "served": list(served),
                "chunk": chunk, "parent": os.getpid(), "counter_model": counter_model, "max_model_len": max_model_len,
                "table_format": table_format, "recipe": recipe, "cache": cache,
                "prefix_order": prefix_order}
        self._stderr = tempfile.TemporaryFile()
        repo = str(Path(__file__).resolve().parents[1])
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH")) if p),
                   TOKENIZERS_PARALLELISM="false")  # one core each: the parent has the other
        self.proc = subprocess.Popen([sys.executable, "-m", "worker.ingest.parse_process", json.dumps(spec)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr, env=env)
        self.failed: str | None = None  # why the child died before it was ready

    def ready(self) -> bool:
        """Whether the child is ready to parse (never blocks); False for good once it has died."""
        assert self.proc.stdout is not None
        if self.failed is not None:
            return False
        if not select.select([self.proc.stdout], [], [], 0)[0]:
            return False
        if os.read(self.proc.stdout.fileno(), 1) == READY:  # unbuffered: pickles follow in the buffer
            return True
        self.failed = self._failure()
        return False

    def chunks(self, after: int) -> Iterator[list[Entry]]:
        """The child's chunks of the lines after line ``after``, in file order; raises if it
        dies before its last one. Call once ``ready()``."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self.proc.stdin.write(f"{after}\n".encode())
            self.proc.stdin.close()
        except BrokenPipeError as exc:
            raise RuntimeError(f"the parsing process died: {self._failure()}") from exc
        while True:
            try:
                entries = pickle.load(self.proc.stdout)
            except (EOFError, pickle.UnpicklingError) as exc:
                raise RuntimeError(f"the parsing process died: {self._failure()}") from exc
            if entries is None:
                return
            yield entries

    def _failure(self) -> str:
        code = self.proc.wait()
        self._stderr.seek(0)
        tail = self._stderr.read()[-2000:].decode("utf-8", "replace").strip()
        how = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
        return f"{how}{': ' + tail if tail else ''}"

    def close(self) -> None:
        """Stop the child (at once, if it is still parsing) and reap it."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None and not pipe.closed:
                try:
                    pipe.close()
                except BrokenPipeError:
                    pass
        self._stderr.close()


def die_with_parent(parent: int) -> None:
    """SIGKILL this process when its parent dies (Linux); exit now if it already has."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: a write to the closed pipe still ends us
        pass
    if os.getppid() != parent:
        os._exit(1)


def run(spec: dict[str, Any], inp: IO[bytes], out: IO[bytes]) -> None:
    """Get ready, say so on ``out``, read from ``inp`` the last line the parent parsed, then
    parse ``spec['path']`` after it into pickled chunks on ``out``, then None."""
    count_tokens = None
    if spec["counter_model"] is not None:
        from worker.request.validate import token_counter

        count_tokens = token_counter(spec["counter_model"])
    out.write(READY)
    out.flush()
    after = inp.readline()
    if not after.strip():  # the parent finished the file without us
        return
    start_after = int(after)
    gc.disable()  # parsing makes no cycles worth a collection; the collector walked every chunk
    recipe = None
    if spec.get("table_format") is not None:
        from worker.ingest.tables import Table
        from worker.request.table_rows import RowRecipe

        table = Table(spec["path"], spec["table_format"])
        recipe = RowRecipe(**spec["recipe"])
        lines = table.records(recipe.columns_used(table.column_names), skip=start_after)
    else:
        lines = ((n, raw) for n, raw in numbered_lines(spec["path"]) if n > start_after)
    for i, chunk in enumerate(chunked(lines, spec["chunk"], spec["chunk"])):
        entries = parse_chunk(chunk, model=spec["model"], priority=spec["priority"], count_tokens=count_tokens,
                              max_model_len=spec["max_model_len"], served=spec["served"], recipe=recipe,
                              cache=spec.get("cache", True), prefix_order=spec.get("prefix_order", True))
        pickle.dump(entries, out, protocol=pickle.HIGHEST_PROTOCOL)
        out.flush()
        if i % 64 == 63:
            gc.collect()
    pickle.dump(None, out)
    out.flush()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("spec", help="JSON: path, model, priority, chunk, parent, counter_model, max_model_len")
    spec = json.loads(parser.parse_args(argv).spec)
    die_with_parent(spec["parent"])
    try:
        run(spec, sys.stdin.buffer, sys.stdout.buffer)
    except BrokenPipeError:  # the parent stopped reading: it failed or was killed
        os._exit(1)


if __name__ == "__main__":
    main()
