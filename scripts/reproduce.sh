#!/usr/bin/env bash
# Reproduces Chen et al., "Revisiting Distributed Synchronous SGD", on qring's own runs
# (issue 16; docs/reproduction.md):
#   1. calibration: qring-bench all-reduce and the quorum op's READY/DECIDE round trip,
#      fitted into the simulator's cost model;
#   2. real runs (qring-train, 4 and 8 ranks): full sync (Q = W), Q = W-1, Q = W-2 and
#      async SGD under a lognormal and a shifted-exponential straggler model and under a
#      real noisy neighbour (a CPU hog on the core of the last rank), same seed throughout;
#      and the adaptive quorum (quorum.quorum=auto, issue 18) beside the fixed ones, also under
#      a regime that changes mid-run (rank 1 turns 5x slower halfway);
#   3. qring-sim: the same runs simulated (validation of the step-time distribution), the
#      order statistics against the shifted exponential's closed form, the b sweep at
#      N+b = 100 and a coarser one at 1000 (with auto beside them; at 100 also under the
#      shifted exponential and the changing regime), sync against async at 10, 50 and 100;
#   4. scripts/reproduce.py analyze: tables, plots and the table "claim | measured | holds?".
#
#   scripts/reproduce.sh [--quick | --smoke] [--out DIR]
#
# Full: about an hour on the 2-core machine; --quick: the same experiments shorter (<= 10
# min); --smoke: every experiment on synthetic data in a minute or two, for scripts/test.sh
# (checks that every artefact is produced and well formed, not the claims). Results:
# DIR (default runs/reproduce): calibration/, real/, sim/, tables/, plots/, claims.{json,md}.
set -euo pipefail
cd "$(dirname "$0")/.."
SCALE=full
OUT=runs/reproduce
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) SCALE=quick; shift ;;
    --smoke) SCALE=smoke; shift ;;
    --out) OUT=$2; shift 2 ;;
    *) echo "reproduce.sh: unknown argument $1 (use --quick, --smoke, --out DIR)" >&2; exit 2 ;;
  esac
done
scripts/setup.sh
BUILD=${QRING_BUILD:-build}
QRING_TARGETS="qring-train qring-launch qring-bench qring-sim" scripts/build.sh "$BUILD" >/dev/null
LAUNCH=$BUILD/net/qring-launch
TRAIN=$BUILD/train/qring-train
SIM=$BUILD/train/qring-sim
BENCH=$BUILD/collectives/qring-bench
CONFIG=configs/reproduce.toml
# Debian's Python, which has python3-matplotlib (scripts/setup.sh), whatever python3 is first.
PY=${QRING_PYTHON:-/usr/bin/python3}

# Experiment sizes. LOGNORMAL and SHIFTEXP are the injected delays (ms) of the real runs and
# of the simulator; the simulator's workers use batch SIM_BATCH each.
LOGNORMAL=lognormal:2.7:1.0   # median 15 ms, mean 24 ms
SHIFTEXP=shiftexp:8:15        # 8 ms + an exponential of mean 15 ms
TRAIN_SAMPLES=60000  # Fashion-MNIST's training set
SIM_HIDDEN="[128]"   # the simulator's 100-1000 worker runs: 784-128-10
common=()
case $SCALE in
  full)
    REAL_STEPS=1000; REAL_EVAL=25; REAL_TARGET=0.81
    SIM_BATCH=8; SIM_BATCH1000=2; SIM_EVAL=10; SIM_TARGET=0.865; SIM_TARGET1000=0.85
    SWEEP100_STEPS=300; SWEEP100_B="0 1 2 4 8 16 20 32 48 64 80"
    SWEEP100R_B="0 4 8 16 20 32 48 64"
    SWEEP1000_STEPS=150; SWEEP1000_B="0 50 200 500 800"; SWEEP1000_EVAL=10
    SCALE_EPOCHS=3
    CLOSED_STEPS=4000
    BENCH_ITERS=60 ;;
  quick)
    REAL_STEPS=150; REAL_EVAL=15; REAL_TARGET=0.76
    SIM_BATCH=8; SIM_BATCH1000=2; SIM_EVAL=10; SIM_TARGET=0.83; SIM_TARGET1000=0.75
    SWEEP100_STEPS=150; SWEEP100_B="0 4 20 48"
    SWEEP100R_B="0 20 48"
    SWEEP1000_STEPS=30; SWEEP1000_B="0 200 800"; SWEEP1000_EVAL=5
    SCALE_EPOCHS=1
    CLOSED_STEPS=2000
    BENCH_ITERS=20 ;;
  smoke)
    REAL_STEPS=24; REAL_EVAL=8; REAL_TARGET=0.3
    SIM_BATCH=4; SIM_BATCH1000=2; SIM_EVAL=4; SIM_TARGET=0.3; SIM_TARGET1000=0.3
    SWEEP100_STEPS=8; SWEEP100_B="0 4 20"
    SWEEP100R_B="0 20"
    SWEEP1000_STEPS=4; SWEEP1000_B="0 100"; SWEEP1000_EVAL=2
    SCALE_EPOCHS=1
    CLOSED_STEPS=200
    BENCH_ITERS=4
    LOGNORMAL=lognormal:0.5:1.0
    SHIFTEXP=shiftexp:1:2
    TRAIN_SAMPLES=8192
    SIM_HIDDEN="[16]"
    common=(data.dataset=synthetic data.synthetic_train=8192 data.synthetic_test=512
            "model.hidden=[16]" train.target_accuracy=0.3 train.warmup_steps=4
            train.checksum_every=10) ;;
esac

rm -rf "$OUT"
mkdir -p "$OUT/calibration" "$OUT/real" "$OUT/sim"
start=$(date +%s)
log() { echo "[reproduce $(( $(date +%s) - start )) s] $*"; }
log "scale $SCALE, output $OUT, load average $(cut -d' ' -f1-3 /proc/loadavg)"

# 1. Calibration (scripts/reproduce.py calibrate), over shm as the real runs (one host:
# provider auto = shm):
#  - back to back, the quorum op (quorum k - 1) against the plain all-reduce, 4 KiB to 1 MiB:
#    the 2-rank rows fit the alpha-beta model (each rank has a core, as each simulated worker
#    of the 100-1000 worker runs; 4 and 8 ranks are kept for the record);
#  - in a training-like duty cycle (every rank sleeps CAL_IDLE ms before each step), the quorum
#    op at the real runs' gradient size (32 KiB; theirs is 31.8 KB), at the real runs' world
#    sizes and quorums: the time of a step beyond its contributors' arrival, by their count.
log "calibration (qring-bench)"
for k in 2 4 8; do
  "$LAUNCH" -n "$k" -- "$BENCH" --op quorum --quorum $(( k - 1 )) --compare-allreduce -b 4K -e 1M \
    -f 4 -n "$BENCH_ITERS" -w 5 --json "$OUT/calibration/quorum-$k.json" >"$OUT/calibration/quorum-$k.txt"
done
CAL_IDLE=15
for w in 4 8; do
  for q in $(( w - 1 )) $(( w - 2 )); do  # (--compare-full adds the Q = W rows)
    "$LAUNCH" -n "$w" -- "$BENCH" --op quorum --quorum "$q" --compare-full -b 32K -e 32K \
      -n "$BENCH_ITERS" -w 5 --straggler "shiftexp:$CAL_IDLE:0" \
      --json "$OUT/calibration/duty-$w-$q.json" >"$OUT/calibration/duty-$w-$q.txt"
  done
done
"$PY" scripts/reproduce.py calibrate "$OUT/calibration/calibration.json" \
  "$OUT"/calibration/quorum-*.json "$OUT"/calibration/duty-*.json

# 2. Real runs.
real() {  # real NAME WORLD KEY=VALUE...
  local name=$1 w=$2
  shift 2
  log "qring-train $name"
  "$LAUNCH" -n "$w" -- "$TRAIN" --config "$CONFIG" run.out_dir="$OUT/real" run.name="$name" \
    log.progress=false train.steps="$REAL_STEPS" train.eval_every="$REAL_EVAL" \
    train.target_accuracy="$REAL_TARGET" "${common[@]}" "$@" \
    >"$OUT/real/$name.log" 2>&1 || { echo "reproduce.sh: $name failed:"; tail -20 "$OUT/real/$name.log"; exit 1; }
}
HOG=""
stop_hog() { if [ -n "$HOG" ]; then kill "$HOG" 2>/dev/null || true; wait "$HOG" 2>/dev/null || true; HOG=""; fi; }
trap stop_hog EXIT
# The regime that changes mid-run (issue 18): LOGNORMAL's delays from Python's generator,
# rank 1's five times longer from the middle of the run on.
mu=${LOGNORMAL#lognormal:}
sigma=${mu#*:}
mu=${mu%%:*}
change_trace() {  # change_trace WORKERS STEPS -> the trace file's path
  local f="$OUT/change-$1x$2.txt"
  [ -f "$f" ] || "$PY" scripts/reproduce.py regime-trace "$f" "$1" "$2" "$mu" "$sigma" 1 5 >/dev/null
  echo "$f"
}
for w in 4 8; do
  for regime in lognormal shiftexp noisy change; do
    case $regime in
      lognormal) model=$LOGNORMAL ;;
      shiftexp) model=$SHIFTEXP ;;
      noisy) model=none ;;
      change) model=trace:$(change_trace "$w" "$REAL_STEPS") ;;
    esac
    if [ "$regime" = noisy ]; then
      # qring-launch puts rank r on the r-th of its CPUs (mod their number): the hog shares
      # the last rank's core (and with it every rank on that core).
      cpu=$("$PY" -c "import os; c = sorted(os.sched_getaffinity(0)); print(c[($w - 1) % len(c)])")
      taskset -c "$cpu" bash -c 'while :; do :; done' &
      HOG=$!
      log "noisy neighbour: CPU hog (pid $HOG) on CPU $cpu"
    fi
    for q in $w $(( w - 1 )) $(( w - 2 )); do
      real "W$w-$regime-q$q" "$w" straggler.model="$model" quorum.quorum="$q"
    done
    [ "$regime" = noisy ] || real "W$w-$regime-auto" "$w" straggler.model="$model" quorum.quorum=auto
    [ "$regime" = change ] || real "W$w-$regime-async" "$w" straggler.model="$model" train.mode=async
    stop_hog
  done
done

# 3. The simulator, with the calibrated cost model.
sim() {  # sim NAME --workers W ... [KEY=VALUE...]
  local name=$1
  shift
  log "qring-sim $name"
  "$SIM" --config "$CONFIG" --calibration "$OUT/calibration/calibration.json" \
    run.out_dir="$OUT/sim" run.name="$name" "${common[@]}" "$@" >"$OUT/sim/$name.log" 2>&1 ||
    { echo "reproduce.sh: $name failed:"; tail -20 "$OUT/sim/$name.log"; exit 1; }
}
median_compute() {  # the real run's median compute time of one gradient (rank 0's, ms)
  "$PY" -c "
import json, sys
v = sorted(j['compute_ms'] for j in map(json.loads, open(sys.argv[1])) if j.get('type') == 'step' and j.get('compute_ms', 0) > 0)
print(v[len(v) // 2])" "$OUT/real/$1/metrics.jsonl"
}
# Validation: every real sync run with injected delays, simulated with the same model,
# workers, quorum, seed and steps; compute time = the real run's median.
for w in 4 8; do
  for regime in lognormal shiftexp; do
    [ "$regime" = lognormal ] && model=$LOGNORMAL || model=$SHIFTEXP
    for q in $w $(( w - 1 )) $(( w - 2 )); do
      name="W$w-$regime-q$q"
      sim "val-$name" --workers "$w" --backups $(( w - q )) --compute-ms "$(median_compute "$name")" \
        straggler.model="$model" train.steps="$REAL_STEPS" train.eval_every="$REAL_STEPS"
    done
  done
done
# The order statistics of the shifted exponential (no training, no compute time).
for n in 100 1000; do
  sim "closedform-n$n" --workers "$n" --arrivals-only --compute-ms 0 --apply-ms 0 \
    straggler.model="$SHIFTEXP" train.steps="$CLOSED_STEPS" train.batch_per_rank="$SIM_BATCH1000"
done
# The b sweeps (lognormal) at N+b = 100 and 1000, same steps for every b; the MLP 784-128-10,
# batch SIM_BATCH per worker at 100 (global 800 at b = 0) and SIM_BATCH1000 at 1000 (global
# 2000), the linear rule scaling the learning rate with N. The targets are near what full
# sync reaches in those steps (an easy target favours ever more backups: few gradients a
# step get there too, only sooner).
simc=(straggler.model="$LOGNORMAL" train.target_accuracy="$SIM_TARGET" "model.hidden=$SIM_HIDDEN")
sweep100() {  # sweep100 PREFIX STRAGGLER "B..." : fixed b, then the adaptive quorum
  local prefix=$1 model=$2 b
  for b in $3 auto; do
    local args=(--backups "$b") tag="b$b"
    [ "$b" = auto ] && args=(quorum.quorum=auto) && tag=auto
    sim "$prefix-$tag" --workers 100 "${args[@]}" "${simc[@]}" straggler.model="$model" \
      train.batch_per_rank="$SIM_BATCH" train.steps="$SWEEP100_STEPS" train.eval_every="$SIM_EVAL"
  done
}
sweep100 bsweep100 "$LOGNORMAL" "$SWEEP100_B"
sweep100 bsweep100-shiftexp "$SHIFTEXP" "$SWEEP100R_B"
sweep100 bsweep100-change "trace:$(change_trace 100 "$SWEEP100_STEPS")" "$SWEEP100R_B"
for b in $SWEEP1000_B auto; do
  args=(--backups "$b") tag="b$b"
  [ "$b" = auto ] && args=(quorum.quorum=auto) && tag=auto
  sim "bsweep1000-$tag" --workers 1000 "${args[@]}" "${simc[@]}" \
    train.target_accuracy="$SIM_TARGET1000" train.batch_per_rank="$SIM_BATCH1000" \
    train.steps="$SWEEP1000_STEPS" \
    train.eval_every="$SWEEP1000_EVAL"
done
# Sync (full, and with 4 % backups as the paper's 96 + 4) against async at 10, 50, 100
# workers: the same epochs, so the same number of gradients per worker.
for w in 10 50 100; do
  b=$(( (w * 4 + 99) / 100 ))
  for mode in b0 "b$b" async; do
    if [ "$mode" = async ]; then
      args=(--mode async)
    else
      args=(--backups "${mode#b}")
    fi
    # Four evaluations per epoch.
    sim "scale-W$w-$mode" --workers "$w" "${args[@]}" "${simc[@]}" \
      train.batch_per_rank="$SIM_BATCH" train.steps=0 \
      train.epochs="$SCALE_EPOCHS" train.eval_every=$(( TRAIN_SAMPLES / w / SIM_BATCH / 4 ))
  done
done

# 4. Tables, plots and the claim table.
log "analysis"
"$PY" scripts/reproduce.py analyze "$OUT"
"$PY" scripts/reproduce.py check "$OUT"
log "done in $(( $(date +%s) - start )) s; load average $(cut -d' ' -f1-3 /proc/loadavg)"
