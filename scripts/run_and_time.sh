#!/usr/bin/env bash
# Run one training instance (staging included), time it, and print its MLPerf RESULT line:
#
#   RESULT,COSMOFLOW_HPC,,<seconds>,<org>,<start date>        (MODEL=cosmoflow)
#   RESULT,IMAGE_SEGMENTATION,,<seconds>,<org>,<start date>   (MODEL=unet3d)
#
# <seconds> is run_stop - run_start from the run's mlperf.log (the MLPerf score; staging
# happens before run_start, inside init, as HPC rules 3.0 want). scripts/run.sub calls it
# once per run (strong scaling) or once per concurrent instance (weak scaling).
#
#   scripts/run_and_time.sh [options] [--] [HYDRA_OVERRIDE ...]
#
#   --run-dir DIR        run.dir of this run (outputs, mlperf.log)   [env RUN_DIR, required]
#   --seed N             train.seed                                  [env SEED, random]
#   --instance I         instance number (weak scaling), picks the port   [env INSTANCE, 0]
#   --launcher L         srun | mpirun | torchrun | python           [env LAUNCHER: srun in a
#                        Slurm job, else mpirun]
#   --nodes N            nodes of this run (srun)                    [env NODES_PER_RUN, 1]
#   --node-offset K      first node of this run in the allocation (srun --relative) [env NODE_OFFSET, 0]
#   --ranks-per-node R   ranks per node (= GPUs per node on GPU systems) [env RANKS_PER_NODE, 2]
#   --cores-per-node C   cores per node for the thread count         [env CORES_PER_NODE, nproc]
#   --spatial S          split of each sample, e.g. 2,1,1            [env SPATIAL, 1,1,1]
#   --cpus LIST          local launchers: run on these CPUs only      [env CPUS]
#   --timeout S          stop the training after S seconds (0: never) [env TIMEOUT, 0]
#   -h, --help           this help
#
# Also read from the environment (the config_<system>.sh files set them): MODEL
# (cosmoflow), CONFIG_NAME (default), DATA_DIR (data.dir), STAGE_DIR (node-local staging
# root; data.stage_dir=STAGE_DIR/spatialcnn_<job>_<instance>_<split>, empty: read in place), ORG,
# SYSTEM (mlperf.org, mlperf.platform), DIVISION, STATUS, EXTRA_ARGS (more Hydra overrides,
# split at spaces), SRUN_EXTRA (more srun flags), SRUN_MPI (srun --mpi, default none: the
# ranks meet through SLURM_* variables; pmi2 for the pip MPICH, see docs/cluster.md),
# JOB_TAG (names the staging folder; run.sub sets it), STAGE_SHARED (run.sub STAGE_ONCE=1:
# the job's staged copy, STAGE_SHARED<node name>, replaces the instance's own staging).
#
# Threads and binding: OMP_NUM_THREADS = cores per node / ranks per node. srun gets
# --cpus-per-task, --cpu-bind=cores and --distribution=block:block (consecutive ranks, and
# with them each spatial group, on one node); local launches go through scripts/launch.sh.
# Under srun each task runs through scripts/srun_task.sh: when the step fails, the task
# that failed first is named with its own exit status, which becomes this script's. The
# tasks and cores per node are checked against SLURM_CPUS_ON_NODE before srun starts.
# A result is read only from an mlperf.log this run wrote.
# Exit status: the training's when it failed (under srun: the first failed task's), 3 when
# it ended without reaching the target, 4 when run.stop_signal stopped it (checkpoint kept).
set -euo pipefail
usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

RUN_DIR=${RUN_DIR:-}
SEED=${SEED:-$(( (RANDOM << 15) | RANDOM ))}
INSTANCE=${INSTANCE:-0}
RUN_INDEX=${RUN_INDEX:-0}
if [[ -n "${SLURM_JOB_ID:-}" ]] && command -v srun > /dev/null; then LAUNCHER=${LAUNCHER:-srun}; fi
LAUNCHER=${LAUNCHER:-mpirun}
NODES_PER_RUN=${NODES_PER_RUN:-1}
NODE_OFFSET=${NODE_OFFSET:-0}
RANKS_PER_NODE=${RANKS_PER_NODE:-2}
CORES_PER_NODE=${CORES_PER_NODE:-$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)}
SPATIAL=${SPATIAL:-1,1,1}
CPUS=${CPUS:-}
TIMEOUT=${TIMEOUT:-0}
while [[ $# -gt 0 ]]; do
    case "$1" in
        -h|--help) usage; exit 0 ;;
        --run-dir) RUN_DIR=$2; shift 2 ;;
        --seed) SEED=$2; shift 2 ;;
        --instance) INSTANCE=$2; shift 2 ;;
        --launcher) LAUNCHER=$2; shift 2 ;;
        --nodes) NODES_PER_RUN=$2; shift 2 ;;
        --node-offset) NODE_OFFSET=$2; shift 2 ;;
        --ranks-per-node) RANKS_PER_NODE=$2; shift 2 ;;
        --cores-per-node) CORES_PER_NODE=$2; shift 2 ;;
        --spatial) SPATIAL=$2; shift 2 ;;
        --cpus) CPUS=$2; shift 2 ;;
        --timeout) TIMEOUT=$2; shift 2 ;;
        --) shift; break ;;
        -*) echo "run_and_time.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
        *) break ;;
    esac
done
[[ -n "$RUN_DIR" ]] || { echo "run_and_time.sh: --run-dir (or RUN_DIR) is required" >&2; exit 2; }
MODEL=${MODEL:-cosmoflow}
CONFIG_NAME=${CONFIG_NAME:-default}
case "$MODEL" in
    cosmoflow) RESULT_NAME=COSMOFLOW_HPC ;;
    unet3d) RESULT_NAME=IMAGE_SEGMENTATION ;;
    *) echo "run_and_time.sh: MODEL must be cosmoflow or unet3d, got '$MODEL'" >&2; exit 2 ;;
esac
SPATIAL=${SPATIAL//[\[\] ]/}
THREADS=$(( CORES_PER_NODE / RANKS_PER_NODE > 0 ? CORES_PER_NODE / RANKS_PER_NODE : 1 ))

OVERRIDES=("run.dir=$RUN_DIR" "train.seed=$SEED")
[[ -n "${DATA_DIR:-}" ]] && OVERRIDES+=("data.dir=$DATA_DIR")
# One staging folder per job, instance and split: runs of a job reuse it, other grids never do.
# JOB_TAG (run.sub: job id and submission time) keeps a repeated job id from reusing them.
if [[ -n "${STAGE_SHARED:-}" ]]; then
    # run.sub STAGE_ONCE=1 staged whole files once per job into STAGE_SHARED<node>: every rank
    # takes its node's folder (Hydra resolves the node's name in the rank's own environment)
    # and finds every file there, checked; nothing is read from DATA_DIR.
    OVERRIDES+=("data.stage_dir=${STAGE_SHARED}\${oc.env:SLURMD_NODENAME,local}" data.stage_read_once=true
                data.stage_blocks_only=false)
elif [[ -n "${STAGE_DIR:-}" ]]; then
    OVERRIDES+=("data.stage_dir=$STAGE_DIR/spatialcnn_${JOB_TAG:-${SLURM_JOB_ID:-local}}_${INSTANCE}_${SPATIAL//,/x}")
fi
[[ -n "${ORG:-}" ]] && OVERRIDES+=("mlperf.org=$ORG")
[[ -n "${SYSTEM:-}" ]] && OVERRIDES+=("mlperf.platform=$SYSTEM")
[[ -n "${DIVISION:-}" ]] && OVERRIDES+=("mlperf.division=$DIVISION")
[[ -n "${STATUS:-}" ]] && OVERRIDES+=("mlperf.status=$STATUS")
read -ra EXTRA <<< "${EXTRA_ARGS:-}"
OVERRIDES+=("${EXTRA[@]}" "$@")

mkdir -p "$RUN_DIR"
# The result is read only from a log this run wrote (an earlier job's is never reported).
marker=$RUN_DIR/.run_and_time.start
touch "$marker"
start=$(date +%s)
start_fmt=$(date +'%Y-%m-%d %r')
echo "run_and_time.sh: STARTING TIMING RUN AT $start_fmt (instance $INSTANCE, seed $SEED, $LAUNCHER)"
case "$LAUNCHER" in
    srun)
        ntasks=$(( NODES_PER_RUN * RANKS_PER_NODE ))
        # Tasks and cores against the node, before srun ("More processors requested than permitted").
        if [[ -n "${SLURM_CPUS_ON_NODE:-}" ]] && (( RANKS_PER_NODE * THREADS > SLURM_CPUS_ON_NODE )); then
            echo "run_and_time.sh: RANKS_PER_NODE=$RANKS_PER_NODE x $THREADS thread(s) (CORES_PER_NODE=$CORES_PER_NODE)" \
                "= $(( RANKS_PER_NODE * THREADS )) CPUs per node, but the job has SLURM_CPUS_ON_NODE=$SLURM_CPUS_ON_NODE" \
                "on ${SLURMD_NODENAME:-this node}: set CORES_PER_NODE (and RANKS_PER_NODE) to at most $SLURM_CPUS_ON_NODE" >&2
            exit 2
        fi
        TASKS_DIR=$RUN_DIR/tasks_$(date +%s%N)
        # One port per concurrent step; ports below the ephemeral range (32768).
        export MASTER_PORT=${MASTER_PORT:-$(( 20000 + (${SLURM_JOB_ID:-0} * 97 + RUN_INDEX * 64 + INSTANCE) % 12000 ))}
        export OMP_NUM_THREADS=$THREADS LOCAL_WORLD_SIZE=$RANKS_PER_NODE
        IFS=, read -r sd sh sw <<< "$SPATIAL"
        # The file, not the module: the plan needs no torch (python -m parallel.placement would import it).
        python "$HERE/../parallel/placement.py" --nodes "$NODES_PER_RUN" --ranks-per-node "$RANKS_PER_NODE" \
            --spatial "$sd" "$sh" "$sw" --cores-per-node "$CORES_PER_NODE" | sed 's/^/run_and_time.sh: plan: /' || true
        read -ra SRUN_MORE <<< "${SRUN_EXTRA:-}"
        CMD=(srun --nodes="$NODES_PER_RUN" --ntasks="$ntasks" --ntasks-per-node="$RANKS_PER_NODE"
             --relative="$NODE_OFFSET" --cpus-per-task="$THREADS" --cpu-bind=cores
             --distribution=block:block --mpi="${SRUN_MPI:-none}" --kill-on-bad-exit=1 "${SRUN_MORE[@]}"
             "$HERE/srun_task.sh" "$TASKS_DIR" python -m "$MODEL.train" --config-name "$CONFIG_NAME" "parallel.spatial=[$SPATIAL]" "${OVERRIDES[@]}")
        if [[ "$TIMEOUT" != 0 ]]; then CMD=(timeout "$TIMEOUT" "${CMD[@]}"); fi
        echo "run_and_time.sh: OMP_NUM_THREADS=$OMP_NUM_THREADS LOCAL_WORLD_SIZE=$LOCAL_WORLD_SIZE MASTER_PORT=$MASTER_PORT ${CMD[*]}"
        ;;
    mpirun|mpiexec|torchrun|python)
        CMD=("$HERE/launch.sh" --launcher "$LAUNCHER" --nproc "$RANKS_PER_NODE" --spatial "$SPATIAL"
             --model "$MODEL" --config "$CONFIG_NAME" --threads "$THREADS" --timeout "$TIMEOUT")
        if [[ -n "$CPUS" ]]; then CMD+=(--cpus "$CPUS"); fi
        CMD+=(-- "${OVERRIDES[@]}")
        ;;
    *) echo "run_and_time.sh: --launcher must be srun, mpirun, torchrun or python, got '$LAUNCHER'" >&2; exit 2 ;;
esac
rc=0
"${CMD[@]}" || rc=$?
end=$(date +%s)
if [[ "$LAUNCHER" == srun ]] && (( rc )); then
    # srun returns the status of the peers it killed (143) or the largest: name the task that failed first.
    first=$(cat "$TASKS_DIR"/task_* 2>/dev/null | awk '$4 != 0' | sort -n | head -n 1)
    if [[ -n "$first" ]]; then
        read -r _ frank fnode fstatus <<< "$first"
        how="exit status $fstatus"
        if (( fstatus > 128 )); then how="$how (signal $(( fstatus - 128 )): $(kill -l $(( fstatus - 128 )) 2>/dev/null || echo '?'))"; fi
        echo "run_and_time.sh: task $frank (rank $frank) on $fnode failed first, $how; srun returned $rc" >&2
        rc=$fstatus
    else
        echo "run_and_time.sh: srun returned $rc and no task recorded its end in $TASKS_DIR" >&2
    fi
fi
echo "run_and_time.sh: ENDING TIMING RUN AT $(date +'%Y-%m-%d %r') (exit $rc, wall $((end - start)) s)"

# The score: run_stop - run_start in the MLPerf log, and the status run_stop carries.
if [[ ! "$RUN_DIR/mlperf.log" -nt "$marker" ]]; then
    echo "run_and_time.sh: $RUN_DIR/mlperf.log was not written by this run (exit $rc): no result" >&2
    exit $(( rc ? rc : 1 ))
fi
if [[ -f "$RUN_DIR/summary.json" && "$RUN_DIR/summary.json" -nt "$marker" ]] && grep -q '"status": "stopped_by_signal"' "$RUN_DIR/summary.json"; then
    echo "run_and_time.sh: stopped by run.stop_signal; its checkpoint is in $RUN_DIR/checkpoints (resume: train.resume=true): no result"
    exit 4
fi
read -r seconds status < <(python - "$RUN_DIR/mlperf.log" <<'EOF'
import json, sys
start = stop = None
status = "missing"
try:
    lines = open(sys.argv[1], encoding="utf-8").read().splitlines()
except OSError:
    lines = []
for line in lines:
    if line.startswith(":::MLLOG "):
        rec = json.loads(line[len(":::MLLOG "):])
        if rec["key"] == "run_start":
            start = rec["time_ms"]
        elif rec["key"] == "run_stop":
            stop, status = rec["time_ms"], (rec.get("metadata") or {}).get("status", "unknown")
print(f"{(stop - start) / 1000:.3f}" if start is not None and stop is not None else "nan", status)
EOF
)
if [[ "$seconds" == nan ]]; then
    echo "run_and_time.sh: $RUN_DIR/mlperf.log has no run_start/run_stop: no result" >&2
    exit $(( rc ? rc : 1 ))
fi
echo "RESULT,$RESULT_NAME,,$seconds,${ORG:-spatialcnn},$start_fmt"
echo "run_and_time.sh: status $status, time to train $seconds s (run_stop - run_start), log $RUN_DIR/mlperf.log"
if (( rc )); then exit "$rc"; fi
[[ "$status" == success ]] || exit 3
