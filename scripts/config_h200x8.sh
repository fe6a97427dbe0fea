# shellcheck shell=bash
# System config: a GPU cluster of 8 x H200 nodes (Slurm; NCCL between GPUs). CosmoFlow at
# the MLPerf HPC reference settings (128^3, closed division), each sample split in two along
# depth: a spatial group of 2 GPUs, 4 data groups per node, 64 data groups in all.
#
#   bash scripts/submit.sh --system h200x8                      # 10 strong-scaling runs
#   bash scripts/submit.sh --system h200x8 --mode weak --instances 4   # 4 x 4 nodes
#
# Sourced by scripts/run.sub and scripts/submit.sh; every value can be overridden from
# the environment (SBATCH_EXTRA= and SRUN_EXTRA= empty clear their flags). Paths are
# examples: point them at your file system.
if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then   # run (--help), not sourced: show the text above
    awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0
fi
: "${SYSTEM:=h200x8}"
: "${ORG:=spatialcnn}"
: "${DIVISION:=closed}"
: "${STATUS:=research}"
: "${MODEL:=cosmoflow}"
: "${CONFIG_NAME:=default}"                         # MLPerf HPC reference hyperparameters
: "${DATA_DIR:=/lustre/datasets/cosmoflow/hdf5_128}"  # python -m cosmoflow.prepare from-tfrecord ...
: "${STAGE_DIR:=/raid/scratch/$(id -un)}"               # node-local NVMe (or /dev/shm)
: "${NNODES:=16}"
: "${GPUS_PER_NODE:=8}"
: "${RANKS_PER_NODE:=8}"                            # one rank per GPU
: "${CORES_PER_NODE:=112}"                          # 2 x 56 cores: 14 threads per rank
: "${WALLTIME:=01:00:00}"
: "${SPATIAL:=[2,1,1]}"                             # spatial group of 2 within a node
: "${EXTRA_ARGS:=train.global_batch_size=256 data.workers=4 train.precision=bf16}"
: "${SRUN_EXTRA=--gpus-per-node=8}"
: "${MODE:=strong}"
: "${NEXP:=10}"                                     # MLPerf: 10 strong-scaling results
: "${INSTANCES:=4}"
: "${NODES_PER_INSTANCE:=4}"
: "${TIMEOUT:=0}"
: "${DROP_CACHES_CMD:=}"                            # e.g. "sudo /sbin/sysctl vm.drop_caches=3"
: "${SBATCH_EXTRA=--gpus-per-node=8}"              # more sbatch flags (account, partition, ...)
: "${TIME_LIMIT_SIGNAL_S:=300}"                   # sbatch --signal=B:USR1@300: checkpoint and stop 5 min before the limit
