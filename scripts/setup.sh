#!/usr/bin/env bash
# Install the project and its dependencies into the active virtual environment, or into
# ./.venv (created if missing) when none is active. Safe to run again.
#
#   bash scripts/setup.sh            # then: source .venv/bin/activate
#
# torch: an installed torch (a GPU build on a cluster) is kept. Where none is present, the
# CPU build is installed first, so that the plain "torch>=2.6" requirement does not pull a
# multi-GB CUDA build onto a machine without a GPU. Set TORCH_SPEC to choose another.
set -euo pipefail
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then
    sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'
    exit 0
fi
# scripts/check_docs.py runs the documented scripts inside an environment already set up
if [[ -n "${SPATIALCNN_SKIP_SETUP:-}" ]]; then
    # shellcheck disable=SC2317  # return when sourced, exit when run
    return 0 2> /dev/null || exit 0
fi
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [[ -z "${VIRTUAL_ENV:-}" ]]; then
    [[ -x .venv/bin/python ]] || python3 -m venv .venv
    # shellcheck disable=SC1091
    source .venv/bin/activate
fi
if ! python -c "import torch" 2>/dev/null; then
    echo "setup: no torch found; installing the CPU build (${TORCH_SPEC:-torch==2.13.0})"
    python -m pip install -q "${TORCH_SPEC:-torch==2.13.0}" || python -m pip install -q "torch>=2.6"
fi
python -m pip install -q -e ".[mpi,test,monai,slurm]"
echo "setup: done ($(python -c 'import torch; print("torch", torch.__version__)'), $(command -v mpirun || echo 'no mpirun'))"
