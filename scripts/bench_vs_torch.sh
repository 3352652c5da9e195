#!/usr/bin/env bash
# qring-train against PyTorch (Debian's python3-torch 1.13: oneDNN convolutions, OpenBLAS for
# the dense layers through libopenblas0-pthread) on the same models, data, batch, optimizer
# and schedule (scripts/torch_fmnist.py), in interleaved pairs (qring, torch, qring, ...):
#   1 process, one thread each; and RANKS ranks, full sync, one thread per rank (qring-launch,
#   quorum = world, no stragglers; PyTorch DDP over gloo).
# Models: mlp = 784-256-128-10 (configs/fmnist-mlp.toml with model.hidden=[256,128]),
#         cnn = PyTorch's reference CNN (configs/fmnist-cnn-torch.toml).
#
#   scripts/bench_vs_torch.sh [--models "mlp cnn"] [--pairs 3] [--ranks 4] [--worlds "1 4"]
#                             [--mlp-steps 600] [--cnn-steps 150] [--epochs 0]
#
# --worlds picks the settings (default: 1 and --ranks).
# --epochs E (> 0) trains E epochs instead of a step count, so the final test accuracies are
# comparable. Prints samples/s (the step loop only: start-up and the final evaluation
# excluded) and test accuracy of every run, and per model and setting the median of the
# ratios qring / PyTorch. QRING_SETUP_TORCH=1 scripts/setup.sh installs PyTorch.
set -euo pipefail
cd "$(dirname "$0")/.."
MODELS="mlp cnn"
PAIRS=3
RANKS=4
MLP_STEPS=600
CNN_STEPS=150
EPOCHS=0
WORLDS=""
while [ $# -gt 0 ]; do
  case "$1" in
    --models) MODELS=$2; shift 2 ;;
    --pairs) PAIRS=$2; shift 2 ;;
    --ranks) RANKS=$2; shift 2 ;;
    --mlp-steps) MLP_STEPS=$2; shift 2 ;;
    --cnn-steps) CNN_STEPS=$2; shift 2 ;;
    --epochs) EPOCHS=$2; shift 2 ;;
    --worlds) WORLDS=$2; shift 2 ;;
    *) echo "bench_vs_torch.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
WORLDS=${WORLDS:-1 $RANKS}
for v in "$PAIRS" "$RANKS" "$MLP_STEPS" "$CNN_STEPS" "$EPOCHS" $WORLDS; do
  [[ "$v" =~ ^[0-9]+$ ]] || { echo "bench_vs_torch.sh: '$v' is not a count" >&2; exit 2; }
done
for w in $WORLDS; do
  [ "$w" -ge 1 ] || { echo "bench_vs_torch.sh: a world of $w ranks" >&2; exit 2; }
done
for m in $MODELS; do
  [ "$m" = mlp ] || [ "$m" = cnn ] || { echo "bench_vs_torch.sh: unknown model $m" >&2; exit 2; }
done
PY=/usr/bin/python3
if ! $PY -c "import torch" 2>/dev/null; then
  QRING_SETUP_TORCH=1 scripts/setup.sh
fi
BUILD=${QRING_BUILD:-build}
[ -x "$BUILD/train/qring-train" ] || QRING_TARGETS="qring-train qring-launch" scripts/build.sh "$BUILD"
CORES=$(nproc)
OUT=${QRING_BENCH_OUT:-runs/bench-torch}
mkdir -p "$OUT"
# PyTorch's OpenBLAS: the pthread build (the reference BLAS would be ~17x slower).
export LD_LIBRARY_PATH=/usr/lib/x86_64-linux-gnu/openblas-pthread${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1

json() { $PY -c "import json,sys; d=json.load(open(sys.argv[1])); print(d[sys.argv[2]])" "$@"; }
median() { printf '%s\n' "$@" | sort -g | awk '{a[NR]=$1} END {print (NR%2 ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2)}'; }

echo "qring $(git rev-parse --short HEAD 2>/dev/null || echo '?') ($BUILD), torch $($PY -c 'import torch; print(torch.__version__)'), $CORES cores"
echo "load average at start: $(cut -d' ' -f1-3 /proc/loadavg)"
summary=()
for model in $MODELS; do
  if [ "$model" = mlp ]; then
    cfg=(--config configs/fmnist-mlp.toml "model.hidden=[256,128]")
    steps=$MLP_STEPS
  else
    cfg=(--config configs/fmnist-cnn-torch.toml)
    steps=$CNN_STEPS
  fi
  for world in $WORLDS; do
    if [ "$EPOCHS" -gt 0 ]; then
      qlen="train.epochs=$EPOCHS train.steps=0"
      tlen="--epochs $EPOCHS"
    else
      qlen="train.steps=$steps"
      tlen="--steps $steps"
    fi
    ratios=()
    for i in $(seq "$PAIRS"); do
      name=$model-w$world-$i
      common=("${cfg[@]}" $qlen log.progress=false run.out_dir="$OUT" run.name="$name"
              quorum.quorum=1.0 straggler.model=none train.checksum_every=0)
      if [ "$world" = 1 ]; then
        "$BUILD/train/qring-train" --force "${common[@]}" >/dev/null
      else
        "$BUILD/net/qring-launch" -n "$world" -- "$BUILD/train/qring-train" --force "${common[@]}" \
          >/dev/null
      fi
      $PY scripts/torch_fmnist.py --model "$model" --world "$world" $tlen \
        --summary "$OUT/$name-torch.json" >/dev/null
      q=$(json "$OUT/$name/summary.json" computed_samples_per_s)
      qa=$(json "$OUT/$name/summary.json" test_accuracy)
      t=$(json "$OUT/$name-torch.json" samples_per_s)
      ta=$(json "$OUT/$name-torch.json" test_accuracy)
      r=$($PY -c "print(f'{$q/$t:.3f}')")
      ratios+=("$r")
      printf '%s %d rank(s) pair %d: qring %8.0f samples/s (accuracy %.4f)  torch %8.0f samples/s (accuracy %.4f)  ratio %s\n' \
        "$model" "$world" "$i" "$q" "$qa" "$t" "$ta" "$r"
    done
    summary+=("$model $world rank(s): median ratio qring/torch $(median "${ratios[@]}") over $PAIRS pair(s)")
  done
done
printf '%s\n' "${summary[@]}"
echo "load average at end: $(cut -d' ' -f1-3 /proc/loadavg)"
