#!/usr/bin/env bash
# One task of an srun step (scripts/run_and_time.sh starts each rank through it): runs the
# command and records the task's end in STATUS_DIR/task_<rank> as
#
#   <end time, ns> <rank> <node> <exit status>
#
# so that the job names the task that failed first, with its own status: srun itself
# returns the status of the peers it then killed (143) or the largest one.
#
#   srun [srun flags] scripts/srun_task.sh STATUS_DIR CMD [ARGS ...]
#
# The command starts with SIGUSR1 ignored (a time-limit warning that arrives during
# start-up is not fatal; the training installs its handler, run.stop_signal), and the
# signals USR1 and TERM this wrapper receives are passed on to it. Exit status: the command's.
set -uo pipefail
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then
    awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0
fi
[[ $# -ge 2 ]] || { echo "srun_task.sh: usage: srun_task.sh STATUS_DIR CMD [ARGS ...]" >&2; exit 2; }
dir=$1
shift
mkdir -p "$dir"
( trap '' USR1; exec "$@" ) &
child=$!
trap 'kill -USR1 "$child" 2>/dev/null' USR1
trap 'kill -TERM "$child" 2>/dev/null' TERM
while :; do
    wait "$child"
    rc=$?
    # A trapped signal ends `wait` early (status > 128) while the command still runs.
    if (( rc > 128 )) && kill -0 "$child" 2>/dev/null; then continue; fi
    if (( rc > 128 )); then
        wait "$child" 2>/dev/null
        again=$?
        (( again != 127 )) && rc=$again
    fi
    break
done
rank=${SLURM_PROCID:-0}
printf '%s %s %s %s\n' "$(date +%s%N)" "$rank" "${SLURMD_NODENAME:-$(hostname)}" "$rc" > "$dir/task_$rank"
exit "$rc"
