#!/usr/bin/env bash
# Elastic training inside one Slurm allocation: one torchrun agent per node (srun
# --ntasks-per-node=1), c10d rendezvous on the first live node, --nnodes=MIN:MAX, so a
# node that dies is left behind by torchrun's own restart (docs/failures.md, "Elastic
# runs"). If the step itself ends with a failure (the rendezvous host died, or the
# restarts ran out), the nodes are probed, the dead ones are left out, and a new srun
# step starts on the rest, resuming from run.dir's last checkpoint; up to STEPS steps.
#
#   sbatch -N 4 -t 12:00:00 scripts/elastic_slurm.sh -m cosmoflow.train run.dir=runs/long data.dir=/data/cosmo
#   DRY_RUN=1 SLURM_JOB_NODELIST='gpu[01-04]' bash scripts/elastic_slurm.sh -m cosmoflow.train run.dir=runs/x
#
# Everything after the options is what torchrun runs (a module and its Hydra overrides);
# give run.dir explicitly (a dated default would make each step a new run). Environment:
#   MIN_NODES (default: half the allocation, at least 1), RANKS_PER_NODE (GPUs per node,
#   default SLURM_GPUS_ON_NODE or 1), MAX_RESTARTS (torchrun's, default 3), STEPS (srun
#   steps at most, default 3), RDZV_PORT (29400), PROBE_S (seconds a node may take to
#   answer the probe, 30), DRY_RUN=1 (print the srun commands, run nothing).
# Exit status: the last step's (0: the run finished), 2 for bad usage or too few nodes.
set -euo pipefail
usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$1"; }
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" || $# -eq 0 ]]; then usage "$0"; exit 0; fi

expand() {  # the host names of a Slurm node list (scontrol where present)
    if command -v scontrol > /dev/null && [[ -z "${DRY_RUN:-}" ]]; then scontrol show hostnames "$1"; return; fi
    python3 - "$1" <<'EOF'
import re, sys
out = []
for m in re.finditer(r"([^,\[]+)(?:\[([^\]]+)\])?", sys.argv[1]):
    prefix, ranges = m.group(1).lstrip(","), m.group(2)
    if not ranges:
        out.append(prefix)
        continue
    for part in ranges.split(","):
        lo, _, hi = part.partition("-")
        for i in range(int(lo), int(hi or lo) + 1):
            out.append(f"{prefix}{i:0{len(lo)}d}")
print("\n".join(out))
EOF
}

[[ -n "${SLURM_JOB_NODELIST:-}" ]] || { echo "elastic_slurm.sh: run it inside an allocation (sbatch/salloc)" >&2; exit 2; }
mapfile -t NODES < <(expand "$SLURM_JOB_NODELIST")
ALL=${#NODES[@]}
MIN_NODES=${MIN_NODES:-$(( ALL / 2 > 0 ? ALL / 2 : 1 ))}
RANKS_PER_NODE=${RANKS_PER_NODE:-${SLURM_GPUS_ON_NODE:-1}}
MAX_RESTARTS=${MAX_RESTARTS:-3}
STEPS=${STEPS:-3}
RDZV_PORT=${RDZV_PORT:-29400}
PROBE_S=${PROBE_S:-30}
EXTRA=()  # from the second step on: resume (an elastic restart inside a step does it by itself)

alive=("${NODES[@]}")
rc=1
for (( step = 1; step <= STEPS; step++ )); do
    if (( ${#alive[@]} < MIN_NODES )); then
        echo "elastic_slurm.sh: ${#alive[@]} live node(s) left (${alive[*]:-none}), MIN_NODES=$MIN_NODES: stopping" >&2
        exit 2
    fi
    head=${alive[0]}
    list=$(IFS=,; echo "${alive[*]}")
    cmd=(srun --nodes="${#alive[@]}" --ntasks-per-node=1 --nodelist="$list" --no-kill --kill-on-bad-exit=0
         torchrun --nnodes="$MIN_NODES:${#alive[@]}" --nproc-per-node="$RANKS_PER_NODE" --max-restarts="$MAX_RESTARTS"
         --rdzv-backend=c10d --rdzv-endpoint="$head:$RDZV_PORT" --rdzv-id="${SLURM_JOB_ID:-job}-$step" "$@" "${EXTRA[@]}")
    echo "elastic_slurm.sh: step $step on ${#alive[@]} node(s): ${cmd[*]}"
    if [[ -n "${DRY_RUN:-}" ]]; then exit 0; fi
    rc=0
    "${cmd[@]}" || rc=$?
    if (( rc == 0 )); then exit 0; fi
    if (( rc == 2 )); then exit 2; fi  # bad input or config: another step would fail alike
    # which nodes still answer: the others are left out of the next step
    next=()
    for node in "${alive[@]}"; do
        if timeout "$PROBE_S" srun --nodes=1 --ntasks=1 --nodelist="$node" --overlap true > /dev/null 2>&1; then
            next+=("$node")
        else
            echo "elastic_slurm.sh: node $node does not answer; left out" >&2
        fi
    done
    alive=("${next[@]}")
    EXTRA=(train.resume=true)
done
exit "$rc"
