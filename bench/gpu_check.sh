#!/usr/bin/env bash
# The CUDA paths on a machine with one GPU (see ftsystem/benchmarks/gpu_check.py): the donor's snapshot
# copy; two replica processes sharing the GPU through Gloo over CUDA tensors; NCCL with one rank
# per group (torchft's group, then FTAR across two epochs); FTAR's wait on NCCL (it returns only
# once the data is there, and fails on an error the group reports after the future). Writes
# bench/results/gpu_check.json. Needs the project installed in a Python with a CUDA torch.
# Arguments go to the check, e.g. `bench/gpu_check.sh --checks ftar_nccl_wait` reruns one.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python}"
mkdir -p bench/results
"$PYTHON" -m ftsystem.benchmarks.gpu_check --json bench/results/gpu_check.json "$@"
