# shellcheck shell=bash
# System config: this machine, CPU only, no Slurm (one node). By default each instance
# trains the quickstart config (configs/<model>/quickstart.yaml) on the synthetic set of
# scripts/quickstart.sh to the real MLPerf target on the validation split: a 2-instance
# weak-scaling submission takes about 4-5 minutes on 2 cores (closed division for
# CosmoFlow: SGD). CONFIG_NAME=smoke is a plumbing check of the same path in about a
# minute (tests/launch/test_cluster_scripts.py): a tiny network that evaluates on the training
# split, not a benchmark result (open division).
#
#   bash scripts/submit.sh --system local --mode weak --instances 2
#   CONFIG_NAME=smoke bash scripts/submit.sh --system local --mode weak --instances 2
#
# Sourced by scripts/run.sub and scripts/submit.sh; every value can be overridden from
# the environment (VAR=value bash scripts/submit.sh ...).
if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then   # run (--help), not sourced: show the text above
    awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0
fi
: "${SYSTEM:=local}"                      # results/<SYSTEM>/, systems/<SYSTEM>.json
: "${ORG:=spatialcnn}"                    # <org>/ and submission_org
: "${STATUS:=research}"
: "${MODEL:=cosmoflow}"                   # cosmoflow | unet3d
: "${CONFIG_NAME:=quickstart}"            # configs/<model>/<CONFIG_NAME>.yaml (quickstart | smoke)
if [[ "$CONFIG_NAME" == quickstart ]]; then
    # CosmoFlow's quickstart trains with SGD (closed division); the U-Net is not an HPC
    # benchmark and its quickstart set is not KiTS19: open
    if [[ "$MODEL" == cosmoflow ]]; then : "${DIVISION:=closed}"; else : "${DIVISION:=open}"; fi
    : "${DATA_DIR:=data/${MODEL}_quick}"  # the data of scripts/quickstart.sh, made when missing
    if [[ "$MODEL" == cosmoflow ]]; then
        : "${SYNTHETIC_ARGS:=--size 32 --train 2048 --val 128 --samples-per-file 16 --seed 0}"
    else
        : "${SYNTHETIC_ARGS:=--size-range 32,48 --crop 32 --train 64 --val 16 --seed 0}"  # as scripts/quickstart.sh
    fi
else
    : "${DIVISION:=open}"                 # smoke: evaluated on the training split
    : "${DATA_DIR:=data/${MODEL}_smoke}"
    : "${SYNTHETIC_ARGS:=--size 16 --train 8 --val 4 --seed 0}"
fi
: "${STAGE_DIR:=${TMPDIR:-/tmp}/spatialcnn_stage_$(id -un)}"  # node-local copy, made at init
: "${NNODES:=1}"
: "${RANKS_PER_NODE:=2}"                  # ranks of one run (strong) or of each instance (weak)
: "${GPUS_PER_NODE:=0}"
: "${CORES_PER_NODE:=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)}"
: "${WALLTIME:=00:30:00}"
: "${SPATIAL:=[2,1,1] [1,2,1]}"           # one grid per instance, cycled
: "${EXTRA_ARGS:=}"                       # more Hydra overrides
: "${MODE:=weak}"
: "${NEXP:=2}"
: "${INSTANCES:=2}"
: "${TIMEOUT:=600}"                       # seconds per run
