#!/usr/bin/env bash
# Reproduces Chen et al., "Revisiting Distributed Synchronous SGD", on qring's own runs
# (issue 16; docs/reproduction.md):
#   1. calibration: qring-bench all-reduce and the quorum op's READY/DECIDE round trip,
#      fitted into the simulator's cost model;
#   2. real runs (qring-train, 4 and 8 ranks): full sync (Q = W), Q = W-1, Q = W-2 and
#      async SGD under a lognormal and a shifted-exponential straggler model, under a real
#      noisy neighbour (a CPU hog on the core of the last rank) and under a regime that
#      changes mid-run (rank 1 turns 5x slower halfway), same seed throughout;
#   3. qring-sim: the same runs simulated (validation of the step-time distribution), the
#      order statistics against the shifted exponential's closed form, the b sweep at
#      N+b = 100 and a coarser one at 1000 (with the adaptive quorum beside it), sync against
#      async at 10, 50 and 100;
#   4. the adaptive quorum (quorum.quorum=auto, issue 18) against every fixed quorum, each run
#      to the same budget of gradients (train.budget=gradients), under the lognormal, the
#      shifted-exponential and the changing regime, several seeds, interleaved: real runs at 4
#      and 8 ranks (adaptive/real/) and the simulator at N+b = 100 (adaptive/sim/);
#   5. scripts/reproduce.py analyze: tables, plots and the table "claim | measured | holds?".
#
#   scripts/reproduce.sh [--quick | --smoke] [--only adaptive|adaptive-real|adaptive-sim]
#                        [--out DIR]
#
# Full: about two hours on the 2-core machine (one of them part 4's real runs); --quick: the
# same experiments shorter (<= 15 min); --smoke: every experiment on synthetic data in a few
# minutes, for scripts/test.sh (checks that every artefact is produced and well formed, not
# the claims). --only adaptive runs part 4 alone (into DIR/adaptive, the rest of DIR kept;
# adaptive-real or adaptive-sim: its real runs or its simulated ones, the other half kept)
# and analyzes what DIR/adaptive holds (scripts/reproduce.py adaptive DIR). Results: DIR (default
# runs/reproduce): calibration/, real/, sim/, adaptive/, tables/, plots/, claims.{json,md}.
# Part 4's real runs take QRING_ADAPT_Q4 / QRING_ADAPT_Q8 (the fixed quorums at 4 and 8 ranks,
# e.g. "1 2 3"), QRING_ADAPT_SEEDS (their seeds, e.g. "101 102") and QRING_ADAPT_NOISE_SCALE
# (auto's quorum.noise_scale in samples, default 100: their model's, 784-10-10 batch 32), its
# simulated runs QRING_ADAPT_SIM_NOISE_SCALE (default configs/reproduce.toml's, 600: the
# simulator's 784-128-10 batch 8), from the environment, for experiments beside the
# configured ones (docs/reproduction.md). scripts/reproduce.py compare DIR... puts auto against
# the best fixed quorum over the runs of several such directories. QRING_ADAPT_FIXED_FORM=auto
# runs part 4's fixed quorums with auto's momentum form (default pytorch: PyTorch's).
# QRING_ADAPT_SIM_REGIMES: part 4's simulated regimes (default "lognormal shiftexp change";
# heavyexp, a shifted exponential whose tail outweighs its shift, shiftexp:4:30, may be added),
# QRING_ADAPT_SIM_SEEDS their seeds (default: the scale's).
set -euo pipefail
cd "$(dirname "$0")/.."
SCALE=full
OUT=runs/reproduce
ONLY=""
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) SCALE=quick; shift ;;
    --smoke) SCALE=smoke; shift ;;
    --out) OUT=$2; shift 2 ;;
    --only)
      case "${2:-}" in
        adaptive | adaptive-real | adaptive-sim) ONLY=$2 ;;
        *) echo "reproduce.sh: --only takes adaptive, adaptive-real or adaptive-sim" >&2; exit 2 ;;
      esac
      shift 2 ;;
    *) echo "reproduce.sh: unknown argument $1 (use --quick, --smoke, --only PART, --out DIR)" >&2
       exit 2 ;;
  esac
done
# Part 4's fixed quorums' optimizer: "pytorch" (default: quorum.quorum=Q, PyTorch's momentum
# form) or "auto" (auto's path with quorum.min = quorum.max = Q: the same quorum every step, the
# rate inside the momentum buffer as under auto; docs/reproduction.md, "The momentum buffer's
# form").
ADAPT_FIXED_FORM=${QRING_ADAPT_FIXED_FORM:-pytorch}
case $ADAPT_FIXED_FORM in
  pytorch | auto) ;;
  *) echo "reproduce.sh: QRING_ADAPT_FIXED_FORM must be pytorch or auto, got $ADAPT_FIXED_FORM" >&2; exit 2 ;;
esac
ADAPT_SIM_REGIMES=${QRING_ADAPT_SIM_REGIMES:-lognormal shiftexp change}
[ -n "${ADAPT_SIM_REGIMES// /}" ] || { echo "reproduce.sh: QRING_ADAPT_SIM_REGIMES is empty" >&2; exit 2; }
for regime in $ADAPT_SIM_REGIMES; do
  case $regime in
    lognormal | shiftexp | change | heavyexp) ;;
    *) echo "reproduce.sh: QRING_ADAPT_SIM_REGIMES: unknown regime '$regime' (lognormal, shiftexp, change, heavyexp)" >&2
       exit 2 ;;
  esac
done
if [ -n "${QRING_ADAPT_SIM_SEEDS:-}" ]; then
  for seed in $QRING_ADAPT_SIM_SEEDS; do
    [[ $seed =~ ^[0-9]+$ ]] || { echo "reproduce.sh: QRING_ADAPT_SIM_SEEDS: '$seed' is not a seed" >&2; exit 2; }
  done
fi
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
HEAVYEXP=shiftexp:4:30        # part 4's simulator only: 4 ms + an exponential of mean 30 ms
TRAIN_SAMPLES=60000  # Fashion-MNIST's training set
SIM_HIDDEN="[128]"   # the simulator's 100-1000 worker runs: 784-128-10
common=()
case $SCALE in
  full)
    REAL_STEPS=1000; REAL_EVAL=25; REAL_TARGET=0.81
    SIM_BATCH=8; SIM_BATCH1000=2; SIM_EVAL=10; SIM_TARGET=0.865; SIM_TARGET1000=0.85
    SWEEP100_STEPS=300; SWEEP100_B="0 1 2 4 8 16 20 32 48 64 80"
    ADAPT_SEEDS="42 7"; ADAPT_Q4="4 3 2 1"; ADAPT_Q8="8 7 6 5 4 3 2"
    ADAPT_SIM_SEEDS="42 7 3 11 5 13 17 23"; ADAPT_SIM_B="0 20 32 40 48 56 64 72 80"; ADAPT_SIM_EVAL=5
    SWEEP1000_STEPS=150; SWEEP1000_B="0 50 200 500 800"; SWEEP1000_EVAL=10
    SCALE_EPOCHS=3
    CLOSED_STEPS=4000
    BENCH_ITERS=60 ;;
  quick)
    REAL_STEPS=150; REAL_EVAL=15; REAL_TARGET=0.76
    SIM_BATCH=8; SIM_BATCH1000=2; SIM_EVAL=10; SIM_TARGET=0.83; SIM_TARGET1000=0.75
    SWEEP100_STEPS=150; SWEEP100_B="0 4 20 48"
    ADAPT_SEEDS="42"; ADAPT_Q4="4 3 2"; ADAPT_Q8="8 6 4 2"
    ADAPT_SIM_SEEDS="42 7"; ADAPT_SIM_B="0 20 40 56 72"; ADAPT_SIM_EVAL=5
    SWEEP1000_STEPS=30; SWEEP1000_B="0 200 800"; SWEEP1000_EVAL=5
    SCALE_EPOCHS=1
    CLOSED_STEPS=2000
    BENCH_ITERS=20 ;;
  smoke)
    REAL_STEPS=24; REAL_EVAL=8; REAL_TARGET=0.3
    SIM_BATCH=4; SIM_BATCH1000=2; SIM_EVAL=4; SIM_TARGET=0.3; SIM_TARGET1000=0.3
    SWEEP100_STEPS=8; SWEEP100_B="0 4 20"
    ADAPT_SEEDS="42"; ADAPT_Q4="4 2"; ADAPT_Q8="8 2"
    ADAPT_SIM_SEEDS="42"; ADAPT_SIM_B="0 20"; ADAPT_SIM_EVAL=2
    SWEEP1000_STEPS=4; SWEEP1000_B="0 100"; SWEEP1000_EVAL=2
    SCALE_EPOCHS=1
    CLOSED_STEPS=200
    BENCH_ITERS=4
    LOGNORMAL=lognormal:0.5:1.0
    SHIFTEXP=shiftexp:1:2
    HEAVYEXP=shiftexp:0.5:4
    TRAIN_SAMPLES=8192
    SIM_HIDDEN="[16]"
    common=(data.dataset=synthetic data.synthetic_train=8192 data.synthetic_test=512
            "model.hidden=[16]" train.target_accuracy=0.3 train.warmup_steps=4
            train.checksum_every=10) ;;
esac

if [ -z "$ONLY" ]; then
  rm -rf "$OUT"
  mkdir -p "$OUT/calibration" "$OUT/real" "$OUT/sim"
fi
[ "$ONLY" = adaptive-sim ] || rm -rf "$OUT/adaptive/real"
[ "$ONLY" = adaptive-real ] || rm -rf "$OUT/adaptive/sim"
mkdir -p "$OUT/adaptive/real" "$OUT/adaptive/sim"
start=$(date +%s)
log() { echo "[reproduce $(( $(date +%s) - start )) s] $*"; }
log "scale $SCALE, output $OUT${ONLY:+ (only $ONLY)}, load average $(cut -d' ' -f1-3 /proc/loadavg)"

# A real run (qring-train) or a simulated one (qring-sim), into DIR/NAME; the runs of parts 2
# and 3 go to real/ and sim/, those of part 4 to adaptive/real/ and adaptive/sim/.
real_in() {  # real_in DIR NAME WORLD KEY=VALUE...
  local dir=$1 name=$2 w=$3
  shift 3
  log "qring-train ${dir#"$OUT"/}/$name"
  "$LAUNCH" -n "$w" -- "$TRAIN" --config "$CONFIG" run.out_dir="$dir" run.name="$name" \
    log.progress=false train.steps="$REAL_STEPS" train.eval_every="$REAL_EVAL" \
    train.target_accuracy="$REAL_TARGET" "${common[@]}" "$@" \
    >"$dir/$name.log" 2>&1 || { echo "reproduce.sh: $name failed:"; tail -20 "$dir/$name.log"; exit 1; }
}
real() { real_in "$OUT/real" "$@"; }
sim_in() {  # sim_in DIR NAME --workers W ... [KEY=VALUE...]
  local dir=$1 name=$2
  shift 2
  log "qring-sim ${dir#"$OUT"/}/$name"
  "$SIM" --config "$CONFIG" run.out_dir="$dir" run.name="$name" "${common[@]}" "$@" \
    >"$dir/$name.log" 2>&1 || { echo "reproduce.sh: $name failed:"; tail -20 "$dir/$name.log"; exit 1; }
}
sim() { sim_in "$OUT/sim" "$1" --calibration "$OUT/calibration/calibration.json" "${@:2}"; }
# The regime that changes mid-run (issue 18): LOGNORMAL's delays from Python's generator,
# rank 1's five times longer from step FROM on (default: the middle of STEPS).
mu=${LOGNORMAL#lognormal:}
sigma=${mu#*:}
mu=${mu%%:*}
change_trace() {  # change_trace WORKERS STEPS [FROM SEED] -> the trace file's path
  local f="$OUT/change-$1x$2${3:+-from$3-seed$4}.txt"
  [ -f "$f" ] || "$PY" scripts/reproduce.py regime-trace "$f" "$1" "$2" "$mu" "$sigma" 1 5 ${3:+"$3" "$4"} >/dev/null
  echo "$f"
}

if [ -z "$ONLY" ]; then
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
HOG=""
stop_hog() { if [ -n "$HOG" ]; then kill "$HOG" 2>/dev/null || true; wait "$HOG" 2>/dev/null || true; HOG=""; fi; }
trap stop_hog EXIT
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
    [ "$regime" = change ] || real "W$w-$regime-async" "$w" straggler.model="$model" train.mode=async
    stop_hog
  done
done

# 3. The simulator, with the calibrated cost model.
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
for b in $SWEEP100_B; do
  sim "bsweep100-b$b" --workers 100 --backups "$b" "${simc[@]}" \
    train.batch_per_rank="$SIM_BATCH" train.steps="$SWEEP100_STEPS" train.eval_every="$SIM_EVAL"
done
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

fi  # [ -z "$ONLY" ]: parts 1-3

# 4. The adaptive quorum (issue 18) against every fixed quorum. Each run counts the same
# gradients (train.budget = "gradients": as many as full sync's steps make), so that what a
# quorum reaches is not set by how many gradients it saw, and reads its schedule at the
# gradients counted (docs/training.md). quorum.noise_scale (samples) is the rule's value of a
# step: 100 for the real runs' model (measured: B_simple 83 before the target), the
# configuration's 600 for the simulator's (docs/reproduction.md, "Twelve seeds ..."). Interleaved: every round (seed) runs each regime's quorums
# one after the other. The changing regime's trace is drawn per seed (rank 1 slower from the
# middle of full sync's run: the same step for every quorum) and long enough for a quorum of
# 1 (real) or of ADAPT_SIM_MIN (sim, whose auto runs are bounded there).
ADAPT_SIM_MIN=10
ADAPT_Q4=${QRING_ADAPT_Q4:-$ADAPT_Q4}
ADAPT_Q8=${QRING_ADAPT_Q8:-$ADAPT_Q8}
ADAPT_SEEDS=${QRING_ADAPT_SEEDS:-$ADAPT_SEEDS}
ADAPT_SIM_SEEDS=${QRING_ADAPT_SIM_SEEDS:-$ADAPT_SIM_SEEDS}
ADAPT_NOISE_SCALE=${QRING_ADAPT_NOISE_SCALE:-100}
ADAPT_SIM_NOISE=()
[ -z "${QRING_ADAPT_SIM_NOISE_SCALE:-}" ] || ADAPT_SIM_NOISE=(quorum.noise_scale="$QRING_ADAPT_SIM_NOISE_SCALE")
# A fixed quorum of N in auto's momentum form (QRING_ADAPT_FIXED_FORM=auto): auto's path held
# at N every step.
auto_form_args() { args=(quorum.quorum=auto quorum.min="$1" quorum.max="$1"); }
adaptive_model() {  # adaptive_model REGIME WORKERS STEPS MIN SEED
  case $1 in
    lognormal) echo "$LOGNORMAL" ;;
    shiftexp) echo "$SHIFTEXP" ;;
    heavyexp) echo "$HEAVYEXP" ;;
    change) echo "trace:$(change_trace "$2" $(( $3 * $2 / $4 )) $(( $3 / 2 )) "$5")" ;;
  esac
}
for seed in $ADAPT_SEEDS; do
  [ "$ONLY" = adaptive-sim ] && break
  for regime in lognormal shiftexp change; do
    for w in 4 8; do
      model=$(adaptive_model "$regime" "$w" "$REAL_STEPS" 1 "$seed")
      [ "$w" = 4 ] && qs=$ADAPT_Q4 || qs=$ADAPT_Q8
      for q in auto $qs; do
        if [ "$q" = auto ]; then
          args=(quorum.quorum=auto quorum.noise_scale="$ADAPT_NOISE_SCALE"); tag=auto
        elif [ "$ADAPT_FIXED_FORM" = auto ]; then auto_form_args "$q"; tag=q$q
        else args=(quorum.quorum="$q"); tag=q$q; fi
        real_in "$OUT/adaptive/real" "W$w-$regime-s$seed-$tag" "$w" straggler.model="$model" \
          run.seed="$seed" train.budget=gradients "${args[@]}"
      done
    done
  done
done
# The simulator at N+b = 100, every b of ADAPT_SIM_B and auto, ADAPT_SIM_SEEDS seeds; the
# b sweep's model and target, compute and update times fixed (the medians measured on this
# machine) so that a run is deterministic, the simulator's default network costs.
for seed in $ADAPT_SIM_SEEDS; do
  [ "$ONLY" = adaptive-real ] && break
  for regime in $ADAPT_SIM_REGIMES; do
    model=$(adaptive_model "$regime" 100 "$SWEEP100_STEPS" "$ADAPT_SIM_MIN" "$seed")
    for b in auto $ADAPT_SIM_B; do
      if [ "$b" = auto ]; then args=(quorum.quorum=auto quorum.min="$ADAPT_SIM_MIN" "${ADAPT_SIM_NOISE[@]}")
      elif [ "$ADAPT_FIXED_FORM" = auto ]; then auto_form_args $(( 100 - b ))
      else args=(--backups "$b"); fi
      sim_in "$OUT/adaptive/sim" "N100-$regime-s$seed-b$b" --workers 100 "${args[@]}" \
        --compute-ms 0.075 --apply-ms 0.077 straggler.model="$model" run.seed="$seed" \
        train.budget=gradients train.target_accuracy="$SIM_TARGET" "model.hidden=$SIM_HIDDEN" \
        train.batch_per_rank="$SIM_BATCH" train.steps="$SWEEP100_STEPS" train.eval_every="$ADAPT_SIM_EVAL"
    done
  done
done

# 5. Tables, plots and the claim table.
log "analysis"
if [ -n "$ONLY" ]; then
  "$PY" scripts/reproduce.py adaptive "$OUT"
else
  "$PY" scripts/reproduce.py analyze "$OUT"
fi
# auto against the best fixed quorum with bootstrap intervals over the seeds (also for the
# runs of several --out directories: scripts/reproduce.py compare DIR...).
"$PY" scripts/reproduce.py compare "$OUT" >"$OUT/adaptive/compare.txt"
[ -n "$ONLY" ] || "$PY" scripts/reproduce.py check "$OUT"
log "done in $(( $(date +%s) - start )) s; load average $(cut -d' ' -f1-3 /proc/loadavg)"
