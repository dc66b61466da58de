"""Loading a Hugging Face causal LM and its tokenizer for the engine."""

from __future__ import annotations

import torch
from transformers import AutoTokenizer, GenerationConfig, PreTrainedModel

from engine.attention import ATTN_IMPLEMENTATION
from engine.cpu_linear import can_pack, pack_linears
from engine.fused_layers import fuse_decoder_layers
from engine.memory import own_weights, release_freed_heap
from engine.model_hub import load_causal_lm, resolve_model
from engine.quantization import quantize_linears


def load_tokenizer(model: str, trust_remote_code: bool = False):
    return AutoTokenizer.from_pretrained(resolve_model(model), trust_remote_code=trust_remote_code)


def load_model(
    model: str,
    dtype: torch.dtype,
    device: torch.device,
    trust_remote_code: bool = False,
    fuse_layers: bool = True,
    quantization: str | None = None,
) -> PreTrainedModel:
    """The model in eval mode with our paged attention selected in every layer.

    Linears are prepacked for oneDNN (exact), or with ``quantization="int8"`` replaced by
    int8 ones (``engine.quantization``), each layer as soon as it is fused so peaks stay low.
    """
    path = resolve_model(model)
    hf_model = load_causal_lm(path, dtype=dtype, trust_remote_code=trust_remote_code)
    return prepare_model(hf_model, device, fuse_layers, quantization)


def prepare_model(
    hf_model: PreTrainedModel,
    device: torch.device,
    fuse_layers: bool = True,
    quantization: str | None = None,
) -> PreTrainedModel:
    """An already-built transformers model made ready for the engine, in place (``load_model``'s
    second half): our attention selected, moved to ``device``, layers fused, linears packed.

    Why apart from loading: benchmarks build models whose weights never touch a disk (random
    weights of a real shape, generated on the GPU) and hand them to ``LLMEngine(model=...)``.
    """
    hf_model.set_attn_implementation(ATTN_IMPLEMENTATION)
    hf_model = hf_model.to(device).eval().requires_grad_(False)
    pack = can_pack(device, next(hf_model.parameters()).dtype)

    def convert(module: torch.nn.Module) -> None:
        if quantization is not None:
            quantize_linears(module, quantization)  # the linears it keeps in float are packed below
        if pack:
            pack_linears(module)

    if fuse_layers:
        fuse_decoder_layers(hf_model, after=convert)
    convert(hf_model)
    if device.type == "cpu":  # the weights are held once: no checkpoint map, no freed heap kept
        own_weights(hf_model)
        release_freed_heap()
    return hf_model


def eos_token_ids(model: PreTrainedModel, tokenizer) -> set[int]:
    """Every token that ends a generation: the tokenizer's EOS and the generation config's."""
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    config: GenerationConfig | None = getattr(model, "generation_config", None)
    eos = getattr(config, "eos_token_id", None) if config is not None else None
    if isinstance(eos, int):
        ids.add(eos)
    elif isinstance(eos, (list, tuple)):
        ids.update(int(e) for e in eos)
    return ids
