#!/usr/bin/env bash
# One Slurm task of a qring job whose ranks may restart (QRING_MAX_RESTARTS > 0, set by
# qring_srun in common.sh): runs the rank, and when it fails (non-zero exit, or killed by a
# signal) runs it again, up to QRING_MAX_RESTARTS times. The new process rejoins the running
# job as a new incarnation of its rank (docs/design.md, "Rejoin"), through the store that the
# batch step serves (qring-store). Exits with the rank's last status.
#
#   srun ... scripts/slurm/retry.sh CMD [ARGS...]
set -u
max=${QRING_MAX_RESTARTS:-0}
[[ $max =~ ^[0-9]+$ ]] || {
  echo "qring-slurm: QRING_MAX_RESTARTS must be a non-negative integer, got '$max'" >&2
  exit 2
}
restart=0
while :; do
  export QRING_RESTART=$restart
  "$@"
  rc=$?
  [ $rc -eq 0 ] && exit 0
  if [ "$restart" -ge "$max" ]; then
    [ "$max" -gt 0 ] &&
      echo "qring-slurm: task ${SLURM_PROCID:-?} failed (status $rc) after $max restart(s)" >&2
    exit $rc
  fi
  restart=$((restart + 1))
  if [ $rc -gt 128 ]; then how="was killed by signal $((rc - 128))"; else how="exited with status $rc"; fi
  echo "qring-slurm: task ${SLURM_PROCID:-?} (rank ${SLURM_PROCID:-?}) $how; restarting it" \
    "(restart $restart of $max)" >&2
done
