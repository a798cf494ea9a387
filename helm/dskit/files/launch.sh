#!/bin/bash
# Entrypoint of every dskit pod: run the node's torchrun command and report how it ended in the exit
# codes the Job's podFailurePolicy acts on.
# Usage: launch.sh STOP_FILE COMPLETE_FILE EXIT_REQUEUE EXIT_BAD_INPUT EXIT_DISK_FULL -- COMMAND...
#
# - SIGTERM (preemption, eviction, node drain, `kubectl delete pod`) creates STOP_FILE on the shared
#   checkpoint dir instead of killing torchrun: every rank, on every pod, checkpoints at its next step
#   and exits EXIT_REQUEUE. (torchrun would forward SIGTERM and SIGKILL the ranks 30 s later.)
# - torchrun reports every worker failure as 1. Each rank writes its own exit code to
#   $DSKIT_EXIT_DIR/rank{RANK}, and this script exits with it: EXIT_REQUEUE (a requested stop or a hung
#   rank: restart, not counted as a failure), EXIT_BAD_INPUT (a configuration error) or EXIT_DISK_FULL
#   (a checkpoint found the disk full): fail the Job now rather than retry.
# Generated from templates/helm/launch.sh.j2 (make examples): the stop/reap logic is shared with
# Slurm's job.sbatch (templates/shell/stop.sh.j2).
set -uo pipefail
if [ "$#" -lt 7 ] || [ "$6" != "--" ]; then
  echo "usage: launch.sh STOP_FILE COMPLETE_FILE EXIT_REQUEUE EXIT_BAD_INPUT EXIT_DISK_FULL -- COMMAND..." >&2
  exit 2
fi
stop_file=$1 complete_file=$2 exit_requeue=$3 exit_bad_input=$4 exit_disk_full=$5
shift 6
: "${DSKIT_EXIT_DIR:?must name a pod-local directory}"

if [ -e "${complete_file}" ]; then
  echo "dskit: training already complete (${complete_file})"
  exit 0
fi
mkdir -p "$(dirname "${stop_file}")"
rm -rf "${DSKIT_EXIT_DIR}" && mkdir -p "${DSKIT_EXIT_DIR}"
rm -f "${stop_file}"  # a stop request left by an earlier attempt is stale
stop_requested=0
# shellcheck disable=SC2329  # invoked by the trap below
request_stop() {
  stop_requested=1
  echo "dskit: $1 received at $(date -u +%FT%TZ); asking ranks to checkpoint"
  touch "${stop_file}"
}
trap 'request_stop TERM' TERM

echo "dskit: pod ${HOSTNAME:-?} (index ${JOB_COMPLETION_INDEX:-?}) starting: $*"
"$@" &
pid=$!
status=0
# A trapped signal interrupts `wait` (status > 128) without reaping the child: wait until it has ended.
while kill -0 "${pid}" 2>/dev/null; do
  wait "${pid}" && status=0 || status=$?
done
if wait "${pid}" 2>/dev/null; then
  status=0
else
  s=$?
  [ "${s}" = 127 ] || status=${s}  # 127: reaped above, keep that status
fi

if [ -e "${complete_file}" ]; then
  echo "dskit: training complete"
  exit 0
fi
# The ranks' own exit codes, one file per rank (torchrun reports every failure as 1): bad input wins,
# then a full disk, then a requeue when every rank that wrote one asked for it (dskit/launch/contract.py).
verdict=
codes=" $(cat "${DSKIT_EXIT_DIR}"/rank* 2>/dev/null | sort -u | tr '\n' ' ' || true)"
case "${codes}" in
  *" ${exit_bad_input} "*) verdict=${exit_bad_input} ;;
  *" ${exit_disk_full} "*) verdict=${exit_disk_full} ;;
  " ${exit_requeue} ") verdict=${exit_requeue} ;;
esac
if [ "${verdict}" = "${exit_bad_input}" ]; then
  echo "dskit: configuration error (see above); exiting ${exit_bad_input} so the Job fails now"
  exit "${exit_bad_input}"
fi
if [ "${verdict}" = "${exit_disk_full}" ]; then
  echo "dskit: the checkpoint disk is full (see above); exiting ${exit_disk_full} so the Job fails now"
  exit "${exit_disk_full}"
fi
if [ "${verdict}" = "${exit_requeue}" ]; then
  echo "dskit: ranks checkpointed and stopped, or found a rank hung (see above); exiting ${exit_requeue} so the Job restarts this pod"
  exit "${exit_requeue}"
fi
if [ "${stop_requested}" = 1 ]; then
  echo "dskit: stopped on request (torchrun status ${status}); exiting ${exit_requeue}"
  exit "${exit_requeue}"
fi
echo "dskit: torchrun exited with status ${status}"
exit "${status}"
