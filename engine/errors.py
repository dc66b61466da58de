"""Errors the engine's callers act on, importable without torch: a worker process that only
drives an engine in a child process (``engine.process``) never loads torch or transformers
(importing them cost every worker start about 5 s of CPU)."""

from __future__ import annotations


class EngineDied(RuntimeError):
    """The loop thread crashed before this request finished: nothing about the request is
    known to be wrong, so callers should hand it to another engine rather than fail it."""
