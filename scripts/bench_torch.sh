#!/usr/bin/env bash
# qring.torch against PyTorch DDP over gloo: the same PyTorch model, data, optimizer and
# schedule on RANKS ranks (scripts/bench_torch.py), both under qring-launch (same CPU binding),
# in interleaved pairs (qring, DDP, qring, DDP, ...). Results: docs/benchmarks.md, "qring.torch
# against PyTorch DDP".
#
#   scripts/bench_torch.sh [--models "cnn mlp"] [--pairs 3] [--ranks 4] [--cnn-steps 150]
#                          [--mlp-steps 600] [--batch 64]
#                          [--straggler-pairs 1] [--straggler fixed:2:200] [--quorum 3]
#                          [--epochs 2] [--target 0.88] [--snapshot-every 25]
#                          [--wait block|poll]
#
# --wait: how qring's ranks wait for their peers (qring.init(wait=...); default block).
# Part 1, throughput (--pairs > 0): no stragglers, quorum = world. Per model, samples/s of each
# run, the ratio qring / DDP per pair and their median with its 95 % interval (bench_ab.py's
# median_ci, from 6 pairs); for qring the time in step() beyond the all-reduce and the
# optimizer, as a share of the whole step.
# Part 2, time to accuracy (--straggler-pairs > 0): PyTorch's CNN with the straggler model
# (default rank 2 200 ms late every step) on both; qring counts --quorum of the ranks per step
# (3 of 4) and DDP waits for all. Pair p trains with seed 41 + p (initialisation, data order,
# delays) on both backends: a run is deterministic for its seed, so each pair is one draw of
# the accuracy difference, and the mean over pairs is printed at the end. DDP trains --epochs
# epochs; qring the same number of counted samples (RANKS / quorum times the steps). Rank 0
# keeps the parameters every --snapshot-every steps with the loop's wall time and evaluates
# them afterwards: time to --target test accuracy, and the final accuracy. Prints per pair the
# ratio DDP time / qring time.
#
# The machine is shared: only ratios within a pair mean anything. PyTorch runs with OpenBLAS's
# pthread build (LD_LIBRARY_PATH=/usr/lib/x86_64-linux-gnu/openblas-pthread) and one thread per
# rank. Output: QRING_BENCH_OUT (default runs/bench-torch)/results.jsonl, one JSON line per run.
set -euo pipefail
cd "$(dirname "$0")/.."
MODELS="cnn mlp"
PAIRS=3
RANKS=4
CNN_STEPS=150
MLP_STEPS=600
BATCH=64
SPAIRS=1
STRAGGLER=fixed:2:200
QUORUM=3
EPOCHS=2
TARGET=0.88
SNAP=25
WAIT=block
while [ $# -gt 0 ]; do
  case "$1" in
    --models) MODELS=$2; shift 2 ;;
    --pairs) PAIRS=$2; shift 2 ;;
    --ranks) RANKS=$2; shift 2 ;;
    --cnn-steps) CNN_STEPS=$2; shift 2 ;;
    --mlp-steps) MLP_STEPS=$2; shift 2 ;;
    --batch) BATCH=$2; shift 2 ;;
    --straggler-pairs) SPAIRS=$2; shift 2 ;;
    --straggler) STRAGGLER=$2; shift 2 ;;
    --quorum) QUORUM=$2; shift 2 ;;
    --epochs) EPOCHS=$2; shift 2 ;;
    --target) TARGET=$2; shift 2 ;;
    --snapshot-every) SNAP=$2; shift 2 ;;
    --wait) WAIT=$2; shift 2 ;;
    *) echo "bench_torch.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
for v in "$PAIRS" "$RANKS" "$CNN_STEPS" "$MLP_STEPS" "$BATCH" "$SPAIRS" "$QUORUM" "$EPOCHS" "$SNAP"; do
  [[ "$v" =~ ^[0-9]+$ ]] || { echo "bench_torch.sh: '$v' is not a count" >&2; exit 2; }
done
[ "$RANKS" -ge 2 ] && [ "$QUORUM" -ge 1 ] && [ "$QUORUM" -le "$RANKS" ] ||
  { echo "bench_torch.sh: need 2+ ranks and 1 <= quorum <= ranks" >&2; exit 2; }
[ "$WAIT" = block ] || [ "$WAIT" = poll ] ||
  { echo "bench_torch.sh: --wait $WAIT: expected block or poll" >&2; exit 2; }
for m in $MODELS; do
  [ "$m" = mlp ] || [ "$m" = cnn ] || { echo "bench_torch.sh: unknown model $m" >&2; exit 2; }
done
PY=/usr/bin/python3
$PY -c "import torch" 2>/dev/null || QRING_SETUP_TORCH=1 scripts/setup.sh
BUILD=${QRING_BUILD:-build}
[ -x "$BUILD/net/qring-launch" ] && [ -f "$BUILD/python/qring/__init__.py" ] ||
  QRING_TARGETS="qring-launch _qring" scripts/build.sh "$BUILD"
OUT=${QRING_BENCH_OUT:-runs/bench-torch}
mkdir -p "$OUT"
RESULTS="$OUT/results.jsonl"
: >"$RESULTS"
CORES=$(nproc)  # before OMP_NUM_THREADS=1, which nproc honours
export LD_LIBRARY_PATH=/usr/lib/x86_64-linux-gnu/openblas-pthread${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1
export PYTHONPATH="$PWD/$BUILD/python${PYTHONPATH:+:$PYTHONPATH}"
echo "== bench_torch.sh on $CORES cores, $RANKS ranks, $(git rev-parse --short HEAD 2>/dev/null)" \
  "(shared machine: compare within a pair only)"

port=29600
# run LABEL ARGS...: one job of RANKS ranks; rank 0's JSON line goes to $RESULTS.
run() {
  local label=$1 line
  shift
  port=$((port + 2))
  # Rank 0 evaluates the model after the others exited: more than qring-launch's default
  # 30 s finish grace on a loaded machine (the CNN on 10,000 test images, one thread).
  line=$("$BUILD/net/qring-launch" -n "$RANKS" --finish-grace-s 600 -- $PY scripts/bench_torch.py --ddp-port "$port" \
    --batch "$BATCH" --wait "$WAIT" "$@" | sed -n 's/^\[rank 0\] \({.*}\)$/\1/p' | tail -n 1)
  [ -n "$line" ] || { echo "bench_torch.sh: $label produced no result" >&2; exit 1; }
  echo "{\"label\": \"$label\", \"result\": $line}" >>"$RESULTS"
  echo "$line"
}

if [ "$PAIRS" -gt 0 ]; then
  for m in $MODELS; do
    steps=$CNN_STEPS
    [ "$m" = mlp ] && steps=$MLP_STEPS
    echo "== throughput: $m, $steps steps, batch $BATCH per rank, quorum = world, no stragglers"
    ratios=()
    for p in $(seq "$PAIRS"); do
      q=$(run "tput-$m-qring-$p" --backend qring --model "$m" --steps "$steps")
      d=$(run "tput-$m-ddp-$p" --backend ddp --model "$m" --steps "$steps")
      ratios+=("$($PY -c 'import json, sys; print(json.loads(sys.argv[1])["samples_per_s"] / json.loads(sys.argv[2])["samples_per_s"])' "$q" "$d")")
      $PY - "$q" "$d" "$p" <<'PY'
import json, sys
q, d = json.loads(sys.argv[1]), json.loads(sys.argv[2])
print(f"pair {sys.argv[3]}: qring {q['samples_per_s']:.0f} samples/s (step {q['step_ms']:.1f} ms: "
      f"forward+backward {q['compute_ms']:.2f}, all-reduce {q['allreduce_ms']:.2f}, optimizer "
      f"{q['optimizer_ms']:.2f}, step() overhead {q['overhead_ms']:.2f} ms = "
      f"{q['overhead_pct']:.2f} % of a step; CPU {q['cpu_ms_per_step']:.1f} ms) | DDP "
      f"{d['samples_per_s']:.0f} samples/s (step {d['step_ms']:.1f} ms: forward+backward with "
      f"its all-reduce {d['compute_ms']:.2f} ({len(d.get('ddp_bucket_bytes', []))} bucket(s) of "
      f"{'/'.join(str(b) for b in d.get('ddp_bucket_bytes', []))} B), optimizer "
      f"{d['optimizer_ms']:.2f} ms; CPU {d['cpu_ms_per_step']:.1f} ms) | ratio "
      f"{q['samples_per_s'] / d['samples_per_s']:.3f}")
PY
    done
    $PY - "$m" "${ratios[@]}" <<'PY'
import sys
sys.path.insert(0, "scripts")
from bench_ab import ratio_cell  # median [95 % interval of the median, from 6 pairs] (range)
r = [float(x) for x in sys.argv[2:]]
print(f"{sys.argv[1]}: qring / DDP samples/s, median {ratio_cell(r)}, {len(r)} pairs")
PY
  done
fi

if [ "$SPAIRS" -gt 0 ]; then
  ddp_steps=$((EPOCHS * 60000 / (RANKS * BATCH)))
  q_steps=$((ddp_steps * RANKS / QUORUM))
  echo "== time to $TARGET: cnn, straggler $STRAGGLER, qring quorum $QUORUM of $RANKS" \
    "($q_steps steps) vs DDP ($ddp_steps steps: $EPOCHS epochs), snapshots every $SNAP steps"
  diffs=()
  for p in $(seq "$SPAIRS"); do
    seed=$((41 + p))  # each pair its own training run: initialisation, data order, delays
    q=$(run "ttt-qring-$p" --backend qring --model cnn --steps "$q_steps" --quorum "$QUORUM" \
      --straggler "$STRAGGLER" --snapshot-every "$SNAP" --target "$TARGET" --seed "$seed")
    d=$(run "ttt-ddp-$p" --backend ddp --model cnn --steps "$ddp_steps" \
      --straggler "$STRAGGLER" --snapshot-every "$SNAP" --target "$TARGET" --seed "$seed")
    diffs+=("$($PY -c 'import json, sys; print(100 * (json.loads(sys.argv[1])["final_accuracy"] - json.loads(sys.argv[2])["final_accuracy"]))' "$q" "$d")")
    $PY - "$q" "$d" "$p (seed $seed)" "$TARGET" <<'PY'
import json, sys
q, d = json.loads(sys.argv[1]), json.loads(sys.argv[2])
fmt = lambda r: (f"{r['time_to_target_s']:.1f} s (step {r['steps_to_target']})"
                 if r.get("time_to_target_s") is not None else "not reached")
ratio = (d["time_to_target_s"] / q["time_to_target_s"]
         if q.get("time_to_target_s") and d.get("time_to_target_s") else float("nan"))
print(f"pair {sys.argv[3]}: to {sys.argv[4]}: qring {fmt(q)}, DDP {fmt(d)}: {ratio:.2f}x sooner | "
      f"step qring {q['step_ms']:.0f} ms (mean contributors {q['mean_contributors']:.2f}), "
      f"DDP {d['step_ms']:.0f} ms | final accuracy qring {100 * q['final_accuracy']:.2f} %, "
      f"DDP {100 * d['final_accuracy']:.2f} % ({100 * (q['final_accuracy'] - d['final_accuracy']):+.2f} points)")
PY
  done
  $PY -c 'import statistics, sys; d = [float(x) for x in sys.argv[1:]]; print(f"final accuracy qring - DDP: mean {statistics.mean(d):+.2f} points over {len(d)} seeds (range {min(d):+.2f} to {max(d):+.2f})")' "${diffs[@]}"
fi
echo "== results: $RESULTS"
