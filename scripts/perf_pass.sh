#!/usr/bin/env bash
# One pass of the figures in docs/performance.md's results table, in a row on a quiet machine.
#
#   bash scripts/perf_pass.sh                          # all of them (about 30 minutes on 2 cores)
#   bash scripts/perf_pass.sh OUT_DIR                  # output into OUT_DIR (default runs/perf_pass/<date>_<time>)
#   bash scripts/perf_pass.sh OUT_DIR docs/results     # and the result records into the committed ones
#
# Each benchmark appends its JSON lines to OUT_DIR/<name>.jsonl and one result record per
# summary to RECORDS/<name>.jsonl (default OUT_DIR/records); at the end the results table is
# printed from the records (scripts/results_table.py). After a pass into docs/results,
# `python scripts/results_table.py --write docs/performance.md` puts the new table into the doc.
# Nothing else should run meanwhile: every figure is a time or a peak.
set -euo pipefail
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then
    sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'
    exit 0
fi
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck source=scripts/setup.sh
source scripts/setup.sh
OUT=${1:-runs/perf_pass/$(date +%Y-%m-%d_%H-%M-%S)}
REC=${2:-$OUT/records}
mkdir -p "$OUT" "$REC"
export OMP_NUM_THREADS=1
say() { echo "[perf_pass $(date +%H:%M:%S)] $*" >&2; }
bench() { local name=$1; shift; python scripts/benchmark.py "$@" --out "$OUT/$name.jsonl" --record "$REC/$name.jsonl" > /dev/null; }

say "calibrate (the planner's measured machine: runs/calibration.json)"
python scripts/benchmark.py calibrate --out "$OUT/calibrate.jsonl" > /dev/null
say "layer: halo overhead, 64^3 x 32 channels, 3^3, split 2 along D"
bench layer layer
say "step: both models at 64^3, 2-way along D, measured and predicted"
bench step step --trials 9
memory() {  # one grid: the framework's step, then a user's program (warm-up subtracted, then from outside)
    say "memory $*"
    bench memory memory "$@"
    bench memory memory --api "$@"
    bench memory memory --api --no-warmup "$@"
}
memory --size 128 --splits 1x1x1,4x1x1 --batch 1
memory --size 256 --splits 1x1x1,2x2x2 --batch 1
say "io: 256^3 block reads against raw reads, every codec"
bench io io --size 256 --samples 2 --spatial 2,4,2x2x2
python scripts/results_table.py --records "$REC" | tee "$OUT/table.md"
