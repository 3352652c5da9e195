#!/usr/bin/env bash
# Training throughput: 4 ranks on this host (quorum = world, no stragglers, one compute
# thread each) against one process using every core, for the same model and per-step batch
# (4 x batch_per_rank), in interleaved pairs (4 ranks, 1 process, 4 ranks, ...).
#
#   scripts/bench_train.sh [--config configs/fmnist-mlp.toml] [--steps 300] [--pairs 3]
#
# Prints computed samples/s of each run (the step loop only; start-up and the final
# evaluation excluded) and the median ratio ranks/process. Target: >= 0.9 (issue 17; was 0.85).
set -euo pipefail
cd "$(dirname "$0")/.."
CONFIG=configs/fmnist-mlp.toml
STEPS=300
PAIRS=3
RANKS=4
while [ $# -gt 0 ]; do
  case "$1" in
    --config) CONFIG=$2; shift 2 ;;
    --steps) STEPS=$2; shift 2 ;;
    --pairs) PAIRS=$2; shift 2 ;;
    --ranks) RANKS=$2; shift 2 ;;
    *) echo "bench_train.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
BUILD=${QRING_BUILD:-build}
[ -x "$BUILD/train/qring-train" ] || QRING_TARGETS="qring-train qring-launch" scripts/build.sh "$BUILD"
OUT=${QRING_BENCH_OUT:-runs/bench-train}
mkdir -p "$OUT"
BATCH=$(grep -E '^batch_per_rank' "$CONFIG" | sed 's/.*= *//; s/ .*//')
echo "config $CONFIG, $STEPS steps, per-rank batch $BATCH, $RANKS ranks vs 1 process x $(nproc) threads"
echo "load average at start: $(cut -d' ' -f1-3 /proc/loadavg)"
common="train.steps=$STEPS straggler.model=none log.progress=false run.out_dir=$OUT"
ratios=()
for i in $(seq "$PAIRS"); do
  "$BUILD/net/qring-launch" -n "$RANKS" -- "$BUILD/train/qring-train" --config "$CONFIG" \
    $common run.name=ranks-$i quorum.quorum=1.0 >/dev/null
  OMP_NUM_THREADS=$(nproc) "$BUILD/train/qring-train" --config "$CONFIG" $common \
    run.name=single-$i quorum.quorum=1.0 train.batch_per_rank=$((BATCH * RANKS)) >/dev/null
  r=$(/usr/bin/python3 -c "import json;print(json.load(open('$OUT/ranks-$i/summary.json'))['computed_samples_per_s'])")
  s=$(/usr/bin/python3 -c "import json;print(json.load(open('$OUT/single-$i/summary.json'))['computed_samples_per_s'])")
  ratio=$(/usr/bin/python3 -c "print(f'{$r/$s:.3f}')")
  ratios+=("$ratio")
  printf 'pair %d: %d ranks %8.0f samples/s   1 process %8.0f samples/s   ratio %s\n' "$i" "$RANKS" "$r" "$s" "$ratio"
done
median=$(printf '%s\n' "${ratios[@]}" | sort -n | awk '{a[NR]=$1} END {print (NR%2 ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2)}')
echo "median ratio ranks/process: $median (target >= 0.9)"
echo "load average at end: $(cut -d' ' -f1-3 /proc/loadavg)"
