"""Kernel tests run the Triton kernels through the CPU interpreter unless told otherwise.

``TRITON_INTERPRET`` is read when ``@triton.jit`` runs, i.e. when ``specbatch_kernels._triton_*`` is first
imported, so it is set here, before any test module imports them (``import specbatch_kernels`` alone
does not import Triton). ``SPECBATCH_TEST_DEVICE=cuda`` (``bench/gpu_check.sh``) runs the same
tests compiled on the GPU instead.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

DEVICE = os.environ.get("SPECBATCH_TEST_DEVICE", "cpu")
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"

_HERE = Path(__file__).resolve().parent
for path in (_HERE, _HERE.parents[1]):  # paged_cases helpers; the repository root (kernels/)
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))


def pytest_report_header(config) -> str:
    return f"kernel tests on {DEVICE} (TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '0')})"
