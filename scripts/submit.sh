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
# Slurm for INSTANCES x NODES_PER_INSTANCE nodes. The other outputs: see scripts/run.sub --help.
#
# Before sbatch, the job is checked against the cluster (sinfo): a node count beyond the
# partition, more ranks or cores per node than its nodes have, and GPU flags on nodes
# without GPUs are refused with the numbers. TIME_LIMIT_SIGNAL_S=N adds
# --signal=B:USR1@N: N seconds before the time limit the runs write a checkpoint and stop;
# resubmit with RESUME=1 LOGDIR=<the job's LOGDIR> to resume them (docs/cluster.md). The
# console is runs/slurm-<job>_<submission time>.out.
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

# What the cluster has, asked of sinfo before sbatch (a job that cannot fit is refused here,
# with the numbers, instead of pending forever or failing in srun): the partition's node
# count, its nodes' CPUs against RANKS_PER_NODE and CORES_PER_NODE, and GPU flags only
# where its nodes have GPUs.
check_against_cluster() {
    local nodes=$1 partition=${SBATCH_PARTITION:-} arg prev="" total cpus gres gpu_flags="" srun_more
    shift
    # No sinfo, or no controller it can reach (a stand-in sbatch, a login node without Slurm): sbatch says.
    command -v sinfo > /dev/null && timeout 30 sinfo -h -o '%P' > /dev/null 2>&1 || return 0
    read -ra srun_more <<< "${SRUN_EXTRA:-}"
    for arg in "$@" "${srun_more[@]}"; do
        case "$arg" in
            --partition=*) partition=${arg#*=} ;;
            --gpus*|--gres=*gpu*) gpu_flags="$gpu_flags $arg" ;;
        esac
        if [[ "$prev" == -p || "$prev" == --partition ]]; then partition=$arg; fi
        prev=$arg
    done
    if [[ -z "$partition" ]]; then partition=$(sinfo -h -o '%P' | sed -n 's/\*$//p' | head -n 1); fi
    [[ -n "$partition" ]] || return 0
    total=$(sinfo -h -N -p "$partition" -o '%N' | sort -u | wc -l)
    if (( total == 0 )); then echo "submit.sh: partition '$partition' has no nodes (sinfo -p $partition)" >&2; exit 2; fi
    if (( nodes > total )); then
        echo "submit.sh: the job needs $nodes node(s) ($MODE scaling: NNODES=$NNODES, INSTANCES=$INSTANCES," \
            "NODES_PER_INSTANCE=${NODES_PER_INSTANCE:-1}) but partition '$partition' has $total" >&2
        exit 2
    fi
    cpus=$(sinfo -h -N -p "$partition" -o '%c' | tr -dc '0-9\n' | sort -n | head -n 1)
    if [[ -n "$cpus" ]] && (( RANKS_PER_NODE > cpus || CORES_PER_NODE > cpus )); then
        echo "submit.sh: RANKS_PER_NODE=$RANKS_PER_NODE and CORES_PER_NODE=$CORES_PER_NODE, but the nodes of" \
            "partition '$partition' have $cpus CPUs (sinfo): set both to at most $cpus" >&2
        exit 2
    fi
    gres=$(sinfo -h -N -p "$partition" -o '%G' | sort -u | tr '\n' ' ')
    if [[ -n "$gpu_flags" && "$gres" != *gpu* ]]; then
        echo "submit.sh: GPU flags ($gpu_flags) from SBATCH_EXTRA, SRUN_EXTRA or the sbatch arguments, but the" \
            "nodes of partition '$partition' have no GPUs (sinfo gres: $gres): on CPU nodes clear them with" \
            "SBATCH_EXTRA= SRUN_EXTRA=" >&2
        exit 2
    fi
}

if [[ "$DRY" == 0 ]]; then
    if [[ -z "${VIRTUAL_ENV:-}" && -f .venv/bin/activate ]]; then
        # shellcheck disable=SC1091
        source .venv/bin/activate
    fi
    # installed? (found, not imported: importing them would load torch, ~2 CPU-s a submission)
    if ! python -c "import importlib.util as u, sys
sys.exit(any(u.find_spec(m) is None for m in ('parallel', 'mlperf_logging', 'hydra', 'torch')))" 2>/dev/null; then
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
    SIGNAL_ARGS=()
    if (( ${TIME_LIMIT_SIGNAL_S:-0} > 0 )); then
        # Slurm's warning before the time limit: run.sub passes it on; the runs checkpoint and stop.
        export STOP_SIGNAL=${STOP_SIGNAL:-USR1}
        SIGNAL_ARGS=(--signal="B:$STOP_SIGNAL@$TIME_LIMIT_SIGNAL_S")
    fi
    check_against_cluster "$nodes" "${SB_MORE[@]}" "$@"
    mkdir -p runs   # Slurm does not create the output's folder
    # The submission time in the console's name: a repeated job id never overwrites an earlier console.
    CMD=(sbatch -N "$nodes" -t "$WALLTIME" -J "spatialcnn_${SYSTEM}_$MODE" -o "runs/slurm-%j_$(date +%y%m%d%H%M%S%N).out"
         --export=ALL "${SIGNAL_ARGS[@]}" "${SB_MORE[@]}" "$@" scripts/run.sub)
else
    CMD=(bash scripts/run.sub)
fi
echo "submit.sh: CONFIG=$CONFIG_FILE MODE=$MODE NEXP=$NEXP INSTANCES=$INSTANCES ${CMD[*]}"
if [[ "$DRY" == 1 ]]; then exit 0; fi
exec "${CMD[@]}"
