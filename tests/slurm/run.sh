#!/usr/bin/env bash
# Slurm integration tests: brings up a local Slurm cluster (two emulated nodes on this host,
# scripts/slurm/local-cluster.sh), submits the batch scripts with `sbatch --wait`, checks exit
# codes, logs and results, and stops the cluster again on exit.
#
#   tests/slurm/run.sh [BUILD_DIR]       (default: build; needs root; called by scripts/test.sh)
#
# Scenarios:
#   train-1node   train.sbatch, -N1 -n4, configs/smoke.toml: exit 0, every rank prints the same
#                 final checksum, summary.json has test_accuracy > 0.1 (chance is 0.1)
#   train-2node   the same on -N2 --ntasks-per-node=2: tasks on qnode1 and qnode2, and the log
#                 shows a cross-node provider (provider=... never shm)
#   bench         bench.sbatch -N1 -n4: exit 0, rank 0 prints the table, --json is valid JSON
#   kill-rank     train.sbatch -N2 --ntasks-per-node=2 with a long run; the test SIGKILLs rank 2:
#                 the job exits non-zero, the log names task/rank 2, no task is left running
#   rejoin        the same with QRING_MAX_RESTARTS=1 and quorum 3: the killed rank is started
#                 again by scripts/slurm/retry.sh, rejoins through the batch step's qring-store,
#                 and the job exits 0 with all four ranks agreeing
#   requeue       train.sbatch -N2 --ntasks-per-node=2 with a 2-minute time limit on a run that
#                 needs longer (--signal=USR1@30; Slurm sends it 60-90 s after the start, its
#                 check runs every 30 s and may send it up to a minute early, so the 1-minute
#                 limit would be signalled at once): Slurm signals the ranks, they checkpoint
#                 the same step and exit 76, the script requeues the job, the requeued job
#                 resumes (maybe more than once), ends COMPLETED, and every rank's final
#                 checksum equals that of the same steps never interrupted (qring-launch)
#   torch         torch.sbatch -N2 --ntasks-per-node=2 with python/examples/fmnist_cnn.py (a few
#                 steps, quorum 3): exit 0, the 4 ranks print the same parameter checksum,
#                 rank 0 a test accuracy (needs PyTorch; without it the scenario is skipped)
# Every wait is bounded (QRING_SLURM_TEST_TIMEOUT seconds per job, default 300). The last line
# is "N passed, M failed"; the exit code is non-zero when anything failed.
#
# Environment: QRING_SLURM_TEST_DIR (cluster state, default /tmp/qring-slurm-test; separate
# from the interactive cluster's), QRING_SLURM_TEST_PORT (default 17817), QRING_SLURM_KEEP=1
# (leave the cluster running), QRING_SLURM_AGREE_PATTERN (the per-rank agreement line; an
# extended regex whose first group is the value, default 'checksum[=: ]+([0-9A-Za-z]+)'),
# QRING_SLURM_TEST_CONFIG (default configs/smoke.toml), QRING_SLURM_ONLY="bench kill-rank"
# (run only these scenarios), QRING_SKIP_SLURM=1 (skip, saying so).
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BUILD=${1:-${QRING_BUILD:-build}}
case $BUILD in /*) ;; *) BUILD="$ROOT/$BUILD" ;; esac
export QRING_BUILD=$BUILD
JOB_TIMEOUT=${QRING_SLURM_TEST_TIMEOUT:-300}
AGREE=${QRING_SLURM_AGREE_PATTERN:-'checksum[=: ]+([0-9A-Za-z]+)'}
export QRING_SLURM_DIR=${QRING_SLURM_TEST_DIR:-/tmp/qring-slurm-test}
export QRING_SLURM_PORT=${QRING_SLURM_TEST_PORT:-17817}
export SLURM_CONF=$QRING_SLURM_DIR/etc/slurm.conf
CLUSTER="$ROOT/scripts/slurm/local-cluster.sh"
TRAIN="$ROOT/scripts/slurm/train.sbatch"
BENCH="$ROOT/scripts/slurm/bench.sbatch"
CONFIG=${QRING_SLURM_TEST_CONFIG:-$ROOT/configs/smoke.toml}

passed=0
failed=0
SCENARIOS=(train-1node train-2node bench kill-rank rejoin requeue torch)
JOBS=()

pass() {
  echo "PASS: $1"
  passed=$((passed + 1))
}
fail() {
  echo "FAIL: $1: $2"
  failed=$((failed + 1))
}
finish() {
  echo "$passed passed, $failed failed"
  [ "$failed" -eq 0 ]
}

if [ "${QRING_SKIP_SLURM:-0}" = 1 ]; then
  echo "slurm tests skipped (QRING_SKIP_SLURM=1)"
  echo "0 passed, 0 failed"
  exit 0
fi

# Scenarios to run: all, or those named in QRING_SLURM_ONLY.
if [ -n "${QRING_SLURM_ONLY:-}" ]; then
  read -r -a only <<<"$QRING_SLURM_ONLY"
  for s in "${only[@]}"; do
    [[ " ${SCENARIOS[*]} " == *" $s "* ]] || { echo "error: unknown scenario '$s'" >&2; exit 2; }
  done
  SCENARIOS=("${only[@]}")
fi
wants() { [[ " ${SCENARIOS[*]} " == *" $1 "* ]]; }

# Preconditions: without them the scenarios cannot run; each is reported as failed.
missing=""
[ "$(id -u)" -eq 0 ] || missing="must run as root (slurmd starts jobs as their submitter)"
need_train=0
for s in train-1node train-2node kill-rank rejoin requeue; do wants "$s" && need_train=1; done
if [ $need_train = 1 ]; then
  [ -x "$BUILD/train/qring-train" ] ||
    missing="${missing:+$missing; }$BUILD/train/qring-train not built (scripts/build.sh $BUILD)"
  [ -f "$CONFIG" ] || missing="${missing:+$missing; }$CONFIG missing"
fi
if wants bench && [ ! -x "$BUILD/collectives/qring-bench" ]; then
  missing="${missing:+$missing; }$BUILD/collectives/qring-bench not built (scripts/build.sh $BUILD)"
fi
if [ -n "$missing" ]; then
  echo "error: $missing" >&2
  for s in "${SCENARIOS[@]}"; do fail "$s" "not run (error above)"; done
  finish
  exit 1
fi

# One test run at a time per cluster directory: a second run would stop the first one's cluster.
exec 9>"$QRING_SLURM_DIR.tests.lock"
if ! flock -n 9; then
  echo "== waiting for another Slurm test run on $QRING_SLURM_DIR to finish (at most 30 min)"
  if ! flock -w 1800 9; then
    for s in "${SCENARIOS[@]}"; do fail "$s" "another test run held the cluster for 30 min"; done
    finish
    exit 1
  fi
fi

WORK=$(mktemp -d /tmp/qring-slurm-tests.XXXXXX)
mkdir -p "$WORK/logs"

cleanup() {
  local rc=$?
  local j
  for j in "${JOBS[@]}"; do scancel "$j" 2>/dev/null || true; done
  if [ "${QRING_SLURM_KEEP:-0}" = 1 ]; then
    echo "cluster left running: export SLURM_CONF=$SLURM_CONF"
  else
    "$CLUSTER" stop >/dev/null || echo "warning: stopping the local cluster failed" >&2
  fi
  if [ "$failed" -eq 0 ] && [ $rc -eq 0 ]; then
    rm -rf "$WORK"
  else
    echo "logs kept in $WORK/logs"
  fi
}
trap cleanup EXIT

echo "== starting the local Slurm cluster (2 emulated nodes)"
if ! "$CLUSTER" start --nodes 2 9>&-; then
  for s in "${SCENARIOS[@]}"; do fail "$s" "local cluster did not start"; done
  finish
  exit 1
fi
cd "$WORK"

# submit NAME [sbatch args...]: runs `sbatch --wait` bounded by JOB_TIMEOUT; sets JOBID, RC and
# LOG. On timeout the job is cancelled and RC is 124.
submit() {
  local name=$1
  shift
  RC=0
  timeout "$JOB_TIMEOUT" sbatch --wait --job-name="$name" --time=10 \
    --output="$WORK/logs/%x-%j.out" "$@" >"$WORK/$name.sbatch" 2>&1 || RC=$?
  JOBID=$(sed -n 's/^Submitted batch job \([0-9]*\).*/\1/p' "$WORK/$name.sbatch")
  [ -n "$JOBID" ] && JOBS+=("$JOBID")
  LOG="$WORK/logs/$name-$JOBID.out"
  if [ "$RC" -eq 124 ] && [ -n "$JOBID" ]; then
    scancel "$JOBID" 2>/dev/null || true
  fi
  [ -n "$JOBID" ] || cat "$WORK/$name.sbatch" >&2
}

# PIDs of processes started by Slurm job $1 of this cluster, found by their environment (so
# children that escaped the job's process tracking count too).
job_pids() {
  local f
  while read -r f; do
    grep -qzx "SLURM_CONF=$SLURM_CONF" "$f" 2>/dev/null || continue
    f=${f#/proc/}
    echo "${f%/environ}"
  done < <(grep -lzx "SLURM_JOB_ID=$1" /proc/[0-9]*/environ 2>/dev/null || true)
  return 0
}

# The PID of rank $2's qring-train in job $1, if running.
rank_pid() {
  local p
  for p in $(job_pids "$1"); do
    [ "$(cat "/proc/$p/comm" 2>/dev/null)" = qring-train ] || continue
    grep -qzx "SLURM_PROCID=$2" "/proc/$p/environ" 2>/dev/null && echo "$p"
  done
  return 0
}

# Waits up to $2 seconds until job $1 has no process left and is no longer running in Slurm.
job_gone() {
  local job=$1 deadline=$((SECONDS + $2)) state
  while ((SECONDS < deadline)); do
    state=$(squeue -h -j "$job" -t R,CG,PD -o '%T' 2>/dev/null || true)
    [ -z "$state" ] && [ -z "$(job_pids "$job")" ] && return 0
    sleep 0.5
  done
  return 1
}

# Checks that ranks 0..$2-1 each printed an agreement line and that the last values agree.
check_agreement() {
  local log=$1 world=$2
  python3 - "$log" "$world" "$AGREE" <<'EOF'
import re, sys
log, world, pattern = sys.argv[1], int(sys.argv[2]), re.compile(sys.argv[3])
last = {}
for line in open(log, errors="replace"):
    m = re.match(r"\s*(\d+): (.*)", line)   # srun --label prefix: "<task>: "
    if not m:
        continue
    v = pattern.search(m.group(2))
    if v:
        last[int(m.group(1))] = v.group(1)
missing = [r for r in range(world) if r not in last]
if missing:
    sys.exit(f"ranks {missing} printed no line matching /{pattern.pattern}/")
if len(set(last.values())) != 1:
    sys.exit(f"ranks disagree: {last}")
EOF
}

# Prints test_accuracy from summary.json $1 and fails unless it is a number above 0.1.
check_accuracy() {
  python3 - "$1" <<'EOF'
import json, sys
try:
    s = json.load(open(sys.argv[1]))
except (OSError, ValueError) as e:
    sys.exit(f"cannot read {sys.argv[1]}: {e}")
acc = s.get("test_accuracy")
if not isinstance(acc, (int, float)) or acc <= 0.1:
    sys.exit(f"test_accuracy {acc!r} in {sys.argv[1]} is not above chance (0.1)")
print(acc)
EOF
}

# train_scenario NAME WORLD [sbatch args...] [-- overrides...]: a smoke training job that must
# succeed.
train_scenario() {
  local name=$1 world=$2 why acc
  shift 2
  local sb=() ov=()
  while [ $# -gt 0 ] && [ "$1" != -- ]; do
    sb+=("$1")
    shift
  done
  [ $# -gt 0 ] && shift
  ov=("$@")
  submit "$name" "${sb[@]}" "$TRAIN" "$CONFIG" "run.name=$name" "${ov[@]}"
  if [ "$RC" -eq 124 ]; then
    fail "$name" "not finished after ${JOB_TIMEOUT}s; job cancelled (log $LOG)"
    return 1
  elif [ "$RC" -ne 0 ]; then
    fail "$name" "sbatch --wait exit code $RC (log $LOG)"
    tail -n 30 "$LOG" 2>/dev/null | sed 's/^/    /'
    return 1
  fi
  if ! grep -q test_accuracy "$LOG"; then
    fail "$name" "no test_accuracy line in $LOG"
    return 1
  fi
  if ! why=$(check_agreement "$LOG" "$world" 2>&1); then
    fail "$name" "rank agreement: $why"
    return 1
  fi
  if ! acc=$(check_accuracy "$WORK/runs/$name/summary.json" 2>&1); then
    fail "$name" "$acc"
    return 1
  fi
  echo "    $name: test_accuracy $acc, $world ranks agree"
  return 0
}

scenario_train-1node() {
  echo "== train-1node: -N1 -n4"
  if train_scenario train-1node 4 -N 1 -n 4; then pass train-1node; fi
}

scenario_train-2node() {
  echo "== train-2node: -N2 --ntasks-per-node=2"
  # The emulated nodes normally have hostnames of their own (UTS namespaces), so provider=auto
  # must pick a cross-node provider by itself. Where they share one hostname, auto may rightly
  # see a single host: then the tcp provider is requested explicitly.
  local extra=() hosts
  hosts=$(timeout 60 srun -N 2 --ntasks-per-node=1 hostname 2>/dev/null | sort -u | wc -l || true)
  if [ "$hosts" != 2 ]; then
    echo "    the emulated nodes share a hostname; requesting net.provider=tcp"
    extra=(net.provider=tcp)
  fi
  if train_scenario train-2node 4 -N 2 --ntasks-per-node=2 -- "${extra[@]}"; then
    if ! grep -q 'on qnode\[1-2\]: 2 node(s), 4 task(s)' "$LOG"; then
      fail train-2node "job did not run on qnode[1-2] with 4 tasks (log $LOG)"
    elif ! grep -Eiq 'provider[=: ]+' "$LOG"; then
      fail train-2node "log does not say which provider was used (log $LOG)"
    elif grep -Ei 'provider[=: ]+' "$LOG" | grep -qi shm; then
      fail train-2node "shm provider chosen on a 2-node allocation (log $LOG)"
    else
      pass train-2node
    fi
  fi
}

scenario_bench() {
  echo "== bench: -N1 -n4"
  submit bench -N 1 -n 4 "$BENCH" --op allreduce -b 8 -e 32K -f 4 --json "$WORK/bench.json"
  if [ "$RC" -eq 124 ]; then
    fail bench "not finished after ${JOB_TIMEOUT}s; job cancelled (log $LOG)"
  elif [ "$RC" -ne 0 ]; then
    fail bench "sbatch --wait exit code $RC (log $LOG)"
    tail -n 30 "$LOG" 2>/dev/null | sed 's/^/    /'
  elif ! grep -q 'algbw' "$LOG" || ! grep -q 'busbw' "$LOG"; then
    fail bench "no table header (algbw, busbw) in $LOG"
  elif ! grep -Eq '^0: +8 ' "$LOG" || ! grep -Eq '^0: +32768 ' "$LOG"; then
    fail bench "table rows for 8 and 32768 bytes missing in $LOG"
  elif ! python3 -c 'import json,sys; json.load(open(sys.argv[1]))' "$WORK/bench.json" 2>/dev/null
  then
    fail bench "--json $WORK/bench.json missing or not JSON"
  else
    pass bench
  fi
}

# victim_of NAME WAITER SETTLE: for the job `sbatch --wait` (pid WAITER) submitted into
# $WORK/NAME.sbatch, waits up to 60 s until its 4 ranks run, then SETTLE seconds more (into
# training); sets JOBID, LOG and VICTIM (rank 2's qring-train pid, empty if they never ran).
victim_of() {
  local name=$1 waiter=$2 settle=$3 running r deadline
  JOBID="" VICTIM=""
  deadline=$((SECONDS + 60))
  while ((SECONDS < deadline)); do
    # The background sbatch may not have opened its output yet: sed then fails, and under
    # set -e a failing right side of || would end the whole run (it did once, exit 2).
    [ -n "$JOBID" ] || JOBID=$(sed -n 's/^Submitted batch job \([0-9]*\).*/\1/p' \
      "$WORK/$name.sbatch" 2>/dev/null || true)
    if [ -n "$JOBID" ]; then
      running=0
      for r in 0 1 2 3; do [ -n "$(rank_pid "$JOBID" "$r")" ] && running=$((running + 1)); done
      if [ "$running" -eq 4 ]; then
        sleep "$settle"
        VICTIM=$(rank_pid "$JOBID" 2)
        break
      fi
    fi
    kill -0 "$waiter" 2>/dev/null || break
    sleep 0.3
  done
  [ -n "$JOBID" ] && JOBS+=("$JOBID")
  LOG="$WORK/logs/$name-$JOBID.out"
}

scenario_kill-rank() {
  echo "== kill-rank: SIGKILL rank 2 of a -N2 --ntasks-per-node=2 job"
  # A run long enough to be killed; the job's own time limit (10 min) and JOB_TIMEOUT bound it.
  timeout "$JOB_TIMEOUT" sbatch --wait --job-name=kill-rank --time=10 \
    --output="$WORK/logs/%x-%j.out" -N 2 --ntasks-per-node=2 "$TRAIN" "$CONFIG" \
    run.name=kill-rank train.steps=100000 >"$WORK/kill-rank.sbatch" 2>&1 &
  local waiter=$! victim
  victim_of kill-rank "$waiter" 2
  victim=$VICTIM
  if [ -z "$victim" ]; then
    [ -n "$JOBID" ] && scancel "$JOBID" 2>/dev/null
    wait "$waiter" || true
    fail kill-rank "the 4 ranks of job ${JOBID:-?} were not all running within 60 s (log $LOG)"
  else
    kill -KILL "$victim" 2>/dev/null || true
    RC=0
    wait "$waiter" || RC=$?
    if [ "$RC" -eq 0 ]; then
      fail kill-rank "job $JOBID exited 0 after rank 2 was killed (log $LOG)"
    elif [ "$RC" -eq 124 ]; then
      scancel "$JOBID" 2>/dev/null || true
      fail kill-rank "job $JOBID still running ${JOB_TIMEOUT}s after rank 2 was killed (log $LOG)"
    elif ! grep -Eiq '(task|rank) 2\b' "$LOG"; then
      fail kill-rank "no error naming task/rank 2 in $LOG"
    elif ! job_gone "$JOBID" 30; then
      fail kill-rank "processes of job $JOBID left running: $(job_pids "$JOBID" | tr '\n' ' ')"
    else
      echo "    kill-rank: job $JOBID exited $RC; $(grep -Eim1 '(task|rank) 2\b' "$LOG")"
      pass kill-rank
    fi
  fi
}

scenario_rejoin() {
  echo "== rejoin: SIGKILL rank 2 of a -N2 --ntasks-per-node=2 job with QRING_MAX_RESTARTS=1"
  QRING_MAX_RESTARTS=1 timeout "$JOB_TIMEOUT" sbatch --wait --job-name=rejoin --time=10 \
    --output="$WORK/logs/%x-%j.out" -N 2 --ntasks-per-node=2 "$TRAIN" "$CONFIG" \
    run.name=rejoin train.steps=6000 quorum.quorum=3 quorum.evict_ms=1000 \
    >"$WORK/rejoin.sbatch" 2>&1 &
  local waiter=$! victim
  victim_of rejoin "$waiter" 1
  victim=$VICTIM
  if [ -z "$victim" ]; then
    [ -n "$JOBID" ] && scancel "$JOBID" 2>/dev/null
    wait "$waiter" || true
    fail rejoin "the 4 ranks of job ${JOBID:-?} were not all running within 60 s (log $LOG)"
    return
  fi
  kill -KILL "$victim" 2>/dev/null || true
  RC=0
  wait "$waiter" || RC=$?
  local why
  if [ "$RC" -ne 0 ]; then
    fail rejoin "sbatch --wait exit code $RC after rank 2 was killed (log $LOG)"
    tail -n 30 "$LOG" 2>/dev/null | sed 's/^/    /'
  elif ! grep -q 'task 2 (rank 2) was killed by signal 9; restarting it' "$LOG"; then
    fail rejoin "no restart of task 2 in $LOG"
  elif ! grep -q 'rank 2 rejoined at step' "$LOG"; then
    fail rejoin "rank 2 did not rejoin (log $LOG)"
  elif ! why=$(check_agreement "$LOG" 4 2>&1); then
    fail rejoin "rank agreement: $why"
  elif ! job_gone "$JOBID" 30; then
    fail rejoin "processes of job $JOBID left running: $(job_pids "$JOBID" | tr '\n' ' ')"
  else
    echo "    rejoin: $(grep -m1 'rank 2 rejoined at step' "$LOG" | sed 's/^ *//')"
    pass rejoin
  fi
}

# Job $1's state and restart count, "STATE RESTARTS" (empty when Slurm does not know it).
job_state() {
  scontrol show job -o "$1" 2>/dev/null |
    sed -n 's/.*JobState=\([A-Z_]*\).* Restarts=\([0-9]*\).*/\1 \2/p' | head -n 1
}

scenario_requeue() {
  echo "== requeue: a 2-minute time limit on a longer run, -N2 --ntasks-per-node=2"
  local steps=900 want got state restarts deadline why
  # The reference: the same steps never interrupted, under qring-launch on this host. With
  # quorum = world the straggler delay of the Slurm run (100 ms per step, to make it outlast
  # its time limit) changes its timing, not its parameters.
  "$BUILD/net/qring-launch" -n 4 -- "$BUILD/train/qring-train" --config "$CONFIG" \
    run.name=requeue-ref "run.out_dir=$WORK/runs" log.progress=false train.steps=$steps \
    quorum.quorum=1.0 >"$WORK/requeue-ref.out" 2>&1 || true
  want=$(grep -o -E 'params_checksum [0-9a-f]+' "$WORK/requeue-ref.out" | sort -u | cut -d' ' -f2)
  if [ -z "$want" ] || [ "$(echo "$want" | wc -l)" -ne 1 ]; then
    fail requeue "the uninterrupted reference run failed: $(tail -3 "$WORK/requeue-ref.out")"
    return
  fi
  JOBID=$(sbatch --parsable --job-name=requeue --time=2 --signal=USR1@30 \
    --output="$WORK/logs/%x-%j.out" -N 2 --ntasks-per-node=2 "$TRAIN" "$CONFIG" \
    run.name=requeue train.steps=$steps quorum.quorum=1.0 straggler.model=fixed:0:100 \
    train.checkpoint_every=100 2>"$WORK/requeue.sbatch" | cut -d';' -f1 || true)
  if [ -z "$JOBID" ]; then
    fail requeue "sbatch failed: $(cat "$WORK/requeue.sbatch")"
    return
  fi
  JOBS+=("$JOBID")
  LOG="$WORK/logs/requeue-$JOBID.out"
  # Bounded: each run of the job is at most 2 minutes plus Slurm's kill wait, and Slurm holds a
  # requeued job back 10 s (cred_expire in scripts/slurm/local-cluster.sh) before it starts it
  # again.
  deadline=$((SECONDS + JOB_TIMEOUT + 300))
  state=""
  while ((SECONDS < deadline)); do
    read -r state restarts <<<"$(job_state "$JOBID")"
    case $state in COMPLETED | FAILED | TIMEOUT | CANCELLED | NODE_FAIL | OUT_OF_MEMORY) break ;; esac
    sleep 2
  done
  got=$(grep -E '^ *[0-9]+: .*params_checksum [0-9a-f]+' "$LOG" 2>/dev/null | tail -n 4 |
    grep -o -E 'params_checksum [0-9a-f]+' | sort -u | cut -d' ' -f2)
  if [ "$state" != COMPLETED ]; then
    scancel "$JOBID" 2>/dev/null || true
    fail requeue "job $JOBID ended ${state:-not at all within the limit} after ${restarts:-?} restart(s) (log $LOG)"
    tail -n 30 "$LOG" 2>/dev/null | sed 's/^/    /'
  elif [ "${restarts:-0}" -lt 1 ] || ! grep -q 'requeueing job' "$LOG"; then
    fail requeue "job $JOBID was never requeued (restarts ${restarts:-0}; log $LOG)"
  elif ! grep -Eq 'rank [0-9] stopped after step [0-9]+ params_checksum' "$LOG" ||
    ! grep -q 'resumed from step' "$LOG"; then
    fail requeue "no stop after a checkpoint or no resume in $LOG"
  elif ! why=$(check_agreement "$LOG" 4 2>&1); then
    fail requeue "rank agreement: $why"
  elif [ "$got" != "$want" ]; then
    fail requeue "final checksum '$got', the uninterrupted run's '$want' (log $LOG)"
  elif ! job_gone "$JOBID" 30; then
    fail requeue "processes of job $JOBID left running: $(job_pids "$JOBID" | tr '\n' ' ')"
  else
    echo "    requeue: job $JOBID restarted $restarts time(s); $(grep -m1 'stopped after step' "$LOG" | sed 's/^ *//'); final checksum $got as uninterrupted"
    pass requeue
  fi
}

scenario_torch() {
  echo "== torch: torch.sbatch -N2 --ntasks-per-node=2, the CNN example"
  if ! /usr/bin/python3 -c 'import torch' 2>/dev/null; then
    echo "    skipped: no PyTorch (QRING_SETUP_TORCH=1 scripts/setup.sh installs it)"
    return 0
  fi
  submit torch -N 2 --ntasks-per-node=2 "$ROOT/scripts/slurm/torch.sbatch" \
    python/examples/fmnist_cnn.py --steps 10 --quorum 3 --test-samples 1000
  local why
  if [ "$RC" -ne 0 ]; then
    fail torch "sbatch --wait exit code $RC (log $LOG)"
    tail -n 30 "$LOG" 2>/dev/null | sed 's/^/    /'
  elif ! grep -q '"test_accuracy"' "$LOG"; then
    fail torch "no test accuracy from rank 0 in $LOG"
  elif ! why=$(AGREE='params_checksum"?[=: ]+"?([0-9a-f]+)' check_agreement "$LOG" 4 2>&1); then
    fail torch "rank agreement: $why"
  else
    pass torch
  fi
}

for s in "${SCENARIOS[@]}"; do "scenario_$s"; done

# Nothing of any test job may survive.
for j in "${JOBS[@]}"; do
  if ! job_gone "$j" 10; then
    fail leftovers "processes of job $j still running: $(job_pids "$j" | tr '\n' ' ')"
  fi
done

finish
