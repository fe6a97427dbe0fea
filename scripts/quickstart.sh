#!/usr/bin/env bash
# The main job: on a fresh machine, set up, generate a synthetic CosmoFlow set, and train
# CosmoFlow on CPU with 2 ranks splitting each sample in depth until the MLPerf target
# (validation MAE <= 0.124); then check the MLPerf log.
#
#   scripts/quickstart.sh                 # CosmoFlow (the README's first command)
#   MODEL=unet3d scripts/quickstart.sh    # the 3D U-Net, to mean Dice >= 0.908
#
# Environment: MODEL (cosmoflow|unet3d), NPROC (2), LAUNCHER (mpirun|torchrun),
# DATA (data/<model>_quick), RUN (runs/<model>_quickstart), TIMEOUT (900 s).
# Extra arguments are Hydra overrides passed to training. A rerun starts afresh in the same
# RUN (run.overwrite=true): the previous run's files move to $RUN/previous_<k>/.
set -euo pipefail
cd "$(dirname "$0")/.."

MODEL=${MODEL:-cosmoflow}
NPROC=${NPROC:-2}
LAUNCHER=${LAUNCHER:-mpirun}

TIMEOUT=${TIMEOUT:-900}
RUN=${RUN:-runs/${MODEL}_quickstart}
DATA=${DATA:-data/${MODEL}_quick}

# shellcheck disable=SC1091
source scripts/setup.sh   # the active venv, or ./.venv; the CPU torch where none is installed
export OMP_NUM_THREADS=1

case "$MODEL" in
    cosmoflow) GEN=(--size 32 --train 2048 --val 128 --samples-per-file 16) ;;
    # cases of varying shape, as KiTS19's, chunked for the training crops of the quickstart config
    unet3d)    GEN=(--size-range "32,48" --crop 32 --train 64 --val 16) ;;
    *) echo "MODEL must be cosmoflow or unet3d, got '$MODEL'" >&2; exit 2 ;;
esac
# the manifest records how a synthetic set was made: an older U-Net quickstart's cubes are not reused
if [ "$MODEL" = unet3d ] && [ -f "$DATA/val/manifest.json" ] && ! python -c \
    'import json, sys; sys.exit(not isinstance(json.load(open(sys.argv[1])).get("size"), list))' "$DATA/val/manifest.json"; then
    echo "$DATA holds cases of one shape (an older quickstart's set); this quickstart trains on cases of" \
         "varying shape: remove it, or set DATA to another directory" >&2
    exit 2
fi
if [ ! -f "$DATA/val/manifest.json" ]; then
    echo "generating synthetic $MODEL data in $DATA (${GEN[*]})"
    python -m "$MODEL.prepare" synthetic --out "$DATA" "${GEN[@]}" --seed 0
fi

ARGS=(-m "$MODEL.train" --config-name quickstart "data.dir=$DATA" "run.dir=$RUN" "parallel.spatial=[$NPROC,1,1]" run.overwrite=true "$@")
start=$(date +%s)
if [ "$LAUNCHER" = torchrun ]; then
    timeout "$TIMEOUT" torchrun --standalone --nproc_per_node "$NPROC" "${ARGS[@]}"
else
    timeout "$TIMEOUT" mpirun -n "$NPROC" python "${ARGS[@]}"
fi
echo "training took $(( $(date +%s) - start )) s; outputs in $RUN"

# CosmoFlow's log follows MLPerf HPC's rules, the U-Net's MLPerf Training's (open division:
# synthetic cases are not KiTS19)
if [ "$MODEL" = cosmoflow ]; then RULES=(--usage hpc --ruleset 3.0.0); else RULES=(--usage training --ruleset 4.0.0); fi
python -m mlperf_logging.compliance_checker "${RULES[@]}" --log_output "$RUN/compliance_checker.log" "$RUN/mlperf.log"
