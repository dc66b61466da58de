"""Test-only fault switches, so the fault-tolerance tests break the real engine in a real
worker process rather than a mock of one.

Off unless ``SPECBATCH_FAULTS`` holds a JSON object (read when an engine is built), e.g.
``{"poison": "POISON", "loop_dies_after_steps": 5, "step_sleep_s": 0.01}``:

- ``poison``: a forward containing a request whose prompt text includes this string raises,
  as a bad input that crashes a kernel would;
- ``loop_dies_after_steps``: the loop thread itself raises once it has run this many steps;
- ``step_sleep_s``: each step sleeps this long first (a slow model, so tests can kill a
  worker mid-batch with a tiny one).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable


class InjectedFault(RuntimeError):
    """Raised by a fault switch; never raised unless ``SPECBATCH_FAULTS`` asks for it."""


@dataclass(slots=True)
class Faults:
    poison: str | None = None
    loop_dies_after_steps: int | None = None
    step_sleep_s: float = 0.0

    @classmethod
    def from_env(cls) -> "Faults":
        raw = os.environ.get("SPECBATCH_FAULTS")
        if not raw:
            return cls()
        spec: dict[str, Any] = json.loads(raw)
        return cls(**spec)

    @property
    def active(self) -> bool:
        return bool(self.poison or self.loop_dies_after_steps or self.step_sleep_s)

    def before_forward(self, requests: Iterable[Any], text_of: Callable[[Any], str]) -> None:
        if self.step_sleep_s:
            time.sleep(self.step_sleep_s)
        if self.poison:
            for request in requests:
                if self.poison in text_of(request):
                    raise InjectedFault(f"poisoned request {request.request_id}")

    def check_loop(self, steps: int) -> None:
        if self.loop_dies_after_steps is not None and steps >= self.loop_dies_after_steps:
            raise InjectedFault(f"engine loop killed after {steps} steps")
