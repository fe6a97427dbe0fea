#!/usr/bin/env bash
# Set up (scripts/setup.sh) if needed, then run the test suite on CPU with gloo.
#
#   bash scripts/test.sh               # the whole suite (899 tests: 500-570 s from a fresh clone on 2 cores; up to ~1.4x on a slow host)
#   bash scripts/test.sh -m unit       # one tier: unit (under a minute), ranks or launch
#   bash scripts/test.sh -m "not slow" # leave out the longest launches (about half the time)
#   bash scripts/test.sh -k halo       # extra arguments go to pytest
#   TEST_WORKERS=0 bash scripts/test.sh  # one process (default 2: pytest-xdist, a file or the ranks tier per worker)
#
# Tiers are folders (tests/conftest.py sets the marker): tests/unit = pure logic and
# single-process work on real files; tests/ranks = several gloo ranks of the rank pool;
# tests/launch = python -m, torchrun, mpirun, the scripts and a real Slurm on this machine.
set -euo pipefail
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then
    sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'
    exit 0
fi
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck source=scripts/setup.sh
source scripts/setup.sh
export OMP_NUM_THREADS=1
# The repository's modules compiled once: where PYTHONDONTWRITEBYTECODE is set (as on this
# machine) every fresh interpreter the suite starts (each launched rank, each script) would
# compile them again, ~0.2 CPU-s each. A file that does not compile is pytest's to report.
python -m compileall -q parallel cosmoflow unet3d scripts tests > /dev/null || true

# Two workers (pytest-xdist), each taking whole groups (tests/conftest.py): a test file, or
# the whole ranks tier, so that module fixtures, the real Slurm cluster and one set of rank
# pools stay within one worker; the longest start first (tests/conftest.py LONGEST_FIRST).
python -m pytest -q -n "${TEST_WORKERS:-2}" --dist loadgroup --durations=20 "$@"
