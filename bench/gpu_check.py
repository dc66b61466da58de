"""The GPU check: one offline call of at most 9 minutes that proves the CUDA path and measures it.

Stages, most valuable first, each in a process of its own with a time limit (a stage that fails,
hangs or dies of a CUDA error is killed at its limit or ends; the next one starts on a fresh
CUDA context, and the figures it saved so far are kept):

    prepare      carried wheels and the real SmolLM2 (GGUF parts reassembled, checked, converted)
    probe        the device; memory copy rate (read + write) and bf16 matmul rate
    kernels      tests/kernels and the decode-graph test, Triton compiled for the GPU
    parity       greedy tokens vs HF generate: fp32 (strict) and bf16 (stated near-tie rule)
    throughput   decode ms/step at batch 1/8/64/256, graphs on/off, HF static generate, x floor
    attention    paged decode attention vs the copy rate
    speculation  batch 64: ngram and suffix (auto k, fixed k) vs none
    priority     interactive arrivals during a full bulk batch, shared steps, no Redis
    kv_memory    KV capacity and peak memory at the default gpu_memory_utilization

Never touches the network. Writes every figure to ``gpu_check.json`` (``$OUT`` when set, else
``bench/results/gpu_check-<date>-<host>.json``) after every stage, and prints one table last.
``--dry`` (the default without CUDA) runs the same stages on the CPU over tiny shapes with the
Triton kernels interpreted; ``tests/bench/test_gpu_check.py`` runs it.

    python bench/gpu_check.py [--dry] [--only parity,throughput] [--budget 540]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if sys.path and Path(sys.path[0] or ".").resolve() == ROOT / "bench":
    sys.path.pop(0)  # bench/queue.py must not shadow the standard library's queue
for _path in (str(ROOT / "kernels"), str(ROOT)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

#: (name, limit in seconds, what it proves). The limits add up to 505 s: with the driver's own
#: start (imports, ~10 s) the whole call stays under 9 minutes.
PLAN: list[tuple[str, int, str]] = [
    ("prepare", 45, "carried wheels; the real SmolLM2 from GGUF parts"),
    ("probe", 20, "device; copy rate; matmul rate"),
    ("kernels", 150, "kernel tests + decode-graph test, compiled"),
    ("parity", 70, "greedy parity vs HF generate, fp32 and bf16"),
    ("throughput", 70, "decode ms/step, graphs on/off, HF static, x floor"),
    ("attention", 30, "paged decode attention vs copy rate"),
    ("speculation", 50, "batch 64: ngram, suffix vs none"),
    ("priority", 40, "interactive under bulk, shared steps"),
    ("kv_memory", 30, "KV capacity, peak memory"),
]
BUDGET_S = 540


def use_wheels(wheels_dir: Path, site: Path) -> dict[str, str]:
    """Make carried pure-Python wheels importable where the machine lacks the package.

    Each ``*.whl`` in ``wheels_dir`` whose top-level module does not import here is unpacked
    into ``site`` (put first on ``sys.path`` and ``PYTHONPATH``, so test subprocesses see it).
    Returns {distribution: "machine <version>" | "wheel <file>"} for the report.
    """
    import importlib.metadata
    import importlib.util

    used: dict[str, str] = {}
    wheels = sorted(wheels_dir.glob("*.whl")) if wheels_dir.is_dir() else []
    for wheel in wheels:
        dist = wheel.name.split("-")[0]
        with zipfile.ZipFile(wheel) as zf:
            tops = {n.split("/")[0] for n in zf.namelist() if not n.split("/")[0].endswith((".dist-info", ".data"))}
            names = sorted(t.removesuffix(".py") for t in tops)
            module = dist.lower().replace("-", "_") if dist.lower().replace("-", "_") in names else (names or [dist])[0]
            if importlib.util.find_spec(module) is not None and str(site) not in (importlib.util.find_spec(module).origin or ""):
                used[dist] = f"machine {safe_version(dist)}"
                continue
            zf.extractall(site)
        used[dist] = f"wheel {wheel.name}"
    if any(v.startswith("wheel") for v in used.values()):
        sys.path.insert(0, str(site))
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
        importlib.invalidate_caches()
    return used


def safe_version(dist: str) -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "?"


def prepare(stage) -> None:
    """The real SmolLM2 where its GGUF (or its parts) is here; never in dry mode (tiny shapes only)."""
    from bench.gpu_models import real_smollm2

    if stage.dry:
        stage.summary("dry run: random tiny shapes only, the real SmolLM2 is not looked for")
        return
    directory, account = real_smollm2()
    stage.put("smollm2_dir", directory)
    stage.summary(account)


def run_stage(name: str, dry: bool, device: str, deadline: float, partial: str, meta: dict) -> None:
    """Body of a stage's process: run it, record a failure with its traceback, exit 0/1."""
    from bench.gpu_stages import STAGES, Stage

    stage = Stage(name, dry, device, deadline, Path(partial), meta)
    try:
        (prepare if name == "prepare" else STAGES[name])(stage)
    except BaseException as exc:  # recorded, then the process ends: the next stage still runs
        traceback.print_exc()
        stage.put("error", f"{type(exc).__name__}: {exc}")
        sys.stdout.flush()
        os._exit(1)
    sys.stdout.flush()
    os._exit(0)


def fork_stage(name: str, limit: float, dry: bool, device: str, meta: dict, workdir: Path) -> dict:
    """Run one stage in a forked process, killed at ``limit``; its record with status and time."""
    partial = workdir / f"{name}.json"
    started = time.time()
    process = multiprocessing.get_context("fork").Process(
        target=run_stage, args=(name, dry, device, started + limit, str(partial), meta), daemon=True)
    process.start()
    process.join(limit)
    status = None
    if process.is_alive():
        process.kill()
        process.join(5)
        status = "timed out"
    elapsed = time.time() - started
    figures = json.loads(partial.read_text()) if partial.exists() else {}
    if status is None:
        status = "ok" if process.exitcode == 0 else ("failed" if process.exitcode == 1 else f"died ({process.exitcode})")
    return {"status": status, "limit_s": limit, "elapsed_s": round(elapsed, 1), **figures}


def cuda_present() -> bool:
    """Asked in a child process: the driver itself must not initialise CUDA before forking."""
    code = "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"
    return subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0


def output_paths(out: str | None) -> Path:
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        return Path(out) / "gpu_check.json"
    results = ROOT / "bench" / "results"
    results.mkdir(parents=True, exist_ok=True)
    return results / f"gpu_check-{time.strftime('%Y%m%d-%H%M%S')}-{platform.node()}.json"


def table(report: dict) -> str:
    """The closing table: every stage, its status and time against its limit, its summary lines."""
    lines = [f"{'stage':<12} {'status':<10} {'elapsed/limit':>14}  figures"]
    for name, _limit, _what in PLAN:
        rec = report["stages"].get(name)
        if rec is None:
            lines.append(f"{name:<12} {'not run':<10}")
            continue
        summary = rec.get("summary") or [rec.get("error", "")]
        lines.append(f"{name:<12} {rec['status']:<10} {rec['elapsed_s']:>6.1f}/{rec['limit_s']:>4.0f} s  {summary[0]}")
        lines += [f"{'':<40}{s}" for s in summary[1:]]
        if rec.get("error") and rec.get("summary"):
            lines.append(f"{'':<40}error: {rec['error']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry", action="store_true", help="CPU, tiny shapes, Triton interpreted (default without CUDA)")
    parser.add_argument("--only", default=None, help="comma list of stages to run (default: all)")
    parser.add_argument("--budget", type=float, default=BUDGET_S, help="seconds for the whole call")
    parser.add_argument("--out", default=os.environ.get("OUT"), help="folder for gpu_check.json (default $OUT)")
    args = parser.parse_args(argv)
    t0 = time.time()
    assert sum(limit for _, limit, _ in PLAN) <= BUDGET_S, "stage limits exceed the 9-minute budget"
    wheels = use_wheels(ROOT / ".whl", Path(tempfile.gettempdir()) / "specbatch-gpu-site")
    dry = args.dry or not cuda_present()
    if dry:
        os.environ["TRITON_INTERPRET"] = "1"  # before any Triton kernel is defined
        os.environ["SPECBATCH_KERNEL_BACKEND"] = "triton"  # the engine's CUDA kernels, interpreted
    else:
        os.environ.pop("TRITON_INTERPRET", None)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # Imported once here, before forking: each stage starts with torch and transformers loaded.
    import torch  # noqa: F401
    import transformers  # noqa: F401

    import bench.gpu_stages  # noqa: F401
    import engine.llm_engine  # noqa: F401

    device = "cpu" if dry else "cuda"
    json_path = output_paths(args.out)
    only = set(args.only.split(",")) if args.only else None
    report = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "host": platform.node(), "dry": dry,
              "git": git_head(), "packages": wheels, "budget_s": args.budget, "stages": {}}
    print(f"gpu_check {'DRY RUN (CPU, tiny shapes, Triton interpreted)' if dry else 'on CUDA'}; "
          f"host {platform.node()}; git {report['git']}; budget {args.budget:.0f} s; json {json_path}")
    print("packages: " + (", ".join(f"{k} {v}" for k, v in wheels.items()) or "the machine's own (no wheels carried)"))
    print("plan: " + ", ".join(f"{n} {limit}s" for n, limit, _ in PLAN) + f" = {sum(lim for _, lim, _ in PLAN)} s")
    meta: dict = {}
    deadline = t0 + args.budget
    with tempfile.TemporaryDirectory(prefix="gpu_check-") as tmp:
        for name, limit, what in PLAN:
            if only is not None and name not in only | {"prepare", "probe"}:
                continue
            limit_now = min(limit, deadline - time.time() - 2)
            if limit_now < 3:
                report["stages"][name] = {"status": "no time", "limit_s": limit, "elapsed_s": 0.0}
                continue
            print(f"=== {name} (limit {limit_now:.0f} s): {what}", flush=True)
            record = fork_stage(name, limit_now, dry, device, meta, Path(tmp))
            report["stages"][name] = record
            print(f"=== {name} {record['status']} in {record['elapsed_s']:.1f} s (limit {limit_now:.0f} s)", flush=True)
            for key in ("smollm2_dir", "hbm_copy_bytes_per_s", "matmul_flops", "device"):
                if key in record:
                    meta[key] = record[key]
            report["elapsed_s"] = round(time.time() - t0, 1)
            write_json(json_path, report)
    report["elapsed_s"] = round(time.time() - t0, 1)
    write_json(json_path, report)
    print(f"\n{table(report)}\ntotal {report['elapsed_s']:.1f} s of {args.budget:.0f}; figures in {json_path}")
    failed = [n for n, r in report["stages"].items() if r["status"] != "ok"]
    print("gpu_check: " + ("all stages ok" if not failed else f"NOT OK: {', '.join(failed)}"), flush=True)
    return 1 if failed else 0


def write_json(path: Path, report: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(report, indent=1, default=str))
    os.replace(tmp, path)


def git_head() -> str:
    if shutil.which("git") is None:
        return "?"
    proc = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return proc.stdout.strip() or "?"


if __name__ == "__main__":
    sys.exit(main())
