#!/usr/bin/env bash
# Submit an MLPerf-style experiment for a system: sbatch scripts/run.sub with the node
# count and walltime of scripts/config_<system>.sh, or run it here when there is no Slurm.
#
#   bash scripts/submit.sh --system local --mode weak --instances 2   # this machine, ~1-2 min
#   bash scripts/submit.sh --system h200x8                            # sbatch, 10 strong runs
#   bash scripts/submit.sh --system cpu --mode weak --instances 8 -- --account=abc
#
#   --system NAME     scripts/config_<NAME>.sh (or a path to a config file)   [env CONFIG, local]
#   --mode M          strong | weak                                          [env MODE]
#   --nexp N          strong scaling: runs in a row                          [env NEXP]
#   --instances M     weak scaling: concurrent model instances               [env INSTANCES]
#   --local           run scripts/run.sub here even if sbatch exists
#   --dry-run         print what would run
#   -h, --help        this help
#   -- ARGS           more sbatch flags (account, partition, ...)
#
# A fresh clone works: without an environment that imports the project, scripts/setup.sh
# creates .venv first. When DATA_DIR lacks data and the config sets SYNTHETIC_ARGS, a
# synthetic set is generated (python -m <model>.prepare synthetic). Weak scaling asks
# Slurm for INSTANCES x NODES_PER_INSTANCE nodes. The job's console: runs/slurm-<job>.out;
# the other outputs: see scripts/run.sub --help.
set -euo pipefail
usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CONFIG=${CONFIG:-local}
LOCAL=0
DRY=0
while [[ $# -gt 0 ]]; do
    case "$1" in
        -h|--help) usage; exit 0 ;;
        --system) CONFIG=$2; shift 2 ;;
        --mode) MODE=$2; shift 2 ;;
        --nexp) NEXP=$2; shift 2 ;;
        --instances) INSTANCES=$2; shift 2 ;;
        --local) LOCAL=1; shift ;;
        --dry-run) DRY=1; shift ;;
        --) shift; break ;;
        *) echo "submit.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done
if [[ -f "$CONFIG" ]]; then CONFIG_FILE=$(cd "$(dirname "$CONFIG")" && pwd)/$(basename "$CONFIG"); else CONFIG_FILE=$REPO/scripts/config_$CONFIG.sh; fi
[[ -f "$CONFIG_FILE" ]] || { echo "submit.sh: no system config $CONFIG_FILE" >&2; exit 2; }
cd "$REPO"
# shellcheck source=scripts/config_local.sh
source "$CONFIG_FILE"
if [[ "$DATA_DIR" != /* ]]; then DATA_DIR=$REPO/$DATA_DIR; fi
export CONFIG=$CONFIG_FILE MODE NEXP INSTANCES DATA_DIR

if [[ "$DRY" == 0 ]]; then
    if [[ -z "${VIRTUAL_ENV:-}" && -f .venv/bin/activate ]]; then
        # shellcheck disable=SC1091
        source .venv/bin/activate
    fi
    if ! python -c "import parallel, mlperf_logging, hydra" 2>/dev/null; then
        # shellcheck source=scripts/setup.sh
        source scripts/setup.sh
    fi
    if [[ -n "${SYNTHETIC_ARGS:-}" && ! -f "$DATA_DIR/val/manifest.json" ]]; then
        read -ra GEN <<< "$SYNTHETIC_ARGS"
        echo "submit.sh: generating synthetic $MODEL data in $DATA_DIR (${GEN[*]})"
        python -m "$MODEL.prepare" synthetic --out "$DATA_DIR" "${GEN[@]}" --quiet
    fi
fi

if [[ "$LOCAL" == 0 ]] && command -v sbatch > /dev/null; then
    nodes=$NNODES
    if [[ "$MODE" == weak ]]; then nodes=$(( INSTANCES * ${NODES_PER_INSTANCE:-1} )); export NODES_PER_INSTANCE=${NODES_PER_INSTANCE:-1}; fi
    read -ra SB_MORE <<< "${SBATCH_EXTRA:-}"
    mkdir -p runs   # Slurm does not create the output's folder
    CMD=(sbatch -N "$nodes" -t "$WALLTIME" -J "spatialcnn_${SYSTEM}_$MODE" -o "runs/slurm-%j.out" --export=ALL
         "${SB_MORE[@]}" "$@" scripts/run.sub)
else
    CMD=(bash scripts/run.sub)
fi
echo "submit.sh: CONFIG=$CONFIG_FILE MODE=$MODE NEXP=$NEXP INSTANCES=$INSTANCES ${CMD[*]}"
if [[ "$DRY" == 1 ]]; then exit 0; fi
exec "${CMD[@]}"
