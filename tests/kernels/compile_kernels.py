"""Compile every Triton kernel for an NVIDIA target (default sm_90, H100/H200) without a GPU.

The CPU tests run the kernels in the interpreter, which accepts things the compiler rejects
(type mismatches across branches, dot shapes, ...). This runs the real frontend and NVIDIA
backend down to a cubin, so compile errors show up on machines without a GPU. It must run in a
process without ``TRITON_INTERPRET`` (``test_kernel_compile.py`` starts one).

    python tests/kernels/compile_kernels.py [capability]
"""

from __future__ import annotations

import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(_ROOT / "kernels"), str(_ROOT)]  # specbatch_kernels from the checkout, installed or not

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from specbatch_kernels import _triton_attention as ta  # noqa: E402
from specbatch_kernels import _triton_cache as tc  # noqa: E402
from specbatch_kernels import _triton_sampling as ts  # noqa: E402

INDEX_PTRS = {
    "block_tables_ptr": "*i32", "context_lens_ptr": "*i32", "query_start_loc_ptr": "*i32",
    "block_table_ptr": "*i32", "slot_mapping_ptr": "*i64", "src_to_dst_ptr": "*i64",
    "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32",
    "keys_ptr": "*i64", "tokens_ptr": "*i64",
}


def compile_kernel(fn, constexprs: dict, data_ptr: str, capability: int) -> None:
    signature = {}
    for name in fn.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = INDEX_PTRS.get(name, data_ptr)
        else:
            signature[name] = "fp32" if name == "scale_log2" else "i32"
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    kernel = triton.compile(src, target=GPUTarget("cuda", capability, 32), options={"num_warps": 4})
    assert "cubin" in kernel.asm, f"{fn.__name__}: no cubin"
    print(f"{fn.__name__:24s} {data_ptr:6s} ok  {constexprs}")


def main(capability: int = 90) -> None:
    for dtype, upcast in (("*bf16", False), ("*fp16", False), ("*fp32", True)):
        for split in (False, True):
            compile_kernel(ta._decode_kernel, dict(HEAD_DIM=128, D_PAD=128, GROUP=4, G_PAD=16,
                           BLOCK_SIZE=16, BLOCK_N=64, SPLIT=split, UPCAST=upcast), dtype, capability)
        compile_kernel(ta._varlen_kernel, dict(HEAD_DIM=80, D_PAD=128, GROUP=3, G_PAD=4,
                       BLOCK_SIZE=32, BLOCK_Q=16, BLOCK_N=64, UPCAST=upcast), dtype, capability)
        compile_kernel(ta._combine_splits_kernel, dict(HEAD_DIM=128, D_PAD=128, S_PAD=8), dtype, capability)
        compile_kernel(tc._write_kv_kernel, dict(BLOCK_SIZE=16, H=8, H_PAD=8, D=128, D_PAD=128), dtype, capability)
    for dtype in ("*fp32", "*bf16"):
        compile_kernel(ts._coupled_sample_kernel, dict(BLOCK_V=2048), dtype, capability)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 90)
