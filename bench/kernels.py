"""Paged decode attention: our Triton kernel vs torch SDPA vs transformers' paged data path.

Decode attention reads every cached K/V byte once and does little arithmetic, so the figure of
merit is achieved memory bandwidth: bytes of KV read / time, as a fraction of the device's peak.
For each batch x context length the script prints the time and bandwidth fraction of:

- ``triton``: ``specbatch_kernels.paged_attention_triton`` on a paged cache (shuffled blocks);
- ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` on contiguous, unpadded-per-batch
  ``[B, Hkv, ctx, D]`` K/V (the no-paging baseline; every sequence has the same length here);
- ``hf-paged``: transformers' ``paged|sdpa`` decode data path. Its ``PagedAttentionCache``
  cannot be driven standalone (it needs a model config, a ``ContinuousBatchingConfig``, a
  ``DistributedHelper`` and the read/write indices that its batch processor builds), so the
  script reproduces what that path does per layer: ``index_select`` of every sequence's slots
  out of the flat cache (``FullAttentionCacheAllocator.update``), then transformers'
  ``sdpa_attention_forward`` over the ragged batch (batch dim 1) with a block-diagonal mask.
  transformers' ``paged|flash_attention_*`` decode fast path needs flash-attn and is not run.

and the ratios of their times to the Triton kernel's. Without CUDA it says "no GPU found" and
runs a dry mode: tiny shapes through the torch reference and the Triton kernel under
``TRITON_INTERPRET=1``, checking they agree, so the script is exercised end to end.

    python bench/kernels.py [--batches 1 16 64] [--contexts 512 2048 8192] [--peak-tbps 4.8]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
if sys.path and Path(sys.path[0] or ".").resolve() == ROOT / "bench":
    sys.path.pop(0)  # bench/queue.py and bench/kernels.py must not shadow `queue` and `kernels`
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

# Peak HBM bandwidth in TB/s by device-name substring (first match wins; order matters).
PEAK_TBPS = [
    ("H200", 4.8),
    ("H100 PCIe", 2.0),
    ("H100 NVL", 3.9),
    ("H100", 3.35),
    ("H800", 3.35),
    ("GH200", 4.0),
    ("B200", 8.0),
    ("A100-SXM4-80GB", 2.039),
    ("A100 80GB PCIe", 1.935),
    ("A100", 1.555),
    ("A10G", 0.6),
    ("A10", 0.6),
    ("L40S", 0.864),
    ("L40", 0.864),
    ("L4", 0.3),
    ("RTX 4090", 1.008),
    ("RTX 3090", 0.936),
    ("V100", 0.9),
    ("T4", 0.32),
]


def peak_tbps(name: str, override: float | None) -> float | None:
    if override is not None:
        return override
    for key, tbps in PEAK_TBPS:
        if key in name:
            return tbps
    return None


def make_inputs(batch: int, ctx: int, heads: int, kv_heads: int, head_dim: int, block_size: int,
                dtype: torch.dtype, device: str, seed: int = 0) -> dict:
    """A decode step: one query token per sequence, every sequence ``ctx`` tokens long."""
    # Drawn on the device itself: an 8k-context batch of 256 is gigabytes, minutes to draw on a CPU.
    gen = torch.Generator(device=device).manual_seed(seed)
    blocks_per_seq = -(-ctx // block_size)
    num_blocks = batch * blocks_per_seq
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen, device=device, dtype=dtype)
    v_cache = torch.randn(shape, generator=gen, device=device, dtype=dtype)
    tables = torch.randperm(num_blocks, generator=gen, device=device).view(batch, blocks_per_seq).to(torch.int32)
    query = torch.randn(batch, heads, head_dim, generator=gen, device=device, dtype=dtype)
    return dict(
        query=query,
        k_cache=k_cache,
        v_cache=v_cache,
        block_tables=tables.to(device),
        context_lens=torch.full((batch,), ctx, dtype=torch.int32, device=device),
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=device),
        scale=head_dim**-0.5,
    )


def contiguous_kv(inp: dict, ctx: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, Hkv, ctx, D]`` copies of the paged K/V (built outside the timed region)."""
    def gather(cache: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """The first ``ctx`` cached tokens of one sequence, ``[Hkv, ctx, D]``."""
        blocks = cache.index_select(0, table.long())
        return blocks.reshape(-1, *cache.shape[2:])[:ctx].transpose(0, 1)

    ks = [gather(inp["k_cache"], table) for table in inp["block_tables"]]
    vs = [gather(inp["v_cache"], table) for table in inp["block_tables"]]
    return torch.stack(ks).contiguous(), torch.stack(vs).contiguous()


def runners(inp: dict, ctx: int) -> dict[str, Callable[[], torch.Tensor]]:
    """name -> a zero-argument call computing ``[B, H, D]`` decode attention."""
    import torch.nn.functional as F

    from specbatch_kernels.paged_attention import paged_attention_triton

    args = (inp["query"], inp["k_cache"], inp["v_cache"], inp["block_tables"],
            inp["context_lens"], inp["query_start_loc"], inp["scale"])
    batch, heads, _ = inp["query"].shape
    run: dict[str, Callable[[], torch.Tensor]] = {
        "triton": lambda: paged_attention_triton(*args, max_query_len=1, max_context_len=ctx),
    }

    k, v = contiguous_kv(inp, ctx)
    q = inp["query"][:, :, None]  # [B, H, 1, D]
    gqa = heads != k.shape[1]
    run["sdpa"] = lambda: F.scaled_dot_product_attention(
        q, k, v, scale=inp["scale"], enable_gqa=gqa)[:, :, 0]

    hf = hf_paged_sdpa_runner(inp, ctx)
    if hf is not None:
        run["hf-paged"] = hf
    return run


def hf_paged_sdpa_runner(inp: dict, ctx: int) -> Callable[[], torch.Tensor] | None:
    """transformers' ``paged|sdpa`` decode data path (see the module docstring)."""
    try:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
    except ImportError as err:  # pragma: no cover - depends on the installed transformers
        print(f"  hf-paged: transformers' sdpa_attention_forward not importable ({err}); skipped")
        return None
    k_cache, v_cache = inp["k_cache"], inp["v_cache"]
    block_size, kv_heads, head_dim = k_cache.shape[1:]
    flat_k = k_cache.view(-1, kv_heads, head_dim)  # HF's per-token view of the cache
    flat_v = v_cache.view(-1, kv_heads, head_dim)
    batch, heads, _ = inp["query"].shape
    pos = torch.arange(ctx, device=k_cache.device)
    tables = inp["block_tables"].long()
    read_index = (tables[:, pos // block_size] * block_size + pos % block_size).reshape(-1)
    seq_of_key = torch.arange(batch, device=k_cache.device).repeat_interleave(ctx)
    allowed = seq_of_key[None, :] == torch.arange(batch, device=k_cache.device)[:, None]
    mask = torch.zeros(allowed.shape, dtype=k_cache.dtype, device=k_cache.device)
    mask.masked_fill_(~allowed, torch.finfo(k_cache.dtype).min)
    mask = mask[None, None]  # [1, 1, B, B * ctx]
    module = torch.nn.Module()
    module.is_causal = False
    module.num_key_value_groups = heads // kv_heads
    query = inp["query"].transpose(0, 1)[None]  # [1, H, B, D]

    def run() -> torch.Tensor:
        k = torch.index_select(flat_k, 0, read_index).transpose(0, 1)[None]  # [1, Hkv, B*ctx, D]
        v = torch.index_select(flat_v, 0, read_index).transpose(0, 1)[None]
        out, _ = sdpa_attention_forward(module, query, k, v, mask, scaling=inp["scale"])
        return out[0]  # [B, H, D]

    return run


def time_ms(fn: Callable[[], torch.Tensor], cuda: bool) -> float:
    if cuda:
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=10, rep=50))
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def kv_bytes(inp: dict, ctx: int) -> int:
    batch = inp["query"].shape[0]
    _, _, kv_heads, head_dim = inp["k_cache"].shape
    return 2 * batch * ctx * kv_heads * head_dim * inp["k_cache"].element_size()


def bench(args: argparse.Namespace, cuda: bool) -> int:
    device = "cuda" if cuda else "cpu"
    dtype = getattr(torch, args.dtype)
    peak = None
    if cuda:
        name = torch.cuda.get_device_name()
        peak = peak_tbps(name, args.peak_tbps)
        where = f"{name}, peak {peak} TB/s" if peak else f"{name}, peak unknown (pass --peak-tbps)"
    else:
        where = "CPU dry run: times are interpreter times, meaningless as performance"
    print(f"paged decode attention, {args.heads} heads / {args.kv_heads} KV heads, head_dim "
          f"{args.head_dim}, block {args.block_size}, {args.dtype}; {where}")
    names = ["triton", "sdpa", "hf-paged"]
    head = f"{'batch':>5} {'ctx':>6} " + " ".join(f"{n + ' ms':>12} {'%peak':>6}" for n in names)
    head += f" {'sdpa/triton':>12} {'hf/triton':>10} {'max|err|':>9}"
    print(head)
    failures = 0
    for batch in args.batches:
        for ctx in args.contexts:
            inp = make_inputs(batch, ctx, args.heads, args.kv_heads, args.head_dim,
                              args.block_size, dtype, device)
            run = runners(inp, ctx)
            outs = {n: fn() for n, fn in run.items()}
            ref = outs["sdpa"].float()
            err = max((o.float() - ref).abs().max().item() for o in outs.values())
            failures += err > (1e-4 if dtype == torch.float32 else 3e-2)
            ms = {n: time_ms(fn, cuda) for n, fn in run.items()}
            nbytes = kv_bytes(inp, ctx)
            cells = []
            for n in names:
                if n not in ms:
                    cells.append(f"{'n/a':>12} {'':>6}")
                    continue
                frac = f"{100 * nbytes / (ms[n] * 1e-3) / (peak * 1e12):5.1f}%" if peak else "   -  "
                cells.append(f"{ms[n]:12.4f} {frac:>6}")
            ratio = lambda n: f"{ms[n] / ms['triton']:.2f}x" if n in ms else "n/a"
            print(f"{batch:5d} {ctx:6d} " + " ".join(cells)
                  + f" {ratio('sdpa'):>12} {ratio('hf-paged'):>10} {err:9.2e}")
            del inp, run, outs
            if cuda:
                torch.cuda.empty_cache()
    print("ratios > 1x: the Triton kernel is faster. %peak = KV bytes read / time / peak bandwidth.")
    if failures:
        print(f"ERROR: {failures} configuration(s) disagree with SDPA beyond tolerance")
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--peak-tbps", type=float, default=None,
                        help="override the device's peak memory bandwidth (TB/s)")
    parser.add_argument("--dry", action="store_true", help="the tiny CPU run even with a GPU")
    args = parser.parse_args(argv)

    cuda = torch.cuda.is_available() and not args.dry
    print("note: hf-paged reproduces transformers' paged|sdpa decode data path (its PagedAttentionCache "
          "cannot be driven standalone); its flash-attn fast path is not run")
    if not cuda:
        if not torch.cuda.is_available():
            print("no GPU found: dry mode (tiny shapes, Triton under TRITON_INTERPRET=1)")
        # Read when the Triton kernels are first imported (lazily, in runners()).
        os.environ["TRITON_INTERPRET"] = "1"
        args.batches, args.contexts = [1, 3], [17, 64]
        args.heads, args.kv_heads, args.head_dim, args.dtype = 4, 2, 32, "float32"
    return bench(args, cuda)


if __name__ == "__main__":
    sys.exit(main())
