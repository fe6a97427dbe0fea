#!/usr/bin/env bash
# One pass of the performance figures of docs/performance.md, in a row on a quiet machine.
#
#   bash scripts/perf_pass.sh              # all of them (about 17 minutes on 2 cores)
#   bash scripts/perf_pass.sh OUT_DIR      # into OUT_DIR (default runs/perf_pass/<date>_<time>)
#
# Each benchmark appends its JSON lines to OUT_DIR/<name>.jsonl; at the end the targets of
# issue 16 are printed from their summaries (ratio, target, met or not) and saved as
# OUT_DIR/targets.md. Nothing else should run meanwhile: every figure is a time or a peak.
set -euo pipefail
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then
    sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'
    exit 0
fi
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck source=scripts/setup.sh
source scripts/setup.sh
OUT=${1:-runs/perf_pass/$(date +%Y-%m-%d_%H-%M-%S)}
mkdir -p "$OUT"
export OMP_NUM_THREADS=1
B=(python scripts/benchmark.py)
say() { echo "[perf_pass $(date +%H:%M:%S)] $*" >&2; }

say "calibrate (the planner's measured machine: runs/calibration.json)"
"${B[@]}" calibrate --out "$OUT/calibrate.jsonl" > /dev/null
say "layer: fair halo ratio, 64^3 x 32 channels, 3^3, split 2 along D"
"${B[@]}" layer --out "$OUT/layer.jsonl" > /dev/null
say "step: both models at 64^3, 2-way along D and along W, measured and predicted"
"${B[@]}" step --spatial 2x1x1 --trials 9 --out "$OUT/step.jsonl" > /dev/null
"${B[@]}" step --spatial 1x1x2 --no-weak --trials 9 --out "$OUT/step.jsonl" > /dev/null
say "memory: CosmoFlow 128^3 spatial 4, batch 1"
"${B[@]}" memory --size 128 --splits 1x1x1,4x1x1 --batch 1 --out "$OUT/memory.jsonl" > /dev/null
say "memory: CosmoFlow 256^3 2x2x2, batch 1 (8 ranks)"
"${B[@]}" memory --size 256 --splits 1x1x1,2x2x2 --batch 1 --out "$OUT/memory.jsonl" > /dev/null
say "io: 256^3 block reads against raw reads, every codec"
"${B[@]}" io --size 256 --samples 2 --spatial 2,4,2x2x2 --out "$OUT/io.jsonl" > /dev/null
python scripts/perf_targets.py "$OUT" | tee "$OUT/targets.md"
