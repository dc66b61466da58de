"""A job's priority: an integer (vLLM's meaning: lower is more urgent) or a lane name,
``interactive`` (0) or ``bulk`` (1). Parsed once where a request is made; the queue it travels
on follows from it (``worker.dispatch.lanes``)."""

from __future__ import annotations

from typing import Any

INTERACTIVE, BULK = "interactive", "bulk"
LANE_PRIORITY = {INTERACTIVE: 0, BULK: 1}
MAX_PRIORITY = 1_000_000  # the engine's bound


def parse_priority(value: Any, default: str = BULK) -> int:
    """A job's engine priority from a lane name, an integer (or its string) or None (the default)."""
    if value is None:
        value = default
    if isinstance(value, str):
        name = value.strip().lower()
        if name in LANE_PRIORITY:
            return LANE_PRIORITY[name]
        try:
            value = int(name)
        except ValueError:
            raise ValueError(f"priority must be 'interactive', 'bulk' or an integer, got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"priority must be 'interactive', 'bulk' or an integer, got {value!r}")
    if abs(value) > MAX_PRIORITY:
        raise ValueError(f"priority must be within [-{MAX_PRIORITY}, {MAX_PRIORITY}], got {value}")
    return value
