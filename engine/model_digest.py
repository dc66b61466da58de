"""A model's identity as a digest of its files, for the exact result cache.

A greedy or seeded result is a pure function of the weights (and config and tokenizer) it ran
with, the prompt's tokens and the sampling parameters; this digest stands for the first part.
Hashing a model's files takes a while (about a second a gigabyte), so callers remember it by
``files_signature`` (paths, sizes and modification times) and hash again only when that
changes: a weight file written anew gets a new digest, so its old results are never served.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

_READ = 1 << 20


def model_files(path: str | Path) -> list[Path]:
    """The regular files of a model directory (or the file itself), in a fixed order; hidden
    entries (``.cache``, ``.git``, lock files) are not part of the model."""
    root = Path(path)
    if root.is_file():
        return [root]
    files = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        files += [Path(folder) / n for n in sorted(names) if not n.startswith(".")]
    return files


def files_signature(path: str | Path) -> str:
    """A cheap fingerprint of the model's files (names, sizes, modification times): when it is
    unchanged the stored digest still holds."""
    root = Path(path)
    h = hashlib.blake2b(f"{root.resolve()}\n".encode(), digest_size=32)
    for f in model_files(root):
        st = f.stat()
        h.update(f"{f.relative_to(root) if f != root else f.name}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def weights_digest(path: str | Path, signature: str | None = None) -> str:
    """BLAKE2b of every file of the model, names included (a renamed or re-saved weight file
    that differs in one byte gives another digest). Remembered on this machine by the files'
    signature (a file in the project's cache directory), so each process does not hash a
    model that is unchanged since another hashed it."""
    from engine.model_hub import cache_dir

    signature = signature or files_signature(path)
    memo = cache_dir() / "model-digests" / signature
    try:
        return memo.read_text().strip()
    except OSError:
        pass
    digest = _hash_files(Path(path))
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(digest)
        tmp.replace(memo)
    except OSError:
        pass  # a read-only cache: hashed again next time, still right
    return digest


def _hash_files(root: Path) -> str:
    h = hashlib.blake2b(digest_size=32)
    for f in model_files(root):
        h.update(f"{f.relative_to(root) if f != root else f.name}\0{f.stat().st_size}\n".encode())
        with open(f, "rb") as fh:
            while chunk := fh.read(_READ):
                h.update(chunk)
    return h.hexdigest()
