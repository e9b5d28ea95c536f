#!/usr/bin/env bash
# The CUDA paths on a machine with one GPU (see ftsystem/gpu_check.py); writes
# bench/results/gpu_check.json. Needs the project installed in a Python with a CUDA torch.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python}"
mkdir -p bench/results
"$PYTHON" -m ftsystem.gpu_check --json bench/results/gpu_check.json
