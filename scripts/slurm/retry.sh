#!/usr/bin/env bash
# One Slurm task of a qring job whose ranks may restart (QRING_MAX_RESTARTS > 0, set by
# qring_srun in common.sh): runs the rank, and when it fails (non-zero exit, or killed by a
# signal) runs it again, up to QRING_MAX_RESTARTS times. The new process rejoins the running
# job as a new incarnation of its rank (docs/design.md, "Rejoin"), through the store that the
# batch step serves (qring-store). Exits with the rank's last status.
#
# Not retried, because running again cannot help: status 2 (a bad command line,
# configuration or data: the same error again), 76 (qring-train stopped after checkpointing,
# on SIGTERM/SIGUSR1: the job is being stopped or requeued), and any end after this task
# itself received SIGTERM or SIGUSR1 (Slurm is stopping the step; the signal reaches the rank
# directly, this script only waits for it).
#
#   srun ... scripts/slurm/retry.sh CMD [ARGS...]
set -u
max=${QRING_MAX_RESTARTS:-0}
[[ $max =~ ^[0-9]+$ ]] || {
  echo "qring-slurm: QRING_MAX_RESTARTS must be a non-negative integer, got '$max'" >&2
  exit 2
}
# Trapped (not ignored, so that the rank keeps the default disposition): bash runs a trap only
# once the foreground rank has ended, and Slurm signals every process of the step, the rank
# included.
stopping=""
trap 'stopping=TERM' TERM
trap 'stopping=USR1' USR1
restart=0
while :; do
  export QRING_RESTART=$restart
  "$@"
  rc=$?
  [ $rc -eq 0 ] && exit 0
  task="task ${SLURM_PROCID:-?} (rank ${SLURM_PROCID:-?})"
  if [ -n "$stopping" ]; then
    echo "qring-slurm: $task ended with status $rc after SIG$stopping; not restarting it" >&2
    exit $rc
  fi
  case $rc in
    2)
      echo "qring-slurm: $task failed with status 2 (bad command line, configuration or" \
        "data); not restarting it: it would fail the same way" >&2
      exit $rc
      ;;
    76)
      echo "qring-slurm: $task stopped after checkpointing (status 76); not restarting it" >&2
      exit $rc
      ;;
  esac
  if [ "$restart" -ge "$max" ]; then
    [ "$max" -gt 0 ] &&
      echo "qring-slurm: task ${SLURM_PROCID:-?} failed (status $rc) after $max restart(s)" >&2
    exit $rc
  fi
  restart=$((restart + 1))
  if [ $rc -gt 128 ]; then how="was killed by signal $((rc - 128))"; else how="exited with status $rc"; fi
  echo "qring-slurm: $task $how; restarting it (restart $restart of $max)" >&2
done
