# shellcheck shell=bash
# System config: a CPU-only cluster (Slurm; gloo over the network), 2 sockets x 32 cores
# per node. Whole 512^3 boxes split 4 x 2 x 2 = 16 ways: one spatial group per node
# (16 ranks x 4 threads), so every halo exchange stays inside a node; data groups span the
# nodes.
#
#   bash scripts/submit.sh --system cpu                         # strong scaling
#   bash scripts/submit.sh --system cpu --mode weak --instances 8
#
# Sourced by scripts/run.sub and scripts/submit.sh; every value can be overridden from
# the environment (SBATCH_EXTRA= and SRUN_EXTRA= empty clear their flags). Paths are
# examples: point them at your file system.
if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then   # run (--help), not sourced: show the text above
    awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0
fi
: "${SYSTEM:=cpu}"
: "${ORG:=spatialcnn}"
: "${DIVISION:=open}"                               # whole boxes are not the closed benchmark
: "${STATUS:=research}"
: "${MODEL:=cosmoflow}"
: "${CONFIG_NAME:=mlperf512}"
: "${DATA_DIR:=/scratch/datasets/cosmoflow/hdf5_512}"  # python -m cosmoflow.prepare from-universe ...
: "${STAGE_DIR:=/tmp/$(id -un)}"                        # node-local disk
: "${NNODES:=32}"
: "${GPUS_PER_NODE:=0}"
: "${RANKS_PER_NODE:=16}"
: "${CORES_PER_NODE:=64}"                           # 4 threads per rank
: "${WALLTIME:=04:00:00}"
: "${SPATIAL:=[4,2,2]}"
: "${EXTRA_ARGS:=data.workers=1}"
: "${SRUN_EXTRA=}"
: "${MODE:=strong}"
: "${NEXP:=10}"
: "${INSTANCES:=8}"
: "${NODES_PER_INSTANCE:=4}"
: "${TIMEOUT:=0}"
: "${DROP_CACHES_CMD:=}"
: "${SBATCH_EXTRA=}"
: "${TIME_LIMIT_SIGNAL_S:=300}"                   # sbatch --signal=B:USR1@300: checkpoint and stop 5 min before the limit
