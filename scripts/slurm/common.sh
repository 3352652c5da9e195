# shellcheck shell=bash
# Shared by train.sbatch, bench.sbatch and sweep.sbatch; sourced, not run. Each sbatch
# script finds the repository first (Slurm runs a copy of the script from its spool
# directory), then sources this file.

qring_die() {
  echo "qring-slurm: error: $*" >&2
  exit 2
}

# Sets QRING_BUILD (default <repo>/build) and OMP_NUM_THREADS (default: the CPUs Slurm gives
# each task, else 1), and prints what the job is about to run on.
qring_setup() {
  [ -n "${SLURM_JOB_ID:-}" ] ||
    qring_die "not inside a Slurm job; submit with: sbatch [options] $1 ARGS..."
  export QRING_BUILD=${QRING_BUILD:-$QRING_ROOT/build}
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-1}}
  # Since Slurm 22.05 srun does not inherit --cpus-per-task from the batch allocation.
  if [ -n "${SLURM_CPUS_PER_TASK:-}" ]; then
    export SRUN_CPUS_PER_TASK=${SRUN_CPUS_PER_TASK:-$SLURM_CPUS_PER_TASK}
  fi
  local rev
  rev=$(git -C "$QRING_ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)
  echo "qring-slurm: job ${SLURM_JOB_ID} (${SLURM_JOB_NAME:-?}) on ${SLURM_JOB_NODELIST:-?}:" \
    "${SLURM_JOB_NUM_NODES:-?} node(s), ${SLURM_NTASKS:-?} task(s); repo ${QRING_ROOT} @ ${rev};" \
    "build ${QRING_BUILD}; started $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  local v
  for v in QRING_PROVIDER QRING_STORE_PORT QRING_SRUN_ARGS QRING_TOLERATE_FAILURES QRING_MAX_RESTARTS \
    FI_PROVIDER \
    FI_LOG_LEVEL FI_TCP_IFACE; do
    [ -n "${!v:-}" ] && echo "qring-slurm: $v=${!v}"
  done
  # Several nodes: the other ranks reach the store on the first node by its Slurm name.
  if [ "${SLURM_JOB_NUM_NODES:-1}" -gt 1 ] && [ -z "${QRING_STORE:-}" ]; then
    local first
    first=$(scontrol show hostnames "${SLURM_JOB_NODELIST:-}" 2>/dev/null | head -n 1 || true)
    if [ -n "$first" ] && ! getent hosts "$first" >/dev/null; then
      echo "qring-slurm: warning: node name '$first' does not resolve on $(hostname); the" \
        "rendezvous will fail. Set QRING_STORE=<address of $first>:<port> (docs/cluster.md)" >&2
    fi
  fi
  return 0
}

# Fails with a clear message when the binary $1 is not built.
qring_require_bin() {
  [ -x "$1" ] && return 0
  qring_die "$1 not found or not executable; build it with scripts/build.sh (on a path every" \
    "node sees), or set QRING_BUILD to the build directory"
}

# Prints the config path: as given when it exists (relative to the job's working directory),
# else relative to the repository.
qring_resolve_config() {
  local cfg=$1
  if [ -f "$cfg" ]; then
    echo "$cfg"
  elif [ -f "$QRING_ROOT/$cfg" ]; then
    echo "$QRING_ROOT/$cfg"
  else
    qring_die "config '$cfg' not found (looked in $PWD and $QRING_ROOT)"
  fi
}

# Prints QRING_TOLERATE_FAILURES (unset or empty: 0); dies when it is not a non-negative
# integer.
qring_tolerated_failures() {
  local k=${QRING_TOLERATE_FAILURES:-0}
  [[ $k =~ ^[0-9]+$ ]] ||
    qring_die "QRING_TOLERATE_FAILURES must be a non-negative integer, got '$k'"
  echo $((10#$k))
}

# Prints a new random job secret: 32 bytes from the kernel's CSPRNG as 64 hex digits.
qring_new_secret() {
  local s
  s=$(od -An -N32 -tx1 /dev/urandom | tr -d ' \n') || return 1
  [ ${#s} -eq 64 ] || return 1
  echo "$s"
}

# Prints QRING_MAX_RESTARTS (unset or empty: 0); dies when it is not a non-negative integer.
qring_max_restarts() {
  local n=${QRING_MAX_RESTARTS:-0}
  [[ $n =~ ^[0-9]+$ ]] ||
    qring_die "QRING_MAX_RESTARTS must be a non-negative integer, got '$n'"
  echo $((10#$n))
}

# Restarts (QRING_MAX_RESTARTS > 0): serves the job's rendezvous store from the batch step
# (qring-store, on this node, the allocation's first) so that it outlives every rank, rank 0
# included, and exports QRING_STORE, QRING_STORE_HOSTED=1 and QRING_JOB_ID for the tasks.
# Sets QRING_STORE_PID. Needs QRING_JOB_SECRET exported.
qring_start_store() {
  local bin="$QRING_BUILD/net/qring-store" dir port host _
  qring_require_bin "$bin"
  host=${QRING_STORE_HOST:-$(hostname)}
  [ "${SLURM_JOB_NUM_NODES:-1}" -gt 1 ] || host=127.0.0.1
  dir=$(mktemp -d "${TMPDIR:-/tmp}/qring-store.XXXXXX")
  export QRING_JOB_ID=${QRING_JOB_ID:-slurm-${SLURM_JOB_ID}-$(od -An -N4 -tx1 /dev/urandom | tr -d ' \n')}
  "$bin" --world "${SLURM_NTASKS:?}" --job-id "$QRING_JOB_ID" --host "$host" \
    --port "${QRING_STORE_PORT:-0}" --port-file "$dir/port" &
  QRING_STORE_PID=$!
  for _ in $(seq 100); do
    [ -s "$dir/port" ] && break
    kill -0 "$QRING_STORE_PID" 2>/dev/null || qring_die "qring-store did not start (see above)"
    sleep 0.1
  done
  [ -s "$dir/port" ] || qring_die "qring-store did not report its port within 10 s"
  port=$(cat "$dir/port")
  rm -rf "$dir"
  export QRING_STORE="$host:$port" QRING_STORE_HOSTED=1
  echo "qring-slurm: QRING_MAX_RESTARTS=$QRING_MAX_RESTARTS: the store runs in the batch step" \
    "($QRING_STORE, pid $QRING_STORE_PID); a failed task is started again and rejoins"
}

# Starts one process per task. If any task fails, Slurm kills the others
# (--kill-on-bad-exit=1) and srun reports which task failed -- unless the job tolerates lost
# ranks (QRING_TOLERATE_FAILURES > 0, e.g. a quorum below the world size): then a failed task
# does not end the step (--kill-on-bad-exit=0 --no-kill) and the others run on; srun still
# exits non-zero when any task failed. Output lines carry the task number (--label). Extra
# srun options come from QRING_SRUN_ARGS (e.g. "--cpu-bind=cores"). Every step gets a fresh
# random QRING_JOB_SECRET (or the one already set), which srun hands to its tasks in their
# environment (not on the command line): the ranks prove it to the rendezvous store, so
# nobody else who can reach the store's port can join the job. With QRING_MAX_RESTARTS=N > 0
# the batch step serves the store (qring_start_store) and each task runs under
# scripts/slurm/retry.sh, which starts a failed rank again up to N times; it rejoins the
# running job. Returns srun's exit code.
qring_srun() {
  local rc=0 tolerate restarts
  local -a extra=() kill_opts=(--kill-on-bad-exit=1) wrap=()
  tolerate=$(qring_tolerated_failures) || exit 2
  restarts=$(qring_max_restarts) || exit 2
  if [ "$tolerate" -gt 0 ]; then
    kill_opts=(--kill-on-bad-exit=0 --no-kill)
    export QRING_TOLERATE_FAILURES=$tolerate # the ranks see it too
    echo "qring-slurm: QRING_TOLERATE_FAILURES=$tolerate: a failed task does not stop the others"
  fi
  # shellcheck disable=SC2206 # QRING_SRUN_ARGS is a list of options, split on spaces
  [ -n "${QRING_SRUN_ARGS:-}" ] && extra=(${QRING_SRUN_ARGS})
  local secret=${QRING_JOB_SECRET:-}
  if [ -z "$secret" ]; then
    secret=$(qring_new_secret) || qring_die "cannot read /dev/urandom for the job secret"
  fi
  export QRING_JOB_SECRET=$secret
  QRING_STORE_PID=""
  if [ "$restarts" -gt 0 ]; then
    export QRING_MAX_RESTARTS=$restarts
    qring_start_store
    wrap=("$QRING_ROOT/scripts/slurm/retry.sh")
  fi
  echo "qring-slurm: srun ${kill_opts[*]} --label ${extra[*]}${extra[*]:+ }${wrap[*]}${wrap[*]:+ }$*"
  srun "${kill_opts[@]}" --label "${extra[@]}" "${wrap[@]}" "$@" || rc=$?
  if [ -n "$QRING_STORE_PID" ]; then
    kill "$QRING_STORE_PID" 2>/dev/null || true
    wait "$QRING_STORE_PID" 2>/dev/null || true
  fi
  if [ $rc -eq 0 ]; then
    echo "qring-slurm: job ${SLURM_JOB_ID} step finished, exit code 0"
  elif [ "$tolerate" -gt 0 ]; then
    echo "qring-slurm: job ${SLURM_JOB_ID} step ended with exit code $rc: at least one task" \
      "failed or was evicted, the others were not stopped (up to $tolerate lost ranks" \
      "tolerated); the 'srun: error:' lines above name the tasks = ranks" >&2
  else
    echo "qring-slurm: job ${SLURM_JOB_ID} step FAILED, exit code $rc (the 'srun: error:' lines" \
      "above name the failing task = rank)" >&2
  fi
  return $rc
}

# Runs qring-train (binary $1, config $2, overrides after) as the job's step, so that it
# survives time limits and preemption (train.sbatch, sweep.sbatch; docs/cluster.md, "Time
# limits, preemption and requeue"): sync mode checkpoints every QRING_CHECKPOINT_EVERY steps
# (default 500) unless the configuration sets train.checkpoint_every; a job that Slurm
# restarted (SLURM_RESTART_COUNT > 0; or QRING_RESUME=1) resumes with --resume; when the ranks
# stop after checkpointing on the SIGUSR1 of sbatch --signal (the time limit is near) the job
# requeues itself (scontrol requeue) unless QRING_REQUEUE=0. Exits the batch script.
qring_train() {
  local bin=$1 config=$2 resolved mode every name run_dir started signal rc=0
  shift 2
  local -a args=("$@") flags=()
  # The resolved configuration (qring-train --print-config): sync mode checkpoints by default.
  resolved=$("$bin" --config "$config" "${args[@]}" --print-config) ||
    qring_die "qring-train rejected the configuration (above)"
  mode=$(sed -n 's/^mode = "\(.*\)"$/\1/p' <<<"$resolved")
  every=$(sed -n 's/^checkpoint_every = //p' <<<"$resolved")
  if [ "$mode" = sync ] && [ "$every" = 0 ]; then
    every=${QRING_CHECKPOINT_EVERY:-500}
    [[ $every =~ ^[0-9]+$ ]] ||
      qring_die "QRING_CHECKPOINT_EVERY must be a non-negative integer, got '$every'"
    args+=("train.checkpoint_every=$every")
  fi
  if [ "${SLURM_RESTART_COUNT:-0}" -gt 0 ] || [ "${QRING_RESUME:-0}" = 1 ]; then
    [ "$mode" = sync ] || qring_die "train.mode = \"$mode\" has no checkpoints to resume from"
    flags+=(--resume)
    echo "qring-slurm: restart ${SLURM_RESTART_COUNT:-0} of job ${SLURM_JOB_ID}: resuming from" \
      "the newest checkpoint every rank has"
  fi

  # Whether the ranks stopped after checkpointing, and on which signal: rank 0's summary.json of
  # this run says so (srun's own status does not: with --kill-on-bad-exit, Slurm kills the ranks
  # still exiting once the first exits 76). Only SIGUSR1 -- the --signal ahead of the time limit
  # -- requeues: a SIGTERM comes from scancel, from srun stopping the step after a task failed,
  # or from a preemption that Slurm requeues itself.
  name=$(sed -n 's/^name = "\(.*\)"$/\1/p' <<<"$resolved")
  run_dir="$(sed -n 's/^out_dir = "\(.*\)"$/\1/p' <<<"$resolved")/$name"
  started=$(mktemp "${TMPDIR:-/tmp}/qring-train-start.XXXXXX")
  qring_srun "$bin" --config "$config" "${flags[@]}" "${args[@]}" || rc=$?
  signal=""
  if [ $rc -ne 0 ] && [ "$run_dir/summary.json" -nt "$started" ] &&
    grep -q '"preempted": true' "$run_dir/summary.json"; then
    signal=$(sed -n 's/.*"stop_signal": "\([A-Z0-9]*\)".*/\1/p' "$run_dir/summary.json")
    signal=${signal:-a signal}
  fi
  rm -f "$started"
  if [ -n "$signal" ]; then
    if [ "$signal" = SIGUSR1 ] && [ "${QRING_REQUEUE:-1}" = 1 ]; then
      echo "qring-slurm: the ranks stopped after checkpointing on SIGUSR1 (the time limit is" \
        "near); requeueing job ${SLURM_JOB_ID}: it resumes where it stopped"
      scontrol requeue "$SLURM_JOB_ID" ||
        qring_die "scontrol requeue $SLURM_JOB_ID failed; resubmit with QRING_RESUME=1 and" \
          "run.name=$name"
      exit 0
    fi
    echo "qring-slurm: the ranks stopped after checkpointing on $signal (srun status $rc); not" \
      "requeueing (only SIGUSR1 requeues, unless QRING_REQUEUE=0); go on with QRING_RESUME=1" \
      "and run.name=$name"
  fi
  exit $rc
}
