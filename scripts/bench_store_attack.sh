#!/usr/bin/env bash
# The store under attack on loopback (issue 44's acceptance; docs/design.md "Security model"):
# scripts/store_attack.py holds and reopens 1000 connections to the store of a 4-rank job.
#
#   scripts/bench_store_attack.sh [BUILD_DIR] [PAIRS]      (defaults: build, 5)
#
# start   PAIRS interleaved pairs of a 4-rank qring-launch barrier job (qring-bench --op
#         barrier) beside the attacker aimed at a port where nothing listens (the same CPU
#         load), then aimed at the job's store: the job's wall time in ms, and the difference
# rejoin  configs/smoke.toml under --max-restarts 1 (quorum 3) with the attacker on its store:
#         rank 3 is SIGKILLed after 50 steps; its launcher restarts it and it must rejoin
# The store's log lines (the launcher's output naming "store server") per minute of attack
# are printed for each attacked run. Loads the machine's CPUs; the machine is shared, so
# read the differences within a pair. Traffic stays on loopback; every loop is bounded.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUILD=${1:-build}
case $BUILD in /*) ;; *) BUILD="$ROOT/$BUILD" ;; esac
PAIRS=${2:-5}
WORK=$(mktemp -d /tmp/qring-store-attack.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
QRING_JOB_SECRET=$(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n')
export QRING_JOB_SECRET OMP_NUM_THREADS=1

# attacker PORT SECONDS LOG: starts the attacker in the background; its pid in ATTACKER.
# In a session of its own, as another user's processes are (with autogroup scheduling, a
# process of this script's session would take its CPU out of the job's share).
attacker() {
  setsid timeout $(($2 + 30)) python3 "$ROOT/scripts/store_attack.py" --port "$1" --connections 1000 \
    --seconds "$2" >"$3" 2>&1 &
  ATTACKER=$!
  sleep 1
}
stop_attacker() {
  kill "$ATTACKER" 2>/dev/null || true
  wait "$ATTACKER" 2>/dev/null || true
}
store_lines_per_min() {  # LOG SECONDS
  local n
  n=$(grep -c "store server" "$1" || true)
  echo $((n * 60 / ($2 > 0 ? $2 : 1)))
}

for i in $(seq 1 "$PAIRS"); do
  port=$((20000 + RANDOM % 20000))
  line="pair $i:"
  for mode in decoy attacked; do
    target=$((port + 7))
    [ $mode = attacked ] && target=$port
    attacker "$target" 60 "$WORK/attacker.$mode"
    t0=$(date +%s%N)
    rc=0
    timeout 120 "$BUILD/net/qring-launch" -n 4 --port "$port" -- \
      "$BUILD/collectives/qring-bench" --op barrier -n 1 -w 0 >"$WORK/$mode.$i" 2>&1 || rc=$?
    ms=$((($(date +%s%N) - t0) / 1000000))
    stop_attacker
    line="$line $mode $ms ms (exit $rc)"
    [ $mode = decoy ] && decoy_ms=$ms
  done
  echo "$line; difference $((ms - decoy_ms)) ms; store log $(store_lines_per_min "$WORK/attacked.$i" $(((ms + 999) / 1000))) lines/min"
done

port=$((20000 + RANDOM % 20000))
attacker "$port" 120 "$WORK/attacker.rejoin"
t0=$SECONDS
timeout 150 "$BUILD/net/qring-launch" -n 4 --port "$port" --max-restarts 1 -- \
  "$BUILD/train/qring-train" --config "$ROOT/configs/smoke.toml" run.name=rejoin \
  "run.out_dir=$WORK/runs" log.progress=false train.steps=3000 quorum.quorum=3 \
  quorum.evict_ms=1000 >"$WORK/rejoin" 2>&1 &
launcher=$!
victim=""
for _ in $(seq 1 600); do  # at most 60 s until 50 steps
  n=$(grep -c '"type":"step"' "$WORK/runs/rejoin/metrics.jsonl" 2>/dev/null || true)
  if [ "${n:-0}" -ge 50 ]; then
    for p in $(pgrep -x qring-train 2>/dev/null || true); do
      grep -qzx "QRING_RANK=3" "/proc/$p/environ" 2>/dev/null &&
        grep -qz "^QRING_STORE=.*:$port\$" "/proc/$p/environ" 2>/dev/null && victim=$p
    done
    break
  fi
  sleep 0.1
done
[ -n "$victim" ] && kill -KILL "$victim"
rc=0
wait "$launcher" || rc=$?
took=$((SECONDS - t0))
stop_attacker
if [ -n "$victim" ] && [ "$rc" -eq 0 ] && grep -q "rank 3 rejoined at step" "$WORK/rejoin"; then
  echo "rejoin: rank 3 SIGKILLed under attack, restarted, rejoined; launcher exit 0 after $took s; store log $(store_lines_per_min "$WORK/rejoin" "$took") lines/min"
else
  echo "rejoin: FAILED (victim '${victim:-none}', launcher exit $rc after $took s)"
  tail -n 8 "$WORK/rejoin"
  exit 1
fi
