#!/usr/bin/env bash
# Training throughput: N ranks on this host (quorum = world, no stragglers, one compute
# thread each) against one process using every core, for the same model and per-step batch
# (N x batch_per_rank), in interleaved pairs (N ranks, 1 process, N ranks, ...).
#
#   scripts/bench_train.sh [--config configs/fmnist-mlp.toml] [--steps 300] [--pairs 3]
#                          [--ranks 4] [--batch B] [--independent]
#
# --batch B: per-rank batch (default: the config's); the process runs N x B.
# --independent: each pair also runs N independent one-rank processes at once (one thread
#   each, no communication at all, seeds differ) and sums their samples/s: what N replicas
#   of the step's compute and update reach on this host when nothing is exchanged, i.e. the
#   bound that the all-reduce's cost is measured against.
#
# Prints computed samples/s of each run (the step loop only; start-up and the final
# evaluation excluded) and the median ratio ranks/process. Target: >= 0.9 (issue 17; was 0.85).
set -euo pipefail
cd "$(dirname "$0")/.."
CONFIG=configs/fmnist-mlp.toml
STEPS=300
PAIRS=3
RANKS=4
BATCH=
INDEPENDENT=0
while [ $# -gt 0 ]; do
  case "$1" in
    --config) CONFIG=$2; shift 2 ;;
    --steps) STEPS=$2; shift 2 ;;
    --pairs) PAIRS=$2; shift 2 ;;
    --ranks) RANKS=$2; shift 2 ;;
    --batch) BATCH=$2; shift 2 ;;
    --independent) INDEPENDENT=1; shift ;;
    *) echo "bench_train.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
for v in "$STEPS" "$PAIRS" "$RANKS" ${BATCH:+"$BATCH"}; do
  [[ "$v" =~ ^[1-9][0-9]*$ ]] || { echo "bench_train.sh: '$v' is not a positive count" >&2; exit 2; }
done
[ -f "$CONFIG" ] || { echo "bench_train.sh: no config file $CONFIG" >&2; exit 2; }
BUILD=${QRING_BUILD:-build}
[ -x "$BUILD/train/qring-train" ] || QRING_TARGETS="qring-train qring-launch" scripts/build.sh "$BUILD"
OUT=${QRING_BENCH_OUT:-runs/bench-train}
mkdir -p "$OUT"
[ -n "$BATCH" ] || BATCH=$(grep -E '^batch_per_rank' "$CONFIG" | sed 's/.*= *//; s/ .*//')
echo "config $CONFIG, $STEPS steps, per-rank batch $BATCH, $RANKS ranks vs 1 process x $(nproc) threads"
echo "load average at start: $(cut -d' ' -f1-3 /proc/loadavg)"
common="train.steps=$STEPS straggler.model=none log.progress=false run.out_dir=$OUT quorum.quorum=1.0"
sps() {
  /usr/bin/python3 -c "import json,sys;print(sum(json.load(open(f'$OUT/{n}/summary.json'))['computed_samples_per_s'] for n in sys.argv[1:]))" "$@"
}
median() { printf '%s\n' "$@" | sort -n | awk '{a[NR]=$1} END {print (NR%2 ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2)}'; }
ratios=()
bounds=()
for i in $(seq "$PAIRS"); do
  "$BUILD/net/qring-launch" -n "$RANKS" -- "$BUILD/train/qring-train" --force --config "$CONFIG" \
    $common run.name=ranks-$i train.batch_per_rank="$BATCH" >/dev/null
  OMP_NUM_THREADS=$(nproc) "$BUILD/train/qring-train" --force --config "$CONFIG" $common \
    run.name=single-$i train.batch_per_rank=$((BATCH * RANKS)) >/dev/null
  r=$(sps ranks-$i)
  s=$(sps single-$i)
  ratio=$(/usr/bin/python3 -c "print(f'{$r/$s:.3f}')")
  ratios+=("$ratio")
  line=$(printf 'pair %d: %d ranks %8.0f samples/s   1 process %8.0f samples/s   ratio %s' "$i" "$RANKS" "$r" "$s" "$ratio")
  if [ "$INDEPENDENT" = 1 ]; then
    pids=()
    names=()
    for k in $(seq 0 $((RANKS - 1))); do
      OMP_NUM_THREADS=1 "$BUILD/train/qring-train" --force --config "$CONFIG" $common \
        run.name=independent-$i-$k run.seed=$((1000 + k)) train.batch_per_rank="$BATCH" >/dev/null &
      pids+=($!)
      names+=(independent-$i-$k)
    done
    for p in "${pids[@]}"; do wait "$p"; done
    b=$(sps "${names[@]}")
    bound=$(/usr/bin/python3 -c "print(f'{$b/$s:.3f}')")
    bounds+=("$bound")
    line+=$(printf '   %d independent %8.0f samples/s   ratio %s' "$RANKS" "$b" "$bound")
  fi
  echo "$line"
done
echo "median ratio ranks/process: $(median "${ratios[@]}") (target >= 0.9)"
if [ "$INDEPENDENT" = 1 ]; then
  echo "median ratio independent/process (no communication): $(median "${bounds[@]}")"
fi
echo "load average at end: $(cut -d' ' -f1-3 /proc/loadavg)"
