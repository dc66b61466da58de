"""The compiled decode step saved whole on disk (dynamo's AOT compile), so that a warm start
loads it instead of tracing the model again.

Why: with inductor's caches warm, a start still spent two thirds of its compile time in dynamo
(bytecode tracing of 30 layers, then building guards: 6-7 of 9.4 s on a 2-core EPYC). A saved
function skips both; only inductor's compiled C++ is loaded. vLLM does the same
(``VLLM_USE_AOT_COMPILE``).

The file holds the graph, not the weights: the module is the function's first argument, and its
parameters are read at each call. Everything the graph bakes in names the file: torch's and
Python's versions, the CPU's features, the sources the graph traces (this package's and the
C++ ops'), and the module's structure (each submodule's plain attributes, packed-linear handles
included, each tensor's shape, dtype and strides, small buffers' values). So a file is never run
for a model it was not made for, and guards need not be checked at each step (vLLM does not
either). A file that does not load is compiled afresh and replaced.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

log = logging.getLogger(__name__)

_ENGINE = Path(__file__).resolve().parent
_TRACED_SOURCES = (_ENGINE / "compiled_step.py", _ENGINE / "fused_layers.py", Path(__file__).resolve())
_SMALL_BUFFER = 4096  # buffers up to this many elements (rotary frequencies) are hashed by value


def _plain(value: Any) -> bool:
    return value is None or isinstance(value, (bool, int, float, str))


def structure_key(module: nn.Module) -> str:
    """A digest of all a traced graph can bake in from ``module``: never its weights' values."""
    digest = hashlib.sha256()
    for name, sub in module.named_modules():
        attrs = sorted((k, repr(v)) for k, v in vars(sub).items() if not k.startswith("_") and _plain(v))
        digest.update(repr((name, type(sub).__qualname__, attrs)).encode())
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        digest.update(repr((name, tuple(tensor.shape), str(tensor.dtype), tensor.stride())).encode())
    for name, buffer in module.named_buffers():
        if buffer.numel() <= _SMALL_BUFFER:
            digest.update(name.encode() + buffer.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def artifact_path(root: str | os.PathLike, module: nn.Module, extra: Sequence[str] = ()) -> Path:
    """Where the saved forward of ``module`` lives (``<root>/compiled_step/<digest>.bin``; root:
    the project's cache directory)."""
    from engine.cpu_features import cpu_flags
    from specbatch_kernels.cpu_ops import sources as cpu_op_sources

    digest = hashlib.sha256()
    for part in (torch.__version__, sys.version, torch.backends.cpu.get_cpu_capability(),
                 ",".join(sorted(cpu_flags())), structure_key(module), *extra):
        digest.update(part.encode() + b"\0")
    for source in (*_TRACED_SOURCES, *cpu_op_sources()):
        digest.update(Path(source).read_bytes())
    return Path(root) / "compiled_step" / f"{digest.hexdigest()[:24]}.bin"


def _serialisable_guards(keep: Callable[[Any], Sequence[bool]]) -> Callable[[Any], list[bool]]:
    """``keep``'s guards less those a saved function cannot hold (globals, object identity)."""
    from torch._dynamo.guards import CheckFunctionManager

    unsupported = CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES

    def guard_filter(entries) -> list[bool]:
        return [k and not (e.is_global or e.guard_type in unsupported) for k, e in zip(keep(entries), entries)]

    return guard_filter


def load(path: Path, forward: Callable) -> Callable | None:
    """The saved function at ``path``, or None when there is none or it does not load (logged)."""
    if not path.exists():
        return None
    try:
        with open(path, "rb") as f:
            fn = torch.compiler.load_compiled_function(f, f_globals=forward.__globals__)
    except Exception as exc:  # a torch upgrade the key missed, a truncated file: compile afresh
        log.warning("compile_step: the saved decode step %s did not load (%s: %s); compiling it again",
                    path, type(exc).__name__, exc)
        return None
    fn.disable_guard_check()
    return fn


def compile_and_save(forward: Callable, args: tuple, path: Path, keep_guards: Callable,
                     tracing: Any) -> Callable:
    """AOT-compile ``forward(*args)`` (one full graph, dynamic where ``args`` are marked) inside
    the ``tracing`` context, save it to ``path`` atomically, and return it."""
    compiled = torch.compile(forward, fullgraph=True, options={"guard_filter_fn": _serialisable_guards(keep_guards)})
    with torch._dynamo.config.patch(enable_aot_compile=True), tracing:
        fn = compiled.aot_compile((args, {}))
    fn.disable_guard_check()  # as a loaded one: the file's name stands for the guards
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        fn.save_compiled_function(str(partial))
        os.replace(partial, path)
    except Exception as exc:  # unsaved, it still runs: the next start compiles again
        log.warning("compile_step: the decode step could not be saved to %s (%s: %s)", path,
                    type(exc).__name__, exc)
        partial.unlink(missing_ok=True)
    return fn
