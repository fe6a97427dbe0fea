#!/usr/bin/env bash
# The prepared GPU check: self-check on one GPU and over all GPUs (NCCL), every split
# layer's equivalence test on the GPUs, short CosmoFlow and U-Net trainings in bf16 and
# fp16 with resume and predict, bf16 again channels-last (parallel.channels_last=true),
# step times and peak memory, the step benchmark
# (scripts/benchmark.py step --device cuda, 2 GPUs); a table and OUT/gpu_check.json.
# A step past its timeout ends with its whole process tree (torchrun's workers too).
#
#   bash scripts/gpu_check.sh                      # all visible GPUs (a few minutes)
#   CUDA_VISIBLE_DEVICES=0 bash scripts/gpu_check.sh   # one GPU
#   bash scripts/gpu_check.sh --cpu                # dry run on the CPU with gloo, tiny sizes (CI)
#   bash scripts/gpu_check.sh --out DIR --skip probe
#
# Uses the active virtual environment, else ./.venv (bash scripts/setup.sh makes it and
# keeps an installed GPU build of torch). Exit status 1 if any step failed.
set -euo pipefail
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then
    sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'
    exit 0
fi
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [[ -z "${VIRTUAL_ENV:-}" && -x .venv/bin/python ]]; then
    # shellcheck disable=SC1091
    source .venv/bin/activate
fi
# installed? (found, not imported: importing would load torch, seconds before the check starts)
if ! python -c "import importlib.util as u, sys; sys.exit(any(u.find_spec(m) is None for m in ('parallel', 'torch')))" \
        2> /dev/null; then
    echo "gpu_check: the project is not installed here; run: bash scripts/setup.sh" >&2
    exit 2
fi
exec python scripts/gpu_check.py "$@"
