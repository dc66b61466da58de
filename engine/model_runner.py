"""Runs one flat step of the model over the paged KV cache.

The scheduled tokens of every sequence are laid end to end (batch dimension 1) with their
positions and cache slots; the model computes logits only at the positions that are sampled
(the last token of a sequence, plus each draft token under speculation).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import specbatch_kernels
import torch
from transformers import PreTrainedModel

from engine.attention import PagedMetadata
from engine.config import EngineConfig
from engine.decode_graphs import DecodeGraphs
from engine.memory import available_memory_bytes, default_cpu_kv_blocks
from engine.model_hub import cache_dir
from engine.scheduler import ScheduledSeq
from engine.step_inputs import StepInputs

if TYPE_CHECKING:  # imported when compile_step asks for it: it pulls in inductor
    from engine.compiled_step import CompiledDecode

log = logging.getLogger(__name__)

class ModelRunner:
    def __init__(self, model: PreTrainedModel, config: EngineConfig, max_model_len: int) -> None:
        self.model = model
        self.config = config
        self.device: torch.device = config.device
        self.block_size = config.block_size
        text_config = model.config.get_text_config()
        self.num_layers = text_config.num_hidden_layers
        self.num_kv_heads = getattr(text_config, "num_key_value_heads", None) or text_config.num_attention_heads
        self.head_dim = getattr(text_config, "head_dim", None) or (
            text_config.hidden_size // text_config.num_attention_heads
        )
        self.backend = specbatch_kernels.kernel_backend(self.device)
        self.num_blocks = self._num_blocks(max_model_len)
        shape = (self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        self.kv_caches = [
            (
                torch.zeros(shape, dtype=config.dtype, device=self.device),
                torch.zeros(shape, dtype=config.dtype, device=self.device),
            )
            for _ in range(self.num_layers)
        ]
        self.graphs: DecodeGraphs | None = None
        # Only the Triton kernels are capturable: the torch reference path plans its attention on
        # the host (reads lengths back), which invalidates a capture (seen on an H200).
        if config.decode_capture and self.device.type == "cuda" and self.backend == "triton":
            self.graphs = DecodeGraphs(self, config.max_num_seqs, max_model_len)
        self.compiled: CompiledDecode | None = None
        if config.compile_step:
            self.compiled = self._compile_decode(max_model_len)

    def _max_sampled_rows(self) -> int:
        """Most tokens a step can sample: one per sequence, and with speculation each one's
        proposals too (a verification step's rows)."""
        spec = self.config.speculative_config
        if spec is None:
            return self.config.max_num_seqs
        k = spec.max_speculative_tokens if spec.adaptive else spec.num_speculative_tokens
        return self.config.max_num_seqs * (1 + k)

    def _compile_decode(self, max_model_len: int) -> CompiledDecode | None:
        """The compiled decode step, compiled now (a warm-up on empty rows), or None with the
        reason logged once: unsupported model, no C++ toolchain, or a failed compile."""
        from engine.compiled_step import CompiledDecode, unsupported_reason, use_cache_dir
        from specbatch_kernels.cpu_ops import load_cpu_ops

        reason = unsupported_reason(self.model, self.device)
        if reason is None and not load_cpu_ops(cache_dir()):
            reason = "the specbatch CPU ops could not be built"
        if reason is not None:
            log.warning("compile_step: %s; decode steps run eagerly", reason)
            return None
        inductor_cache = use_cache_dir(cache_dir())
        try:
            compiled = CompiledDecode(self, self._max_sampled_rows(), max_model_len, cache_dir())
            seconds = compiled.warm_up()
        except Exception as exc:
            log.warning("compile_step: compiling the decode step failed (%s: %s); decode steps run eagerly",
                        type(exc).__name__, exc)
            return None
        log.info("compile_step: decode step %s in %.1f s (inductor cache %s)",
                 "loaded" if compiled.loaded else "compiled", seconds, inductor_cache)
        return compiled

    @property
    def bytes_per_block(self) -> int:
        itemsize = torch.tensor([], dtype=self.config.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * itemsize

    def _num_blocks(self, max_model_len: int) -> int:
        """Blocks that fit the memory budget, never more than the batch could ever use.

        An explicit ``kv_cache_memory_bytes`` always wins. Otherwise CUDA takes its share of the
        free device memory; the CPU sizes the cache for the batch (``engine.memory``).
        """
        budget = self.config.kv_cache_memory_bytes
        if budget is None:
            if self.device.type == "cuda":
                free, _total = torch.cuda.mem_get_info(self.device)
                budget = int(free * self.config.gpu_memory_utilization)
            else:
                budget = self.bytes_per_block * default_cpu_kv_blocks(
                    self.bytes_per_block,
                    self.block_size,
                    self.config.max_num_seqs,
                    max_model_len,
                    available_memory_bytes(),
                )
        num_blocks = budget // self.bytes_per_block
        useful = self.config.max_num_seqs * (-(-max_model_len // self.block_size) + 1)
        if self.config.kv_cache_memory_bytes is None:
            num_blocks = min(num_blocks, useful)
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_memory_bytes={budget} holds no block of {self.bytes_per_block} bytes; raise it"
            )
        return int(num_blocks)

    def prepare(self, scheduled: list[ScheduledSeq]) -> StepInputs:
        chunks: list[tuple[list[int], list[int], int]] = []
        logits_indices: list[int] = []
        sample_rows: list[tuple[int, int, int]] = []
        offset = 0
        for i, item in enumerate(scheduled):
            seq, n = item.seq, item.num_new_tokens
            start = seq.num_computed_tokens
            chunks.append((seq.block_table, seq.all_token_ids_with_spec()[start : start + n], start))
            offset += n
            if item.samples:
                rows = 1 + len(seq.draft_token_ids)
                sample_rows.append((i, len(logits_indices), rows))
                logits_indices.extend(range(offset - rows, offset))
        return self.layout(chunks, logits_indices, sample_rows)

    def layout(
        self,
        chunks: list[tuple[list[int], list[int], int]],
        logits_indices: list[int],
        sample_rows: list[tuple[int, int, int]],
    ) -> StepInputs:
        """Flat step inputs for ``chunks`` of ``(block_table, new tokens, first position)``."""
        bs = self.block_size
        ids: list[int] = []
        positions: list[torch.Tensor] = []
        slots: list[torch.Tensor] = []
        context_lens: list[int] = []
        starts = [0]
        max_blocks = max(len(table) for table, _, _ in chunks)
        tables = torch.zeros((len(chunks), max_blocks), dtype=torch.int32)
        for i, (block_table, tokens, start) in enumerate(chunks):
            n = len(tokens)
            ids.extend(tokens)
            pos = torch.arange(start, start + n)
            table = torch.tensor(block_table, dtype=torch.int64)
            tables[i, : len(block_table)] = table.to(torch.int32)
            positions.append(pos)
            slots.append(table[pos // bs] * bs + pos % bs)
            context_lens.append(start + n)
            starts.append(starts[-1] + n)
        dev = self.device
        metadata = PagedMetadata(
            kv_caches=self.kv_caches,
            slot_mapping=torch.cat(slots).to(dev),
            block_tables=tables.to(dev),
            context_lens=torch.tensor(context_lens, dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
            backend=self.backend,
            max_query_len=max(len(tokens) for _, tokens, _ in chunks),
            max_context_len=max(context_lens),
            slots_all_valid=True,  # every slot above comes from a real block table entry
        )
        return StepInputs(
            input_ids=torch.tensor(ids, dtype=torch.long, device=dev),
            positions=torch.cat(positions).to(dev),
            metadata=metadata,
            logits_indices=torch.tensor(logits_indices, dtype=torch.long, device=dev),
            sample_rows=sample_rows,
        )

    def describe(self) -> str:
        """One line for logs and benchmarks: how steps are run."""
        capture = self.graphs.describe() if self.graphs is not None else "decode eager"
        if self.compiled is not None:
            capture = self.compiled.describe()
        quant = self.config.quantization or "none"
        dtype = f"{self.config.dtype}" + (" (auto for this CPU)" if self.config.dtype_auto else "")
        return f"device {self.device}, dtype {dtype}, quantization {quant}, kernels {self.backend}, {capture}"

    @torch.inference_mode()
    def forward(self, inputs: StepInputs) -> torch.Tensor:
        """Float32 logits ``[len(logits_indices), vocab]`` for the sampled positions.

        Decode-only steps replay a captured graph (CUDA) or run the compiled step (CPU,
        ``compile_step``) where one is set up; if that ever fails, it is switched off for good
        (logged once) and the step runs eagerly.
        """
        if self.graphs is not None and self.graphs.can_run(inputs):
            try:
                return self.graphs.run(inputs)
            except Exception as exc:
                log.warning("decode capture failed (%s: %s); running every step eagerly from now on",
                            type(exc).__name__, exc)
                self.graphs = None
        if self.compiled is not None and self.compiled.can_run(inputs):
            try:
                return self.compiled.run(inputs)
            except Exception as exc:
                log.warning("compiled decode step failed (%s: %s); running every step eagerly from now on",
                            type(exc).__name__, exc)
                self.compiled = None
        return self.forward_eager(inputs)

    @torch.inference_mode()
    def forward_eager(self, inputs: StepInputs) -> torch.Tensor:
        """The model's forward, op by op (every step that is not replayed from a graph)."""
        out = self.model(
            input_ids=inputs.input_ids[None],
            position_ids=inputs.positions[None],
            logits_to_keep=inputs.logits_indices,
            specbatch_metadata=inputs.metadata,
            use_cache=False,
        )
        return out.logits[0].float()
