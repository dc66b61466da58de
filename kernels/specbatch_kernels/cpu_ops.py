"""CPU kernels as ``torch.library`` ops: ``torch.ops.specbatch.paged_decode_attention`` and
``torch.ops.specbatch.write_kv`` (C++ in ``csrc/cpu_paged.cpp``), and
``torch.ops.specbatch.packed_linear`` (``csrc/packed_linear.cpp``: oneDNN-prepacked weights, or an
int8 linear's packed params, held in a registry and called by handle from a compiled graph).

Why ops and not Python: ``torch.compile`` keeps a registered op as one opaque call in its graph
(its fake implementation below gives the output's shape), and the C++ reads each K/V block of
the cache once, where the torch reference gathers blocks into a buffer that SDPA reads again.

The extension is built on first use with the machine's C++ compiler (``-O3 -march=native``)
into ``build_dir``, a folder keyed by the source, torch version and CPU capability, so it is
compiled once per machine and loaded in about a second afterwards. ``load_cpu_ops`` returns
False (and says why, once) where it cannot be built; callers then keep the torch reference.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_SOURCES = [Path(__file__).with_name("csrc") / name for name in ("cpu_paged.cpp", "packed_linear.cpp",
                                                                             "small_gemm.cpp")]
_lock = threading.Lock()
_state: dict[str, object] = {}
_out_features: dict[int, int] = {}  # packed-linear handle -> output features (for tracing)


def sources() -> tuple[Path, ...]:
    """The C++ sources of these ops (what a build, or a graph calling them, depends on)."""
    return tuple(_SOURCES)


def _build_dir(root: Path) -> Path:
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in _SOURCES)).hexdigest()[:12]
    capability = torch.backends.cpu.get_cpu_capability()
    return root / "cpu_ops" / f"{torch.__version__}-{capability}-{digest}"


def _capability_flags() -> list[str]:
    """The defines that select ATen's Vectorized<float> width, as torch's own CPU kernels use."""
    capability = torch.backends.cpu.get_cpu_capability()
    if capability in ("AVX512", "AVX2"):
        return [f"-DCPU_CAPABILITY={capability}", f"-DCPU_CAPABILITY_{capability}"]
    return []


def load_cpu_ops(build_root: str | os.PathLike | None = None) -> bool:
    """Build (once per machine) and load the ops; True when ``torch.ops.specbatch`` has them."""
    with _lock:
        if "loaded" in _state:
            return bool(_state["loaded"])
        try:
            from torch.utils import cpp_extension

            if build_root is None:
                build_root = os.environ.get("SPECBATCH_CACHE_DIR", Path.home() / ".cache" / "specbatch")
            root = Path(build_root)
            build = _build_dir(root)
            build.mkdir(parents=True, exist_ok=True)
            cpp_extension.load(
                name="specbatch_cpu_ops",
                sources=[str(p) for p in _SOURCES],
                extra_cflags=["-O3", "-march=native", "-fopenmp", *_capability_flags()],
                extra_ldflags=["-fopenmp"],
                build_directory=str(build),
                is_python_module=False,
                verbose=False,
            )
            _register_fakes()
            _state["loaded"] = True
        except Exception as exc:  # no compiler, no headers, a build error: keep the reference path
            log.warning("specbatch CPU ops not built (%s: %s); using the torch reference", type(exc).__name__, exc)
            _state["loaded"] = False
        return bool(_state["loaded"])


def _register_fakes() -> None:
    """Shapes for torch.compile's tracing (no data is read)."""

    @torch.library.register_fake("specbatch::paged_decode_attention")
    def _(query, k_cache, v_cache, block_tables, context_lens, scale, sliding_window):
        return torch.empty_like(query)

    @torch.library.register_fake("specbatch::write_kv")
    def _(key, value, k_cache, v_cache, slot_mapping):
        return None

    @torch.library.register_fake("specbatch::small_linear")
    def _(x, packed, out_features, bias=None, residual=None):
        return x.new_empty((*x.shape[:-1], out_features))

    @torch.library.register_fake("specbatch::packed_linear")
    def _(x, handle, residual=None):
        return x.new_empty((*x.shape[:-1], _out_features[handle]))


def register_packed_linear(packed_weight: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> int:
    """A handle for ``torch.ops.specbatch.packed_linear`` to a oneDNN-prepacked weight (shared,
    not copied); ``release_packed_linear`` drops the registry's reference."""
    handle = int(torch.ops.specbatch.register_packed_linear(packed_weight, bias))
    _out_features[handle] = out_features
    return handle


def register_int8_linear(packed_params: torch.ScriptObject, reduce_range: bool, out_features: int) -> int:
    """A handle for ``torch.ops.specbatch.packed_linear`` to an int8 linear's packed params
    (``quantized::linear_prepack``'s object, shared), run by ``quantized::linear_dynamic``."""
    handle = int(torch.ops.specbatch.register_int8_linear(packed_params, bool(reduce_range)))
    _out_features[handle] = out_features
    return handle


def release_packed_linear(handle: int) -> None:
    torch.ops.specbatch.release_packed_linear(handle)


def paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """``[B, H, D]`` attention of one query token per sequence (needs ``load_cpu_ops()``)."""
    return torch.ops.specbatch.paged_decode_attention(
        query, k_cache, v_cache, block_tables, context_lens, float(scale), int(sliding_window or 0)
    )
