"""One step's flat model inputs: what the runner builds and the decode graphs replay.

Its own module so that the runner and the decode graphs both depend on it, not on each other.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention import PagedMetadata


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: PagedMetadata
    logits_indices: torch.Tensor
    # For each scheduled sequence that samples: (index into scheduled, first logits row, rows).
    sample_rows: list[tuple[int, int, int]]
