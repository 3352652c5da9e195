#!/usr/bin/env bash
# The quorum all-reduce's two acceptance measurements, each side by side in one run:
#  1. straggler cut-off: world 4 on shm, 1 MiB, rank 2 200 ms late every step
#     (fixed:2:200), quorum 3 with a 5 ms grace against quorum 4 (--compare-full);
#  2. cost of the protocol: with no stragglers and quorum = world, the quorum op against the
#     plain in-place all-reduce, interleaved pairs, 4 KiB - 64 MiB (p50 step time vs mean
#     time per operation).
#
#   scripts/bench_quorum.sh [--ranks 4] [--pairs 3] [--provider shm]
set -euo pipefail
cd "$(dirname "$0")/.."
RANKS=4
PAIRS=3
PROVIDER=shm
while [ $# -gt 0 ]; do
  case "$1" in
    --ranks) RANKS=$2; shift 2 ;;
    --pairs) PAIRS=$2; shift 2 ;;
    --provider) PROVIDER=$2; shift 2 ;;
    *) echo "bench_quorum.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
BUILD=${QRING_BUILD:-build}
[ -x "$BUILD/collectives/qring-bench" ] || QRING_TARGETS="qring-bench qring-launch" scripts/build.sh "$BUILD"
OUT=${QRING_BENCH_OUT:-runs/bench/quorum}
mkdir -p "$OUT"
launch=("$BUILD/net/qring-launch" -n "$RANKS" --provider "$PROVIDER" -- "$BUILD/collectives/qring-bench")
echo "load average at start: $(cut -d' ' -f1-3 /proc/loadavg)"

echo "== 1. straggler cut-off"
"${launch[@]}" --op quorum -b 1M -e 1M -n 50 -w 3 --quorum $((RANKS - 1)) --grace-ms 5 \
  --straggler fixed:2:200 --compare-full --redop avg --json "$OUT/cutoff.json" | sed 's/^\[rank 0\] //'

echo "== 2. quorum = world, no stragglers, vs the plain all-reduce ($PAIRS interleaved pairs)"
for i in $(seq "$PAIRS"); do
  "${launch[@]}" --op quorum -b 4K -e 64M -f 4 -n 20 -w 3 --redop avg --json "$OUT/q$i.json" >/dev/null
  "${launch[@]}" --op allreduce -b 4K -e 64M -f 4 -n 20 -w 3 --redop avg --json "$OUT/a$i.json" >/dev/null
done
/usr/bin/python3 - "$OUT" "$PAIRS" <<'PY'
import json, statistics, sys
out, pairs = sys.argv[1], int(sys.argv[2])
q, a = {}, {}
for i in range(1, pairs + 1):
    for r in json.load(open(f"{out}/q{i}.json")):
        q.setdefault(r["bytes"], []).append(r["p50_us"])
    for r in json.load(open(f"{out}/a{i}.json")):
        if r["in_place"]:  # the quorum op reduces in place too
            a.setdefault(r["bytes"], []).append(r["time_us"])
print(f"{'size':>10} {'quorum p50 us':>14} {'allreduce us':>13} {'ratio':>7} {'added us':>9}   (medians)")
for b in sorted(q):
    mq, ma = statistics.median(q[b]), statistics.median(a[b])
    print(f"{b:>10} {mq:>14.1f} {ma:>13.1f} {mq / ma:>7.3f} {mq - ma:>9.1f}")
PY
echo "load average at end: $(cut -d' ' -f1-3 /proc/loadavg)"
