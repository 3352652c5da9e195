#!/usr/bin/env bash
# Multi-host tests on emulated hosts: two network + UTS namespaces inside one outer namespace
# (scripts/netns-cluster.sh; nothing reaches the machine's real interfaces), links shaped with
# tbf. Every rank is started on its host with the QRING_* bootstrap variables (the path
# qring-launch and Slurm set up for real jobs), rank 0's store on host 1's address.
#
#   tests/netns/run.sh [BUILD_DIR]       (default: build; needs root; called by scripts/test.sh)
#
# Scenarios:
#   collectives  2 hosts x 2 ranks of test_coll_netns: the ranks see two host names, rank 0's
#                store listens on 10.213.0.1 (the address the ranks use), "auto" picks
#                tcp;ofi_rxm, each rank publishes its host's eth0 address, and all-reduce
#                (recursive doubling, halving-doubling, ring), broadcast and allgather are
#                bit-exact across the hosts
#   bench        qring-bench --op allreduce on 2 hosts x 2 ranks: exit 0, provider tcp, 0 wrong
#   train        configs/smoke.toml on 4 ranks of one host (qring-launch: shm) and on 2 hosts x
#                2 ranks (tcp): every rank ends with the same params_checksum, in both runs
#   attack       a 2 x 2 job (qring-bench barrier) whose rank-0 store is attacked from host 2
#                by an unauthenticated client holding and reopening 1000 connections
#                (scripts/store_attack.py; the same address as host 2's ranks): it starts
#                within QRING_NETNS_ATTACK_SLACK_S (default 3) s of the same job beside the
#                same attacker aimed at a port where nothing listens (the same CPU load), and
#                rank 0's log has at most 12 store lines (one per reason and 10 s)
# The job secret reaches the ranks through the environment, never their command lines.
#   launch       the same 2 x 2 job as a user starts it without Slurm: one qring-launch per host
#                (--nnodes 2 --node-rank I --master <host 1>:PORT, torchrun's shape), node 0's
#                launcher serving the store: exit 0 on both hosts, the checksum of one host
#   launch-rejoin  that job with --max-restarts 1 and quorum 3; rank 3 (host 2) is SIGKILLed
#                mid-run: host 2's launcher starts it again, it rejoins, both launchers exit 0
#                and all four ranks end with one checksum
#   launch-host-lost  that job with quorum 2; host 2 is killed mid-run (its launcher and
#                ranks, SIGKILL). Their store connections close, so node 0's launcher, which
#                serves the store, witnesses both deaths (docs/design.md, "Witnessed deaths"):
#                host 1's ranks evict ranks 2 and 3 ("died, witnessed" in metrics.jsonl),
#                although half of the view is gone, and train to the end (launcher exit 0,
#                summary.json names them, the survivors agree). No process is left. (Under
#                load the transport's "unreachable" may evict them first, one view each: the
#                evidence then.)
# Every run is bounded (QRING_NETNS_TEST_TIMEOUT seconds, default 120). The last line is
# "N passed, M failed"; the exit code is non-zero when anything failed, and then every
# scenario's logs stay in the work directory named on the line before. QRING_SKIP_NETNS=1
# skips, QRING_NETNS_ONLY="bench" runs only the named scenarios.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BUILD=${1:-${QRING_BUILD:-build}}
case $BUILD in /*) ;; *) BUILD="$ROOT/$BUILD" ;; esac
TIMEOUT=${QRING_NETNS_TEST_TIMEOUT:-120}
export QRING_NETNS_NAME=${QRING_NETNS_TEST_NAME:-qring-test}
CLUSTER="$ROOT/scripts/netns-cluster.sh"
WORK=$(mktemp -d /tmp/qring-netns-test.XXXXXX)
passed=0
failed=0
KEEP=0
SCENARIOS=(collectives bench train attack launch launch-rejoin launch-host-lost)

pass() {
  echo "PASS: $1"
  passed=$((passed + 1))
}
fail() {
  echo "FAIL: $1: $2"
  failed=$((failed + 1))
}
# When a scenario failed, the logs of all stay in $WORK (named on the line before the last).
finish() {
  if [ "$failed" -gt 0 ]; then
    KEEP=1
    echo "logs kept in $WORK"
  fi
  echo "$passed passed, $failed failed"
  [ "$failed" -eq 0 ]
}

if [ "${QRING_SKIP_NETNS:-0}" = 1 ]; then
  echo "netns tests skipped (QRING_SKIP_NETNS=1)"
  echo "0 passed, 0 failed"
  exit 0
fi
if [ -n "${QRING_NETNS_ONLY:-}" ]; then
  read -r -a SCENARIOS <<<"$QRING_NETNS_ONLY"
fi
wants() { [[ " ${SCENARIOS[*]} " == *" $1 "* ]]; }

cleanup() {
  "$CLUSTER" stop >/dev/null 2>&1 || true
  [ "$KEEP" = 1 ] || rm -rf "$WORK"
}
trap cleanup EXIT

"$CLUSTER" start 2

# Starts world = 2 x per_host ranks of CMD on hosts 1 and 2 (rank r on host r / per_host + 1),
# waits at most TIMEOUT s, and returns non-zero if any rank failed; output in $WORK/$1.<rank>.
# JOB_PORT: the store's port (default: a random one); JOB_STAGGER_S: ranks other than 0
# start that many seconds after rank 0 (whose process serves the store).
run_job() {
  local name=$1 per_host=$2
  shift 2
  local world=$((2 * per_host)) port r host pids=() pre=()
  port=${JOB_PORT:-$((20000 + RANDOM % 20000))}
  # Through the environment (inherited by nsenter, env and the rank), not argv: `ps` shows
  # every command line on the machine.
  local QRING_JOB_SECRET
  QRING_JOB_SECRET=$(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n')
  export QRING_JOB_SECRET
  for r in $(seq 0 $((world - 1))); do
    host=$((r / per_host + 1))
    pre=()
    [ "$r" -gt 0 ] && [ -n "${JOB_STAGGER_S:-}" ] && pre=(sh -c 'sleep "$0"; exec "$@"' "$JOB_STAGGER_S")
    "$CLUSTER" exec "$host" env QRING_RANK="$r" QRING_WORLD_SIZE="$world" \
      QRING_LOCAL_RANK=$((r % per_host)) QRING_LOCAL_SIZE="$per_host" \
      QRING_STORE="$("$CLUSTER" addr 1):$port" \
      QRING_JOB_ID="netns-$name-$$" QRING_NETNS_ADDR="$("$CLUSTER" addr "$host")" \
      OMP_NUM_THREADS=1 timeout "$TIMEOUT" "${pre[@]}" "$@" >"$WORK/$name.$r" 2>&1 &
    pids+=($!)
  done
  local rc=0
  for p in "${pids[@]}"; do wait "$p" || rc=1; done
  return $rc
}

if wants collectives; then
  if run_job collectives 2 "$BUILD/tests/test_coll_netns" --gtest_brief=1 \
    --gtest_filter='NetnsHosts.*' && ! grep -q "SKIPPED" "$WORK"/collectives.*; then
    pass "collectives: 2 hosts x 2 ranks, tcp, store and endpoints on the hosts' addresses"
  else
    fail collectives "$(grep -h -E 'Failure|Expected|Which|error' "$WORK"/collectives.* | head -20)"
  fi
fi

if wants bench; then
  if run_job bench 2 "$BUILD/collectives/qring-bench" --op allreduce -b 1K -e 4M -f 16 -n 5 -w 1 &&
    grep -q "tcp;ofi_rxm" "$WORK/bench.0" && ! grep -q "wrong elements" "$WORK/bench.0"; then
    pass "bench: qring-bench all-reduce across 2 hosts over tcp"
  else
    fail bench "$(tail -5 "$WORK/bench.0")"
  fi
fi

cfg="$ROOT/configs/smoke.toml"
one=""
# The reference: configs/smoke.toml on one host, four ranks (shm), under qring-launch on host 1.
if wants train || wants launch; then
  "$CLUSTER" exec 1 env OMP_NUM_THREADS=1 timeout "$TIMEOUT" "$BUILD/net/qring-launch" -n 4 -- \
    "$BUILD/train/qring-train" --config "$cfg" run.name=one-host "run.out_dir=$WORK/runs" \
    >"$WORK/train-one" 2>&1 || true
  one=$(grep -h -o -E 'params_checksum [0-9a-f]+' "$WORK/train-one" | sort -u || true)
fi

if wants train; then
  run_job train 2 "$BUILD/train/qring-train" --config "$cfg" run.name=two-hosts "run.out_dir=$WORK/runs" || true
  two=$(cat "$WORK"/train.* | grep -o -E 'params_checksum [0-9a-f]+' | sort -u || true)
  n_one=$(grep -c -E 'params_checksum [0-9a-f]+' "$WORK/train-one" || true)
  n_two=$(cat "$WORK"/train.* | grep -c -E 'params_checksum [0-9a-f]+' || true)
  if [ -n "$one" ] && [ "$one" = "$two" ] && [ "$(echo "$one" | wc -l)" -eq 1 ] &&
    [ "$n_one" -ge 4 ] && [ "$n_two" -ge 4 ] && grep -q "provider shm" "$WORK/train-one" &&
    grep -q "provider tcp;ofi_rxm" "$WORK/train.0"; then
    pass "train: 2 hosts x 2 ranks (tcp) end with the parameters of 1 host x 4 ranks (shm): $one"
  else
    fail train "one host: '${one:-none}' ($n_one ranks), two hosts: '${two:-none}' ($n_two ranks); $(tail -n 3 "$WORK/train-one" "$WORK/train.0")"
  fi
fi

if wants attack; then
  # The same job twice while host 2 runs the attacker: first aimed at a port of host 1 where
  # nothing listens (the same load on this machine's CPUs, and nothing for the store to
  # serve), then at rank 0's store. The other ranks start 1 s after rank 0, so that the
  # attacker holds its connections when they come.
  port=$((20000 + RANDOM % 20000))
  job=("$BUILD/collectives/qring-bench" --op barrier -n 1 -w 0)
  attack_job() {  # NAME TARGET_PORT JOB_PORT: the job's wall time in ms on stdout
    # In a session of its own, as another user's processes (or another machine) are: with
    # the kernel's autogroup scheduling, a process of the test's session would take its CPU
    # out of the job's share.
    setsid "$CLUSTER" exec 2 timeout 90 python3 "$ROOT/scripts/store_attack.py" \
      --host "$("$CLUSTER" addr 1)" --port "$2" --connections 1000 --seconds 60 \
      >"$WORK/attacker.$1" 2>&1 &
    local attacker=$! t0 rc=0
    sleep 1
    t0=$(date +%s%N)
    JOB_PORT=$3 JOB_STAGGER_S=1 run_job "$1" 2 "${job[@]}" || rc=$?
    echo $((($(date +%s%N) - t0) / 1000000))
    kill "$attacker" 2>/dev/null || true
    wait "$attacker" 2>/dev/null || true
    return $rc
  }
  decoy_ms=$(attack_job decoy $((port + 7)) "$port") && decoy_rc=0 || decoy_rc=$?
  attacked_ms=$(attack_job attacked $((port + 1)) $((port + 1))) && attacked_rc=0 || attacked_rc=$?
  store_lines=$(grep -c "store server" "$WORK/attacked.0" || true)
  challenged=$(grep -o -E 'challenged [0-9]+' "$WORK/attacker.attacked" | tail -1)
  slack_ms=$((${QRING_NETNS_ATTACK_SLACK_S:-3} * 1000))
  detail="job beside an attacker aimed elsewhere ${decoy_ms} ms, under attack ${attacked_ms} ms; attacker: ${challenged:-no CHALLENGE}; store log ${store_lines} lines"
  if [ "$decoy_rc" -eq 0 ] && [ "$attacked_rc" -eq 0 ] && [ -n "$challenged" ] &&
    [ "$attacked_ms" -le $((decoy_ms + slack_ms)) ] && [ "$store_lines" -le 12 ]; then
    pass "attack: $detail"
  else
    fail attack "$detail; $(tail -n 3 "$WORK"/attacked.* "$WORK/attacker.attacked")"
  fi
fi

# launch_job NAME [qring-launch flags...] -- CMD...: one qring-launch per host, 2 ranks each,
# --nnodes 2 --node-rank I --master <host 1's address>:PORT, the same QRING_JOB_SECRET; each
# bounded by TIMEOUT. Output in $WORK/NAME.h1 and .h2; sets LAUNCH_PIDS (the two background
# jobs).
launch_job() {
  local name=$1 port secret h flags=()
  shift
  while [ "$1" != -- ]; do
    flags+=("$1")
    shift
  done
  shift
  port=$((20000 + RANDOM % 20000))
  secret=$(head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n')
  LAUNCH_PIDS=()
  for h in 1 2; do
    "$CLUSTER" exec "$h" env QRING_JOB_SECRET="$secret" OMP_NUM_THREADS=1 timeout "$TIMEOUT" \
      "$BUILD/net/qring-launch" --nnodes 2 --node-rank $((h - 1)) \
      --master "$("$CLUSTER" addr 1):$port" -n 2 "${flags[@]}" -- "$@" >"$WORK/$name.h$h" 2>&1 &
    LAUNCH_PIDS+=($!)
  done
}

# Waits for both launchers of launch_job; sets RC1 and RC2.
wait_launchers() {
  RC1=0 RC2=0
  wait "${LAUNCH_PIDS[0]}" || RC1=$?
  wait "${LAUNCH_PIDS[1]}" || RC2=$?
}

# The pid of rank $2's qring-train on host $1 (empty if none).
rank_pid_on() {
  local p
  for p in $(ip netns pids "$QRING_NETNS_NAME-h$1" 2>/dev/null); do
    [ "$(cat "/proc/$p/comm" 2>/dev/null)" = qring-train ] || continue
    grep -qzx "QRING_RANK=$2" "/proc/$p/environ" 2>/dev/null && echo "$p"
  done
  return 0
}

# Waits up to 60 s until run $1's metrics.jsonl has $2 step lines.
wait_steps() {
  local deadline=$((SECONDS + 60)) n
  while ((SECONDS < deadline)); do
    n=$(grep -c '"type":"step"' "$WORK/runs/$1/metrics.jsonl" 2>/dev/null || true)
    [ "${n:-0}" -ge "$2" ] && return 0
    sleep 0.2
  done
  return 1
}

if wants launch; then
  launch_job launch -- "$BUILD/train/qring-train" --config "$cfg" run.name=launch \
    "run.out_dir=$WORK/runs" log.progress=false
  wait_launchers
  two=$(cat "$WORK"/launch.h* | grep -o -E 'params_checksum [0-9a-f]+' | sort -u || true)
  n_two=$(cat "$WORK"/launch.h* | grep -c -E 'params_checksum [0-9a-f]+' || true)
  if [ "$RC1" -eq 0 ] && [ "$RC2" -eq 0 ] && [ -n "$one" ] && [ "$one" = "$two" ] &&
    [ "$n_two" -ge 4 ] && grep -q "provider tcp;ofi_rxm" "$WORK/launch.h1" &&
    grep -q "4 ranks on qhost1 (2 ranks), qhost2 (2 ranks)" "$WORK/launch.h1"; then
    pass "launch: qring-launch --nnodes 2 on 2 hosts trains to the checksum of one host: $one"
  else
    fail launch "exit $RC1/$RC2, one host '${one:-none}', two hosts '${two:-none}' ($n_two ranks); $(tail -n 3 "$WORK/launch.h1" "$WORK/launch.h2")"
  fi
fi

if wants launch-rejoin; then
  launch_job rejoin --max-restarts 1 -- "$BUILD/train/qring-train" --config "$cfg" \
    run.name=rejoin "run.out_dir=$WORK/runs" log.progress=false train.steps=3000 \
    quorum.quorum=3 quorum.evict_ms=1000
  victim=""
  if wait_steps rejoin 50; then victim=$(rank_pid_on 2 3); fi
  [ -n "$victim" ] && kill -KILL "$victim"
  wait_launchers
  sums=$(cat "$WORK"/rejoin.h* | grep -o -E 'params_checksum [0-9a-f]+' | sort -u || true)
  n_sums=$(cat "$WORK"/rejoin.h* | grep -c -E 'params_checksum [0-9a-f]+' || true)
  if [ -n "$victim" ] && [ "$RC1" -eq 0 ] && [ "$RC2" -eq 0 ] &&
    grep -q "rank 3 (pid [0-9]*) was killed by signal 9 (SIGKILL); restarting it" "$WORK/rejoin.h2" &&
    grep -q "rank 3 rejoined at step" "$WORK/rejoin.h2" &&
    [ "$(echo "$sums" | wc -l)" -eq 1 ] && [ "$n_sums" -ge 4 ]; then
    pass "launch-rejoin: rank 3 killed on host 2, restarted by its launcher, rejoined; $sums"
  else
    fail launch-rejoin "victim '${victim:-none}', exit $RC1/$RC2, checksums '${sums:-none}' ($n_sums); $(tail -n 4 "$WORK/rejoin.h1" "$WORK/rejoin.h2")"
  fi
fi

if wants launch-host-lost; then
  launch_job hostlost -- "$BUILD/train/qring-train" --config "$cfg" run.name=hostlost \
    "run.out_dir=$WORK/runs" log.progress=false train.steps=4000 quorum.quorum=2 \
    quorum.evict_ms=1000
  killed=0
  if wait_steps hostlost 50; then
    for p in $(ip netns pids "$QRING_NETNS_NAME-h2" 2>/dev/null); do
      kill -KILL "$p" 2>/dev/null && killed=$((killed + 1))
    done
  fi
  t0=$SECONDS
  wait_launchers
  took=$((SECONDS - t0))
  lost=$(python3 -c 'import json,sys; print(sorted(json.load(open(sys.argv[1]))["evicted_ranks"]))' \
    "$WORK/runs/hostlost/summary.json" 2>/dev/null || true)
  sums=$(grep -o -E 'params_checksum [0-9a-f]+' "$WORK/hostlost.h1" | sort -u || true)
  n_sums=$(grep -c -E 'params_checksum [0-9a-f]+' "$WORK/hostlost.h1" || true)
  left=$(ip netns pids "$QRING_NETNS_NAME-h1" 2>/dev/null | wc -l)
  # Node 0's store saw the other host's ranks die (their store connections closed): a view that
  # says so, or, where the transport's "unreachable" evicted them first (a killed host's tcp
  # connections are refused at once), the survivors' look-up of the witness afterwards.
  w_views=$(grep -c 'died, witnessed' "$WORK/runs/hostlost/metrics.jsonl" 2>/dev/null || true)
  w_seen=$(grep -c 'rendezvous store witnessed the death of rank [23]' "$WORK/hostlost.h1" \
    2>/dev/null || true)
  witnessed=$((${w_views:-0} + ${w_seen:-0}))
  # The coordinator asks the store from the first transport error with a rank on, evict / 4
  # before "unreachable" evicts it; under load "unreachable" may still come first, one rank per
  # view (each view keeps a majority of the one before), and the job rightly goes on: both
  # departures "unreachable" count as the evidence then.
  unreach=$(grep -c -E 'left: rank [23] \(unreachable' "$WORK/hostlost.h1" 2>/dev/null || true)
  [ "${witnessed:-0}" -ge 1 ] || [ "${unreach:-0}" -lt 2 ] || witnessed=unreachable
  if [ "$killed" -gt 0 ] && [ "$RC1" -eq 0 ] && [ "$lost" = "[2, 3]" ] &&
    [ "$(echo "$sums" | wc -l)" -eq 1 ] && [ "$n_sums" -ge 2 ] && [ "$left" -eq 0 ] &&
    { [ "$witnessed" = unreachable ] || [ "${witnessed:-0}" -ge 1 ]; }; then
    pass "launch-host-lost: host 2 killed mid-run; host 1's ranks evicted ranks 2 and 3 (witness: $witnessed) and finished ($took s): $sums"
  else
    fail launch-host-lost "killed $killed processes; host 1 exit $RC1 after $took s, lost '${lost:-?}', witnessed views ${witnessed:-0}, checksums '${sums:-none}' ($n_sums), $left processes left; $(tail -n 4 "$WORK/hostlost.h1")"
  fi
fi

finish
