#!/usr/bin/env bash
# Everything that needs a GPU, in one run for a short loan of a machine with one: the CUDA
# paths (bench/gpu_check.sh) and the main job on CUDA (ftsystem.benchmarks.gpu_e2e). Writes
# bench/results/gpu_check.json and bench/results/gpu_e2e.json, and copies them to $OUT when
# set. Needs a Python with a CUDA torch and the project importable (PYTHONPATH), and etcd
# (FTSYSTEM_ETCD_BIN).
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1
mkdir -p bench/results
status=0
timeout 200 "$PYTHON" -m ftsystem.benchmarks.gpu_check --json bench/results/gpu_check.json \
    || status=1
timeout 340 "$PYTHON" -m ftsystem.benchmarks.gpu_e2e --json bench/results/gpu_e2e.json \
    || status=1
if [ -n "${OUT:-}" ]; then
    cp bench/results/gpu_check.json bench/results/gpu_e2e.json "$OUT"/ 2>/dev/null
fi
exit $status
