#!/usr/bin/env bash
# Launch a training run on this node with mpirun or torchrun; Hydra overrides pass through.
#
#   scripts/launch.sh [options] [--] [HYDRA_OVERRIDE ...]
#
#   -l, --launcher L   mpirun | torchrun | python (1 process)      [env LAUNCHER, mpirun]
#   -n, --nproc N      ranks on this node                          [env NPROC, 2]
#   -s, --spatial S    split of each sample, 2,1,1 or [2,1,1]      [env SPATIAL, N,1,1]
#   -m, --model M      cosmoflow | unet3d                          [env MODEL, cosmoflow]
#   -c, --config NAME  Hydra config in configs/<model>/            [env CONFIG_NAME, quickstart]
#   -t, --threads T    OpenMP threads per rank                     [env OMP_NUM_THREADS, cores / N]
#       --cpus LIST    run on these CPUs only (taskset list, e.g. 0-3) [env CPUS]
#       --timeout S    stop the run after S seconds (0: never)     [env TIMEOUT, 0]
#       --no-bind      do not bind ranks to cores                  [env BIND=0]
#       --dry-run      print the command, do not run it
#   -h, --help         this help
#
# Threads and binding: each rank gets T = cores / N threads (at least 1), so N ranks never
# oversubscribe the cores (a warning says so when N > cores). mpirun binds each rank to T
# cores of its own when N x T fits (MPICH: -bind-to core:T; Open MPI: --map-by slot:PE=T
# --bind-to core); --cpus confines the whole launch to a CPU list instead (concurrent
# launches on one node, as scripts/run.sub does for weak scaling). torchrun sets threads
# only. LOCAL_WORLD_SIZE=N is exported (node count in the MLPerf log, staging per node).
# Ranks are consecutive on the node, so the grid keeps every spatial group on it.
#
# Example: scripts/launch.sh -n 4 -s 2,1,1 -- data.dir=data/cosmo32 train.epochs=2
set -euo pipefail
usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }

LAUNCHER=${LAUNCHER:-mpirun}
NPROC=${NPROC:-2}
SPATIAL=${SPATIAL:-}
MODEL=${MODEL:-cosmoflow}
CONFIG_NAME=${CONFIG_NAME:-quickstart}
THREADS=${OMP_NUM_THREADS:-}
CPUS=${CPUS:-}
TIMEOUT=${TIMEOUT:-0}
BIND=${BIND:-1}
DRY=0
while [[ $# -gt 0 ]]; do
    case "$1" in
        -h|--help) usage; exit 0 ;;
        -l|--launcher) LAUNCHER=$2; shift 2 ;;
        -n|--nproc) NPROC=$2; shift 2 ;;
        -s|--spatial) SPATIAL=$2; shift 2 ;;
        -m|--model) MODEL=$2; shift 2 ;;
        -c|--config) CONFIG_NAME=$2; shift 2 ;;
        -t|--threads) THREADS=$2; shift 2 ;;
        --cpus) CPUS=$2; shift 2 ;;
        --timeout) TIMEOUT=$2; shift 2 ;;
        --no-bind) BIND=0; shift ;;
        --dry-run) DRY=1; shift ;;
        --) shift; break ;;
        -*) echo "launch.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
        *) break ;;
    esac
done
case "$MODEL" in cosmoflow|unet3d) ;; *) echo "launch.sh: --model must be cosmoflow or unet3d, got '$MODEL'" >&2; exit 2 ;; esac
[[ "$NPROC" =~ ^[1-9][0-9]*$ ]] || { echo "launch.sh: --nproc must be a positive integer, got '$NPROC'" >&2; exit 2; }
SPATIAL=${SPATIAL:-$NPROC,1,1}
SPATIAL=${SPATIAL//[\[\] ]/}
[[ "$SPATIAL" =~ ^[1-9][0-9]*,[1-9][0-9]*,[1-9][0-9]*$ ]] || { echo "launch.sh: --spatial wants three positive integers like 2,1,1, got '$SPATIAL'" >&2; exit 2; }
IFS=, read -r sd sh sw <<< "$SPATIAL"
if (( NPROC % (sd * sh * sw) )); then
    echo "launch.sh: $NPROC ranks are not a multiple of the spatial group $sd x $sh x $sw = $((sd * sh * sw))" >&2
    exit 2
fi

# Cores this launch may use: the --cpus list, else the CPUs this process may run on.
count_cpus() {
    local n=0 part a b
    IFS=, read -ra parts <<< "$1"
    for part in "${parts[@]}"; do
        if [[ "$part" == *-* ]]; then a=${part%-*}; b=${part#*-}; n=$((n + b - a + 1)); else n=$((n + 1)); fi
    done
    echo "$n"
}
if [[ -n "$CPUS" ]]; then CORES=$(count_cpus "$CPUS"); else CORES=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc); fi
THREADS=${THREADS:-$(( CORES / NPROC > 0 ? CORES / NPROC : 1 ))}
if (( NPROC > CORES )); then
    echo "launch.sh: warning: $NPROC ranks on $CORES cores oversubscribe them (1 thread each)" >&2
fi
export OMP_NUM_THREADS=$THREADS LOCAL_WORLD_SIZE=$NPROC

ARGS=(-m "$MODEL.train" --config-name "$CONFIG_NAME" "parallel.spatial=[$SPATIAL]" "$@")
BINDING=()
case "$LAUNCHER" in
    mpirun|mpiexec)
        if [[ "$BIND" == 1 && -z "$CPUS" ]] && (( NPROC * THREADS <= CORES )); then
            if "$LAUNCHER" --version 2>&1 | grep -q "Open MPI"; then
                BINDING=(--map-by "slot:PE=$THREADS" --bind-to core)
            else
                BINDING=(-bind-to "core:$THREADS")
            fi
        fi
        CMD=("$LAUNCHER" -n "$NPROC" "${BINDING[@]}" python "${ARGS[@]}") ;;
    torchrun)
        CMD=(torchrun --standalone --nproc-per-node "$NPROC" "${ARGS[@]}") ;;
    python)
        (( NPROC == 1 )) || { echo "launch.sh: --launcher python runs 1 process, not $NPROC" >&2; exit 2; }
        CMD=(python "${ARGS[@]}") ;;
    *) echo "launch.sh: --launcher must be mpirun, torchrun or python, got '$LAUNCHER'" >&2; exit 2 ;;
esac
if [[ -n "$CPUS" ]]; then CMD=(taskset -c "$CPUS" "${CMD[@]}"); fi
if [[ "$TIMEOUT" != 0 ]]; then CMD=(timeout "$TIMEOUT" "${CMD[@]}"); fi

echo "launch.sh: $NPROC ranks, spatial [$SPATIAL], $THREADS thread(s) per rank on $CORES core(s)${CPUS:+ (CPUs $CPUS)}${BINDING[*]:+, binding ${BINDING[*]}}"
echo "launch.sh: OMP_NUM_THREADS=$OMP_NUM_THREADS LOCAL_WORLD_SIZE=$LOCAL_WORLD_SIZE ${CMD[*]}"
if [[ "$DRY" == 1 ]]; then exit 0; fi
exec "${CMD[@]}"
