#!/usr/bin/env bash
# GPU check for the kernels: the kernel tests compiled on the GPU (no interpreter), the decode
# attention benchmark, the decode CUDA-graph test and step profile (issue #17), the engine throughput benchmark, then suffix decoding at batch 64. Everything is teed to
# bench/results/gpu_check-<date>.txt. Without a GPU: says so, runs the benchmark's dry mode
# (tiny shapes, Triton interpreted on the CPU) and exits 0 (non-zero only if the dry run fails).
#
#   bash bench/gpu_check.sh            # stage time limits: TESTS_TIMEOUT, BENCH_TIMEOUT,
#                                      # THROUGHPUT_TIMEOUT, SPEC_TIMEOUT (seconds; defaults 240/180/240/240)
set -uo pipefail
cd "$(dirname "$0")/.."
mkdir -p bench/results
LOG="bench/results/gpu_check-$(date +%Y%m%d-%H%M%S).txt"
PY="${PYTHON:-python}"
status=0

stage() {  # stage NAME TIMEOUT CMD...: run one stage, log it, remember a failure
    local name=$1 limit=$2; shift 2
    echo "=== $name: $* (limit ${limit}s)"
    timeout "$limit" "$@"
    local rc=$?
    if [ "$rc" -ne 0 ]; then
        echo "=== $name FAILED (exit $rc$([ "$rc" -eq 124 ] && echo ', timed out'))"
        status=1
    else
        echo "=== $name ok"
    fi
}

{
    echo "gpu_check $(date -Is) on $(hostname); git $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
    if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
        echo "no GPU found: running the kernel benchmark's dry mode only"
        stage "bench/kernels.py (dry)" 300 "$PY" bench/kernels.py
        stage "decode capture tests (CPU path; the CUDA one says it is skipped)" 300 \
            "$PY" -m pytest tests/engine/test_decode_graphs.py -q -p no:cacheprovider -rs
        exit "$status"  # 0 unless the dry run itself broke
    fi
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || true
    "$PY" -c "import torch, triton, transformers; print('torch', torch.__version__, '| triton', triton.__version__, '| transformers', transformers.__version__, '|', torch.cuda.get_device_name())"

    stage "kernel tests on cuda" "${TESTS_TIMEOUT:-240}" env -u TRITON_INTERPRET \
        SPECBATCH_TEST_DEVICE=cuda SPECBATCH_KERNEL_EXAMPLES="${SPECBATCH_KERNEL_EXAMPLES:-30}" \
        "$PY" -m pytest tests/kernels -q -p no:cacheprovider --durations=5

    stage "bench/kernels.py" "${BENCH_TIMEOUT:-180}" env -u TRITON_INTERPRET "$PY" bench/kernels.py

    # Issue #17: decode steps replayed from CUDA graphs give the eager tokens; the step profile
    # shows eager vs captured per-step time at batch 1, 8 and 64.
    stage "decode CUDA graphs test" "${TESTS_TIMEOUT:-240}" env -u TRITON_INTERPRET SPECBATCH_TEST_DEVICE=cuda \
        "$PY" -m pytest tests/engine/test_decode_graphs.py -q -p no:cacheprovider -rs
    stage "bench/step_profile.py (cuda)" "${BENCH_TIMEOUT:-180}" env -u TRITON_INTERPRET \
        "$PY" bench/step_profile.py --device cuda --steps 32

    if [ -f bench/throughput.py ]; then
        stage "bench/throughput.py" "${THROUGHPUT_TIMEOUT:-240}" env -u TRITON_INTERPRET \
            "$PY" bench/throughput.py --dtype bfloat16 --device cuda
    else
        echo "=== bench/throughput.py not found (it is being written on main; merge main to run it): skipped"
    fi
    # Issue #3's suffix target (>= 1.5x at batch 64) is out of reach on a compute-bound CPU;
    # this is where it gets measured.
    stage "bench/speculative.py section 3 (suffix, batch 64)" "${SPEC_TIMEOUT:-240}" env -u TRITON_INTERPRET \
        "$PY" bench/speculative.py --sections 3 --device cuda
    echo "gpu_check finished: $([ "$status" -eq 0 ] && echo 'all stages ok' || echo 'SOME STAGES FAILED')"
    exit "$status"
} 2>&1 | tee "$LOG"
rc=${PIPESTATUS[0]}
echo "log: $LOG"
exit "$rc"
