#!/usr/bin/env bash
# The GPU check in one offline call of at most 9 minutes (issue #31): bench/gpu_check.py does the
# work (stages, limits, JSON); this wrapper keeps the whole log beside the JSON: in $OUT when set
# (the device machine's only way back), else in bench/results/. Without CUDA it runs the dry
# mode (CPU, tiny shapes, Triton interpreted). Exit status: 0 when every stage is ok.
#
#   bash bench/gpu_check.sh [--dry] [--only parity,throughput] [--budget 540]
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
if [ -n "${OUT:-}" ]; then
    mkdir -p "$OUT"
    LOG="$OUT/gpu_check.log"
else
    mkdir -p bench/results
    LOG="bench/results/gpu_check-$(date +%Y%m%d-%H%M%S)-$(hostname).log"
fi
{
    echo "gpu_check $(date -Is) on $(hostname)"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
    "$PY" -u bench/gpu_check.py "$@"
} 2>&1 | tee "$LOG"
rc=${PIPESTATUS[0]}
echo "log: $LOG"
exit "$rc"
