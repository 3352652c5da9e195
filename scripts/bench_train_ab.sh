#!/usr/bin/env bash
# Training throughput of two builds side by side: the same qring-train run with each build's
# own qring-launch and qring-train, in interleaved pairs whose order alternates (A B, B A,
# A B, ...), so that neither the machine's drift nor the order favours one.
#
#   scripts/bench_train_ab.sh --a BUILD_DIR --b BUILD_DIR [--ranks 4] [--pairs 5]
#                             [--config configs/fmnist-mlp.toml] [-- key=value ...]
#
# e.g. an old commit against the working tree (build the old one in a git worktree first):
#   git worktree add /tmp/old 513f249 && (cd /tmp/old && QRING_TARGETS="qring-train \
#     qring-launch" scripts/build.sh build)
#   scripts/bench_train_ab.sh --a /tmp/old/build --b build -- train.steps=300 quorum.quorum=3
#
# Prints computed samples/s of every run (the step loop only) and the median of the per-pair
# ratios B/A with its 95 % interval (bench_ab.py's median_ci, from 6 pairs) and their range.
# Defaults: 300 steps, no stragglers, no progress line.
set -euo pipefail
cd "$(dirname "$0")/.."
A="" B="" RANKS=4 PAIRS=5 CONFIG=configs/fmnist-mlp.toml
while [ $# -gt 0 ]; do
  case "$1" in
    --a) A=$2; shift 2 ;;
    --b) B=$2; shift 2 ;;
    --ranks) RANKS=$2; shift 2 ;;
    --pairs) PAIRS=$2; shift 2 ;;
    --config) CONFIG=$2; shift 2 ;;
    --) shift; break ;;
    *) echo "bench_train_ab.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
if [ -z "$A" ] || [ -z "$B" ]; then echo "bench_train_ab.sh: --a and --b are required" >&2; exit 2; fi
for d in "$A" "$B"; do
  for bin in net/qring-launch train/qring-train; do
    [ -x "$d/$bin" ] || { echo "bench_train_ab.sh: $d/$bin not built" >&2; exit 2; }
  done
done
OUT=${QRING_BENCH_OUT:-runs/bench-train-ab}
mkdir -p "$OUT"
echo "config $CONFIG, $RANKS ranks, $PAIRS pairs; A = $A, B = $B; overrides: $*"
echo "load average at start: $(cut -d' ' -f1-3 /proc/loadavg)"
run() {  # build name [overrides...]
  local build=$1 name=$2
  shift 2
  rm -rf "${OUT:?}/$name"  # a fresh run directory: builds without --force take it too
  "$build/net/qring-launch" -n "$RANKS" -- "$build/train/qring-train" --config "$CONFIG" \
    train.steps=300 straggler.model=none log.progress=false "run.out_dir=$OUT" \
    "run.name=$name" "$@" >"$OUT/$name.log" 2>&1 || {
    echo "bench_train_ab.sh: run $name failed (see $OUT/$name.log)" >&2
    exit 1
  }
  python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['computed_samples_per_s'])" \
    "$OUT/$name/summary.json"
}
ratios=()
for i in $(seq "$PAIRS"); do
  if [ $((i % 2)) = 1 ]; then
    a=$(run "$A" "a-$i" "$@")
    b=$(run "$B" "b-$i" "$@")
  else
    b=$(run "$B" "b-$i" "$@")
    a=$(run "$A" "a-$i" "$@")
  fi
  r=$(python3 -c "print(f'{$b / $a:.3f}')")
  ratios+=("$r")
  printf 'pair %d: A %.0f samples/s, B %.0f samples/s, B/A %s\n' "$i" "$a" "$b" "$r"
done
python3 - "${ratios[@]}" <<'PY'
import sys
sys.path.insert(0, "scripts")
from bench_ab import ratio_cell  # median [95 % interval of the median, from 6 pairs] (range)
r = [float(x) for x in sys.argv[1:]]
print(f"B/A median {ratio_cell(r)}, {len(r)} pairs")
PY
