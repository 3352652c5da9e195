#!/usr/bin/env bash
# CPU used by ranks that wait for a message that does not come (the cost of a straggler's
# peers waiting on an oversubscribed node).
#
#   scripts/cpu_idle.sh [--ranks N] [--seconds S] [--provider P] [--via engine|endpoint|both]
#
# Runs `qring-launch -n N --provider P -- qring-bench --op idle --seconds S --idle-via V`: every
# rank posts a receive that never matches and waits S seconds (in the communicator's progress
# engine, or in Endpoint::wait), then cancels it. Reports
#   window: CPU seconds all ranks used during the S-second wait (getrusage in each rank), and
#           the percent of one core that is;
#   total:  user+sys of the whole launch (GNU time on qring-launch, start-up included).
# Target: window total < 5% of one core. Exit status 1 when a run misses the target.
# Defaults: 4 ranks, 10 s, provider shm, via both.
#
# Environment: QRING_BUILD (build directory, default build; built here if needed).
set -euo pipefail
cd "$(dirname "$0")/.."

RANKS=4
SECONDS_IDLE=10
PROVIDER=shm
VIA=both
TARGET=5
while [ $# -gt 0 ]; do
  case "$1" in
    --ranks) RANKS=$2; shift 2 ;;
    --seconds) SECONDS_IDLE=$2; shift 2 ;;
    --provider) PROVIDER=$2; shift 2 ;;
    --via) VIA=$2; shift 2 ;;
    -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
    *) echo "cpu_idle.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
case "$VIA" in engine|endpoint) VIAS=$VIA ;; both) VIAS="engine endpoint" ;;
  *) echo "cpu_idle.sh: --via must be engine, endpoint or both" >&2; exit 2 ;; esac

BUILD=${QRING_BUILD:-build}
BENCH=$BUILD/collectives/qring-bench
LAUNCH=$BUILD/net/qring-launch
if [ ! -x "$BENCH" ] || [ ! -x "$LAUNCH" ]; then
  echo "== building qring-bench and qring-launch in $BUILD"
  cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release >/dev/null
  cmake --build "$BUILD" -j "${QRING_JOBS:-2}" --target qring-bench qring-launch
fi
[ -x /usr/bin/time ] || { echo "cpu_idle.sh: /usr/bin/time not found (package time)" >&2; exit 1; }

echo "load average at start: $(cut -d" " -f1-3 /proc/loadavg) on $(nproc) cores" >&2
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
status=0
for via in $VIAS; do
  /usr/bin/time -f "%U %S %e" -o "$TMP/time" timeout $((60 + ${SECONDS_IDLE%.*} * 2)) \
    "$LAUNCH" -n "$RANKS" --provider "$PROVIDER" -- "$BENCH" --op idle --seconds "$SECONDS_IDLE" \
    --idle-via "$via" --json "$TMP/idle.json" >"$TMP/out" 2>&1 || {
    echo "cpu_idle.sh: the idle run ($via) failed:" >&2
    cat "$TMP/out" >&2
    exit 1
  }
  python3 - "$TMP/idle.json" "$TMP/time" "$via" "$TARGET" <<'EOF' || status=1
import json, sys
row = json.load(open(sys.argv[1]))[0]
user, sys_, wall = (float(x) for x in open(sys.argv[2]).read().split()[-3:])
via, target = sys.argv[3], float(sys.argv[4])
pct = row["core_percent_total"]
per = " ".join(f"{c:.3f}" for c in row["cpu_s_per_rank"])
print(f"via {via:<8} ranks {row['ranks']} provider {row['provider']}: "
      f"window {row['seconds']:.2f} s, CPU {row['cpu_s_total']:.3f} s = {pct:.2f}% of one core "
      f"(per rank {per}); whole launch user {user:.2f} s + sys {sys_:.2f} s in {wall:.2f} s "
      f"-> {'OK' if pct < target else 'ABOVE'} target {target:g}%")
sys.exit(0 if pct < target else 1)
EOF
done
echo "load average at end: $(cut -d" " -f1-3 /proc/loadavg)" >&2
exit $status
