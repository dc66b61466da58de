"""Captured decode steps: CUDA graphs of the forward for a fixed set of batch sizes.

Why: at batch 1-8 a GPU decode step is a few hundred small kernel launches whose launch cost
exceeds their work; replaying a captured graph launches them all at once (nano-vllm, vLLM).
A decode-only step (one query token and one sampled row per sequence) is padded to the next
captured size: its inputs are copied into persistent buffers, padding rows write no KV
(slot -1) and attend to nothing (context 0), and their logits are dropped. Attention is
captured with the context bound fixed at the model's length, so one graph serves every step.

Anything else (prefill, chunks, speculative verification, batches over the largest size) runs
eagerly, and so does everything after a capture or replay fails: ``ModelRunner`` drops the
graphs, logs why, and the step is recomputed eagerly (tested by forcing the failure).
Off CUDA, ``static=True`` runs the same padded persistent-buffer forward eagerly: the CPU
tests check the padding maths with it; the engine does not use it on the CPU.
"""

from __future__ import annotations

import torch

from engine.attention import PagedMetadata
from engine.step_inputs import StepInputs

CAPTURE_SIZES = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512)


class DecodeGraphs:
    def __init__(self, runner, max_batch: int, max_context_len: int, static: bool = False) -> None:
        self.runner = runner
        self.static = static
        self.sizes = [s for s in CAPTURE_SIZES if s < max_batch] + [min(max_batch, CAPTURE_SIZES[-1])]
        self.max_context_len = max_context_len
        dev, size = runner.device, self.sizes[-1]
        max_blocks = -(-max_context_len // runner.block_size)
        self.input_ids = torch.zeros(size, dtype=torch.long, device=dev)
        self.positions = torch.zeros(size, dtype=torch.long, device=dev)
        self.slot_mapping = torch.full((size,), -1, dtype=torch.long, device=dev)
        self.block_tables = torch.zeros((size, max_blocks), dtype=torch.int32, device=dev)
        self.context_lens = torch.zeros(size, dtype=torch.int32, device=dev)
        self.query_start_loc = torch.arange(size + 1, dtype=torch.int32, device=dev)
        self.logits_indices = torch.arange(size, dtype=torch.long, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None

    def describe(self) -> str:
        kind = "static buffers, eager" if self.static else "CUDA graphs"
        return f"decode capture: {kind} for batch sizes {self.sizes[0]}..{self.sizes[-1]}"

    def can_run(self, inputs) -> bool:
        meta = inputs.metadata
        batch = meta.context_lens.shape[0]
        return (
            meta.max_query_len == 1
            and inputs.input_ids.shape[0] == batch
            and inputs.logits_indices.shape[0] == batch
            and batch <= self.sizes[-1]
            and meta.block_tables.shape[1] <= self.block_tables.shape[1]
            and meta.max_context_len <= self.max_context_len
        )

    def run(self, inputs) -> torch.Tensor:
        """Logits ``[batch, vocab]`` of a decode step, replayed from the captured graph."""
        batch = inputs.metadata.context_lens.shape[0]
        size = next(s for s in self.sizes if s >= batch)
        self._fill(inputs, batch, size)
        if self.static:
            return self._forward(size)[:batch]
        if size not in self.graphs:
            self._capture(size)
        self.graphs[size].replay()
        return self.outputs[size][:batch]

    def _fill(self, inputs, batch: int, size: int) -> None:
        meta = inputs.metadata
        self.input_ids[:batch].copy_(inputs.input_ids, non_blocking=True)
        self.positions[:batch].copy_(inputs.positions, non_blocking=True)
        self.slot_mapping[:batch].copy_(meta.slot_mapping, non_blocking=True)
        self.context_lens[:batch].copy_(meta.context_lens, non_blocking=True)
        self.block_tables[:batch, : meta.block_tables.shape[1]].copy_(meta.block_tables, non_blocking=True)
        if size > batch:  # padding rows: no KV written, nothing attended
            self.input_ids[batch:size].zero_()
            self.positions[batch:size].zero_()
            self.slot_mapping[batch:size].fill_(-1)
            self.context_lens[batch:size].zero_()

    def _forward(self, size: int) -> torch.Tensor:
        metadata = PagedMetadata(
            kv_caches=self.runner.kv_caches,
            slot_mapping=self.slot_mapping[:size],
            block_tables=self.block_tables[:size],
            context_lens=self.context_lens[:size],
            query_start_loc=self.query_start_loc[: size + 1],
            backend=self.runner.backend,
            max_query_len=1,
            max_context_len=self.max_context_len,
        )
        inputs = StepInputs(self.input_ids[:size], self.positions[:size], metadata, self.logits_indices[:size], [])
        return self.runner.forward_eager(inputs)

    def _capture(self, size: int) -> None:
        """Warm up on a side stream (Triton compiles, allocator settles), then capture."""
        current = torch.cuda.current_stream()
        side = torch.cuda.Stream()
        side.wait_stream(current)
        with torch.cuda.stream(side):
            for _ in range(2):
                self._forward(size)
        current.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self.pool):
                out = self._forward(size)
        except BaseException:
            release_generator_after_failed_capture()
            raise
        self.pool = graph.pool()
        self.graphs[size] = graph
        self.outputs[size] = out


def release_generator_after_failed_capture() -> None:
    """A capture that fails ends without its epilogue, leaving the default CUDA generator in
    capture mode: every later random op on the device (a model's init, ``torch.rand``) then
    raises "Offset increment outside graph capture encountered unexpectedly" (seen on an H200).
    A trivial capture runs the prologue/epilogue pair again and takes the generator out of it."""
    torch.cuda.synchronize()
    with torch.cuda.graph(torch.cuda.CUDAGraph()):
        pass
