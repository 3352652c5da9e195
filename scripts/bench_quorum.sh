#!/usr/bin/env bash
# The quorum all-reduce's two acceptance measurements, each side by side in one run:
#  1. straggler cut-off: world 4 on shm, 1 MiB, rank 2 200 ms late every step
#     (fixed:2:200), quorum 3 with a 5 ms grace against quorum 4 (--compare-full);
#  2. cost of the protocol: with no stragglers and quorum = world, the quorum op against the
#     plain in-place all-reduce, 4 KiB - 64 MiB, alternating step by step in one process
#     (--compare-allreduce), repeated --pairs times.
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

echo "== 2. quorum = world, no stragglers, vs the plain all-reduce ($PAIRS runs)"
# --compare-allreduce alternates one quorum step and one plain in-place all-reduce of the
# same size, each timed the same way, so both see the same placement of the 2 shared vCPUs.
for i in $(seq "$PAIRS"); do
  "${launch[@]}" --op quorum -b 4K -e 64M -f 4 -n 20 -w 3 --redop avg --compare-allreduce \
    --json "$OUT/q$i.json" >/dev/null
done
/usr/bin/python3 - "$OUT" "$PAIRS" <<'PY'
import json, statistics, sys
out, runs = sys.argv[1], int(sys.argv[2])
rows = {}
for i in range(1, runs + 1):
    for r in json.load(open(f"{out}/q{i}.json")):
        if r["op"] == "quorum":
            rows.setdefault(r["bytes"], []).append(r)
med = lambda rs, k: statistics.median(r[k] for r in rs)
print(f"{'size':>10} {'quorum p50':>11} {'allred p50':>11} {'p50 ratio':>10} {'mean ratio':>11} "
      f"{'added p50 us':>13}   (medians over {runs} runs; ratio range in brackets)")
for b in sorted(rows):
    rs = rows[b]
    r50 = [r["p50_ratio_vs_allreduce"] for r in rs]
    rmean = [r["mean_ratio_vs_allreduce"] for r in rs]
    added = [r["p50_us"] - r["allreduce_p50_us"] for r in rs]
    print(f"{b:>10} {med(rs, 'p50_us'):>11.1f} {med(rs, 'allreduce_p50_us'):>11.1f} "
          f"{statistics.median(r50):>10.3f} {statistics.median(rmean):>11.3f} "
          f"{statistics.median(added):>13.1f}   [{min(r50):.3f}-{max(r50):.3f}]")
PY
echo "load average at end: $(cut -d' ' -f1-3 /proc/loadavg)"
