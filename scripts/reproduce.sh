#!/usr/bin/env bash
# Tests the claims of Chen et al., "Revisiting Distributed Synchronous SGD", on qring's own
# runs (docs/reproduction.md). Parts, each into DIR/<part>/:
#   kth       the k-th arrival curve at N+b = 100 and 1000 (qring-sim --arrivals-only) under
#             every straggler regime below, and the shifted exponential's closed form
#   bsweep    N+b = 100: every b of B100, quorum "auto" (the default: the linear value) and
#             "auto-estimate" (the noise scale estimated in the run), the b sweep and the
#             adaptive quorum's comparison at once: the real trace (SEEDS_TRACE seeds),
#             the synthetic regimes (SEEDS seeds)
#   bsweep1000  N+b = 1000, the real trace, every b of B1000
#   async     full sync, sync with 4 % backups and async SGD at 10, 50, 100 simulated workers
#             under the real trace; async tuned first (learning rate, warm-up, the staleness
#             rule) on the held-out seed TUNE_SEED
#   depth     "staleness hurts deeper models more": full sync against tuned async at W = 50
#             for an MLP with one hidden layer and with four
#   real      qring-train on 4 and 8 ranks under the real trace: full sync, one backup, async
#             (tuned on TUNE_SEED as above)
#   validate  the simulator's step times against qring-bench's on 4, 8 and 16 emulated hosts
#             with rate-capped links (scripts/netns-cluster.sh, tbf; needs root), its network
#             model fitted on 2 of them
# then scripts/reproduce.py analyze DIR: DIR/tables/*.json, DIR/plots/*.png and the claim
# table DIR/claims.md, every number from the runs' files; scripts/reproduce.py check DIR.
#
#   scripts/reproduce.sh [--quick | --smoke] [--only PART...] [--out DIR]
#
# Full: the configuration below, several hours on 2 shared cores (docs/reproduction.md says
# how long the run there took); --quick: every part at a smaller scale (fewer seeds, b
# values and steps; 4.8-5.8 minutes, 5.1-5.5 of CPU, on 2 cores at a load average of 2-7),
# regenerating every table and plot the page cites; --smoke: every part on synthetic data
# and a made-up job trace in a few minutes (what scripts/test.sh runs: the artefacts are
# produced and well formed, not the claims). --only PART... reruns those parts (the others'
# runs in DIR are kept) and the analysis. Straggler regimes:
#   trace        the 32-rank job of ../shared/traces/llm-seqlen-imbalance-32ranks.txt,
#                resampled to any world size (straggler model resample:SCALE:FILE: worker w
#                replays a seeded permutation's column of the job from a seeded step offset;
#                its time = the job rank's time / that job step's fastest x SCALE ms);
#                QRING_TRACES names the folder (default ../shared/traces beside the checkout)
#   slow-worker  the same for llm-slow-worker-4ranks.txt (one rank 2.35x slow: a quarter of
#                the workers), in the k-th arrival curve
#   lognormal    every worker, every step lognormal(2.7, 1.0) ms (median 15 ms)
#   shiftexp     8 ms + an exponential of mean 15 ms (the paper's model)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
SCALE=full
OUT=runs/reproduce
PARTS_ALL="kth bsweep bsweep1000 async depth real validate"
PARTS=""
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) SCALE=quick; shift ;;
    --smoke) SCALE=smoke; shift ;;
    --out) OUT=${2:?--out needs a directory}; shift 2 ;;
    --only)
      shift
      while [ $# -gt 0 ] && [[ " $PARTS_ALL " == *" $1 "* ]]; do PARTS="$PARTS $1"; shift; done
      [ -n "$PARTS" ] || { echo "reproduce.sh: --only takes parts of: $PARTS_ALL" >&2; exit 2; } ;;
    *) echo "reproduce.sh: unknown argument $1 (use --quick, --smoke, --only PART..., --out DIR)" >&2
       exit 2 ;;
  esac
done
PARTS=${PARTS:-$PARTS_ALL}
want() { [[ " $PARTS " == *" $1 "* ]]; }

scripts/setup.sh
BUILD=${QRING_BUILD:-build}
TARGETS="qring-train qring-launch qring-bench qring-sim"
# A build folder configured for these targets is only brought up to date (cmake reconfigures
# it itself when a CMakeLists changed); configuring again costs more than the check.
if grep -qx "QRING_BUILD_ONLY:STRING=${TARGETS// /;}" "$BUILD/CMakeCache.txt" 2>/dev/null &&
   grep -qx "CMAKE_BUILD_TYPE:STRING=${QRING_BUILD_TYPE:-Release}" "$BUILD/CMakeCache.txt"; then
  cmake --build "$BUILD" -j "$(nproc)" --target qring_build_only >/dev/null
else
  QRING_TARGETS="$TARGETS" scripts/build.sh "$BUILD" >/dev/null
fi
LAUNCH=$BUILD/net/qring-launch
TRAIN=$BUILD/train/qring-train
SIM=$BUILD/train/qring-sim
BENCH=$BUILD/collectives/qring-bench
CONFIG=configs/reproduce.toml
# Debian's Python, which has python3-matplotlib (scripts/setup.sh), whatever python3 is first.
PY=${QRING_PYTHON:-/usr/bin/python3}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)

# ---------------------------------------------------------------- the configuration
# The simulator trains the MLP 784-128-10 (407 KB of gradient and loss), batch 8 per worker
# (global 800 at N+b = 100; 2 per worker at 1000); the real runs the 784-10-10 of
# configs/reproduce.toml, batch 32. Every sync run counts the same gradients
# (train.budget = gradients: full sync's steps x W), so a run with backups takes more, smaller
# steps; fixed quorums run on quorum "auto"'s path held at N (quorum.min = quorum.max = N: the
# rate inside the momentum buffer, as auto's; at a constant rate the same as PyTorch's form),
# so that auto is compared with fixed quorums in its own optimizer form.
TRACE_SCALE=20         # ms: the fastest rank of a job step (sim), so steps of 20-45 ms
REAL_TRACE_SCALE=12    # ms: the same for the real runs (their own compute is ~0.1 ms)
LOGNORMAL=lognormal:2.7:1.0
SHIFTEXP=shiftexp:8:15
SIM_APPLY_MS=0.077     # one optimizer step of 784-128-10 on this machine (measured median)
SIM_COMPUTE_MS=0.075   # one gradient of batch 8 (synthetic regimes; the traces are the whole time)
MODEL100=("model.hidden=[128]")
DEEP=("model.hidden=[128,128,128,128]")
TUNE_SEED=99
common=()
case $SCALE in
  full)
    SEEDS="1 2 3 4 5"; SEEDS_TRACE=$(seq -s " " 1 192)  # 192: auto/best b within 5 % needs a narrow interval
    B100="0 2 4 8 16 32 64"; B1000="0 20 50 100 200 500"
    STEPS100=300; EVAL100=10; TARGET100=0.865
    STEPS1000=150; EVAL1000=10; TARGET1000=0.85; BATCH1000=2
    KTH_STEPS=500
    ASYNC_W="10 50 100"; EPOCHS=3; TUNE_LR="0.5 1 2"; TUNE_WARM="1 4"
    DEPTH_W=50
    REAL_STEPS=400; REAL_EVAL=20; REAL_TARGET=0.80; REAL_W="4 8"
    VAL_HOSTS="4 8 16"; VAL_ITERS=60 ;;
  quick)
    SEEDS="1 2"; SEEDS_TRACE="1 2"
    B100="0 4 16"; B1000="0 50 500"
    STEPS100=150; EVAL100=10; TARGET100=0.84
    STEPS1000=40; EVAL1000=10; TARGET1000=0.78; BATCH1000=2
    KTH_STEPS=200
    ASYNC_W="10 100"; EPOCHS=1; TUNE_LR="1 2"; TUNE_WARM="1"
    DEPTH_W=50
    REAL_STEPS=120; REAL_EVAL=20; REAL_TARGET=0.74; REAL_W="4"
    VAL_HOSTS="4 8"; VAL_ITERS=20 ;;
  smoke)
    SEEDS="1"; SEEDS_TRACE="1 2"
    B100="0 20"; B1000="0 100"
    STEPS100=8; EVAL100=4; TARGET100=0.3
    STEPS1000=3; EVAL1000=3; TARGET1000=0.3; BATCH1000=2
    KTH_STEPS=50
    ASYNC_W="10"; EPOCHS=1; TUNE_LR="1"; TUNE_WARM="1"
    DEPTH_W=10
    REAL_STEPS=16; REAL_EVAL=8; REAL_TARGET=0.3; REAL_W="4"
    VAL_HOSTS="4"; VAL_ITERS=10
    TRACE_SCALE=1; REAL_TRACE_SCALE=0.5
    LOGNORMAL=lognormal:0.5:1.0; SHIFTEXP=shiftexp:1:2
    MODEL100=("model.hidden=[16]"); DEEP=("model.hidden=[16,16]")
    common=(data.dataset=synthetic data.synthetic_train=8192 data.synthetic_test=512
            train.warmup_steps=2 train.checksum_every=10) ;;
esac
SEEDS=${QRING_SEEDS:-$SEEDS}
SEEDS_TRACE=${QRING_SEEDS_TRACE:-$SEEDS_TRACE}

# The job traces: ../shared/traces beside the checkout (QRING_TRACES); at smoke scale a
# made-up job (reproduce.py fake-times), so that scripts/test.sh needs nothing outside it.
if [ "$SCALE" = smoke ]; then
  TRACES=$OUT/traces
  mkdir -p "$TRACES"
  "$PY" scripts/reproduce.py fake-times "$TRACES/llm-seqlen-imbalance-32ranks.txt" 32 12 1 >/dev/null
  "$PY" scripts/reproduce.py fake-times "$TRACES/llm-slow-worker-4ranks.txt" 4 12 2 >/dev/null
else
  TRACES=${QRING_TRACES:-$ROOT/../shared/traces}
fi
# Fashion-MNIST inflated once into DIR/data: every run would otherwise inflate the 30 MB of
# gzip itself (a quarter of a CPU second, about a hundred runs at quick scale).
if [ "$SCALE" != smoke ]; then
  DATA=$(sed -n 's/^path *= *"\(.*\)".*/\1/p' "$CONFIG")
  mkdir -p "$OUT/data"
  for f in train-images-idx3-ubyte train-labels-idx1-ubyte t10k-images-idx3-ubyte t10k-labels-idx1-ubyte; do
    [ -f "$OUT/data/$f" ] && continue
    if [ -f "$DATA/$f.gz" ]; then
      gzip -dc "$DATA/$f.gz" >"$OUT/data/$f.tmp" && mv "$OUT/data/$f.tmp" "$OUT/data/$f"
    else
      cp "$DATA/$f" "$OUT/data/$f"  # not found: the runs name it
    fi
  done
  common+=(data.path="$OUT/data")
fi
SEQLEN=$TRACES/llm-seqlen-imbalance-32ranks.txt
SLOW=$TRACES/llm-slow-worker-4ranks.txt
for f in "$SEQLEN" "$SLOW"; do
  [ -f "$f" ] || { echo "reproduce.sh: $f not found (set QRING_TRACES to the traces' folder)" >&2; exit 2; }
done

start=$(date +%s)
# Each line: the wall time so far and the CPU time of every finished child (runs, analysis).
# (times runs in this shell: in a command substitution it would count the subshell's.)
cpu_s() { awk 'NR == 2 { split($1 " " $2, t, /[ms ]+/); printf "%.0f", 60 * t[1] + t[2] + 60 * t[3] + t[4] }' "$OUT/.times"; }
log() {
  times >"$OUT/.times"
  echo "[reproduce $(( $(date +%s) - start )) s, CPU $(cpu_s) s] $*"
}
log "scale $SCALE, parts:$PARTS, output $OUT, load average $(cut -d' ' -f1-3 /proc/loadavg)"
cat >"$OUT/scale.json" <<EOF
{"scale": "$SCALE", "seeds": "$SEEDS", "seeds_trace": "$SEEDS_TRACE", "tune_seed": $TUNE_SEED,
 "b100": "$B100", "b1000": "$B1000", "steps100": $STEPS100, "target100": $TARGET100,
 "steps1000": $STEPS1000, "target1000": $TARGET1000, "epochs": $EPOCHS,
 "real_steps": $REAL_STEPS, "real_target": $REAL_TARGET, "trace_scale_ms": $TRACE_SCALE,
 "real_trace_scale_ms": $REAL_TRACE_SCALE, "lognormal": "$LOGNORMAL", "shiftexp": "$SHIFTEXP",
 "traces": "$TRACES", "commit": "$(git rev-parse --short HEAD 2>/dev/null || echo unknown)"}
EOF

# A regime's straggler model and the simulator's compute time under it.
model_of() {  # model_of REGIME SCALE_MS
  case $1 in
    trace) echo "resample:$2:$SEQLEN" ;;
    slow-worker) echo "resample:$2:$SLOW" ;;
    lognormal) echo "$LOGNORMAL" ;;
    shiftexp) echo "$SHIFTEXP" ;;
  esac
}
compute_of() { case $1 in trace | slow-worker) echo 0 ;; *) echo "$SIM_COMPUTE_MS" ;; esac; }

# sim DIR NAME ARGS...: one qring-sim run into DIR/NAME (skipped when its summary exists: a
# rerun of an interrupted part goes on where it stopped), in the background, at most
# SIM_JOBS at once: simulated time does not depend on the machine's load, so the runs of a
# part overlap; sim_wait waits for them all (the end of a part, or before reading a grid).
SIM_JOBS=${QRING_SIM_JOBS:-$(nproc)}
# shellcheck disable=SC2046  # the running jobs' ids, one word each
sim_failed() { echo "reproduce.sh: a qring-sim run failed (above)" >&2; kill $(jobs -rp) 2>/dev/null; exit 1; }
sim_wait() { local p; for p in $(jobs -p); do wait "$p" || sim_failed; done; }
sim() {
  local dir=$1 name=$2
  shift 2
  [ -f "$dir/$name/summary.json" ] && return 0
  mkdir -p "$dir"
  while [ "$(jobs -rp | wc -l)" -ge "$SIM_JOBS" ]; do wait -n || sim_failed; done
  ( "$SIM" --config "$CONFIG" run.out_dir="$dir" run.name="$name" "${common[@]}" "$@" \
      >"$dir/$name.log" 2>&1 || { echo "reproduce.sh: $name failed:"; tail -20 "$dir/$name.log"; exit 1; } ) &
}
# real DIR NAME WORLD ARGS...: one qring-train run under qring-launch.
real() {
  local dir=$1 name=$2 w=$3
  shift 3
  [ -f "$dir/$name/summary.json" ] && return 0
  mkdir -p "$dir"
  "$LAUNCH" -n "$w" -- "$TRAIN" --config "$CONFIG" run.out_dir="$dir" run.name="$name" \
    log.progress=false "${common[@]}" "$@" \
    >"$dir/$name.log" 2>&1 || { echo "reproduce.sh: $name failed:"; tail -20 "$dir/$name.log"; exit 1; }
}
# The arguments of a sync run at N+b = W: "auto" (the default, the linear value),
# "auto-estimate" (the noise scale estimated in the run), or b (auto's path held at N).
quorum_args() {  # quorum_args W B
  case $2 in
    auto) echo "quorum.quorum=auto quorum.min=1" ;;
    auto-estimate) echo "quorum.quorum=auto quorum.min=1 quorum.noise_scale=estimate" ;;
    *) echo "quorum.quorum=auto quorum.min=$(( $1 - $2 )) quorum.max=$(( $1 - $2 ))" ;;
  esac
}
sim100=(--apply-ms "$SIM_APPLY_MS" "${MODEL100[@]}" train.batch_per_rank=8)

if want kth; then
  log "kth: the k-th arrival curve"
  for n in 100 1000; do
    for regime in trace slow-worker lognormal shiftexp; do
      for seed in $SEEDS; do
        sim "$OUT/kth" "$regime-n$n-s$seed" --workers "$n" --arrivals-only --compute-ms "$(compute_of "$regime")" \
          --apply-ms 0 straggler.model="$(model_of "$regime" "$TRACE_SCALE")" run.seed="$seed" \
          train.steps="$KTH_STEPS" train.batch_per_rank=2
      done
    done
  done
  sim_wait
fi

if want bsweep; then
  for regime in trace lognormal shiftexp; do
    [ "$regime" = trace ] && seeds=$SEEDS_TRACE || seeds=$SEEDS
    log "bsweep: N+b = 100, $regime, seeds $seeds"
    for seed in $seeds; do  # interleaved: each seed a round of every configuration
      for b in auto auto-estimate $B100; do
        # shellcheck disable=SC2046
        sim "$OUT/bsweep" "$regime-s$seed-b$b" --workers 100 $(quorum_args 100 "$b") "${sim100[@]}" \
          --compute-ms "$(compute_of "$regime")" straggler.model="$(model_of "$regime" "$TRACE_SCALE")" \
          run.seed="$seed" train.budget=gradients train.steps="$STEPS100" \
          train.eval_every="$EVAL100" train.target_accuracy="$TARGET100"
      done
    done
  done
  sim_wait
fi

if want bsweep1000; then
  log "bsweep1000: N+b = 1000, trace, seeds $SEEDS"
  for seed in $SEEDS; do
    for b in $B1000; do
      # shellcheck disable=SC2046
      sim "$OUT/bsweep1000" "trace-s$seed-b$b" --workers 1000 $(quorum_args 1000 "$b") \
        --apply-ms "$SIM_APPLY_MS" "${MODEL100[@]}" train.batch_per_rank="$BATCH1000" --compute-ms 0 \
        straggler.model="$(model_of trace "$TRACE_SCALE")" run.seed="$seed" train.budget=gradients \
        train.steps="$STEPS1000" train.eval_every="$EVAL1000" train.target_accuracy="$TARGET1000"
    done
  done
  sim_wait
fi

# Async, tuned on TUNE_SEED: the learning rate (x TUNE_LR of the configured one), the warm-up
# (x TUNE_WARM) and the staleness rule (none; divide, whose rate is also multiplied by W - 1,
# the typical staleness, so that both rules start from the same step size). The best by time
# to the target (then final accuracy) is reproduce.py's choice (tune-async), run on SEEDS.
tune_async() {  # tune_async DIR W TAG RUN... -> DIR/tune-TAG-*, the best's args in DIR/tune-TAG.best
  local dir=$1 w=$2 tag=$3
  shift 3
  local lr0 warm0 lr warm rule m
  lr0=$(sed -n 's/^lr *= *\([0-9.eE+-]*\).*/\1/p' "$CONFIG")
  warm0=$(sed -n 's/^warmup_steps *= *\([0-9]*\).*/\1/p' "$CONFIG")
  [ "$SCALE" = smoke ] && warm0=2
  for rule in none divide; do
    for m in $TUNE_LR; do
      for k in $TUNE_WARM; do
        lr=$("$PY" -c "print('%g' % ($lr0 * $m * ($w - 1 if '$rule' == 'divide' else 1)))")
        warm=$(( warm0 * k ))
        "$@" "$dir" "tune-$tag-$rule-lr$m-w$k" train.mode=async train.async_staleness="$rule" \
          train.lr="$lr" train.warmup_steps="$warm" run.seed="$TUNE_SEED"
      done
    done
  done
  sim_wait
  "$PY" scripts/reproduce.py tune-async "$dir" "tune-$tag" >"$dir/tune-$tag.best"
}
sim_async() {  # sim_async DIR NAME KEY=VALUE... (the async experiment's settings)
  local dir=$1 name=$2
  shift 2
  sim "$dir" "$name" --workers "$W" "${sim_args[@]}" "$@"
}

if want async; then
  for W in $ASYNC_W; do
    log "async: W = $W"
    b=$(( (W * 4 + 99) / 100 ))
    sim_args=("${sim100[@]}" --compute-ms 0 straggler.model="$(model_of trace "$TRACE_SCALE")"
              train.steps=0 train.epochs="$EPOCHS" train.target_accuracy="$TARGET100"
              train.eval_every=$(( 60000 / W / 8 / 4 > 0 ? 60000 / W / 8 / 4 : 1 )))
    [ "$SCALE" = smoke ] && sim_args+=(train.eval_every=2)
    tune_async "$OUT/async" "$W" "W$W" sim_async
    read -r -a best <"$OUT/async/tune-W$W.best"
    for seed in $SEEDS; do
      # shellcheck disable=SC2046
      sim_async "$OUT/async" "W$W-s$seed-full" $(quorum_args "$W" 0) train.budget=gradients \
        run.seed="$seed"
      # shellcheck disable=SC2046
      sim_async "$OUT/async" "W$W-s$seed-b$b" $(quorum_args "$W" "$b") train.budget=gradients \
        run.seed="$seed"
      sim_async "$OUT/async" "W$W-s$seed-async" train.mode=async "${best[@]}" run.seed="$seed"
    done
  done
  sim_wait
fi

if want depth; then
  W=$DEPTH_W
  for depth in 1 4; do
    log "depth: W = $W, $depth hidden layers"
    [ "$depth" = 1 ] && model=("${MODEL100[@]}") || model=("${DEEP[@]}")
    sim_args=(--apply-ms "$SIM_APPLY_MS" "${model[@]}" train.batch_per_rank=8 --compute-ms 0
              straggler.model="$(model_of trace "$TRACE_SCALE")" train.steps=0
              train.epochs="$EPOCHS" train.target_accuracy="$TARGET100"
              train.eval_every=$(( 60000 / W / 8 / 4 > 0 ? 60000 / W / 8 / 4 : 1 )))
    tune_async "$OUT/depth" "$W" "d$depth" sim_async
    read -r -a best <"$OUT/depth/tune-d$depth.best"
    for seed in $SEEDS; do
      # shellcheck disable=SC2046
      sim_async "$OUT/depth" "d$depth-s$seed-full" $(quorum_args "$W" 0) train.budget=gradients \
        run.seed="$seed"
      sim_async "$OUT/depth" "d$depth-s$seed-async" train.mode=async "${best[@]}" run.seed="$seed"
    done
  done
  sim_wait
fi

if want real; then
  real_run() {  # real_run DIR NAME KEY=VALUE...
    local dir=$1 name=$2
    shift 2
    real "$dir" "$name" "$W" straggler.model="$(model_of trace "$REAL_TRACE_SCALE")" \
      train.steps="$REAL_STEPS" train.eval_every="$REAL_EVAL" train.target_accuracy="$REAL_TARGET" "$@"
  }
  for W in $REAL_W; do
    log "real: W = $W (qring-train)"
    tune_async "$OUT/real" "$W" "W$W" real_run
    read -r -a best <"$OUT/real/tune-W$W.best"
    for seed in $SEEDS; do  # interleaved: the machine is shared, its load drifts
      real_run "$OUT/real" "W$W-s$seed-full" quorum.quorum="$W" run.seed="$seed"
      real_run "$OUT/real" "W$W-s$seed-b1" quorum.quorum=$(( W - 1 )) run.seed="$seed"
      real_run "$OUT/real" "W$W-s$seed-async" train.mode=async "${best[@]}" run.seed="$seed"
    done
  done
fi

if want validate; then
  log "validate: emulated hosts"
  VAL_SCALE=$SCALE VAL_HOSTS=$VAL_HOSTS VAL_ITERS=$VAL_ITERS BENCH=$BENCH SIM=$SIM TRAIN=$TRAIN \
    PY=$PY CONFIG=$CONFIG SEQLEN=$SEQLEN scripts/validate_sim.sh "$OUT/validate" "${MODEL100[@]}"
fi

log "analysis"
"$PY" scripts/reproduce.py analyze "$OUT"
missing=""
for p in $PARTS_ALL; do [ -d "$OUT/$p" ] || missing="$missing $p"; done
if [ -z "$missing" ]; then
  "$PY" scripts/reproduce.py check "$OUT"
else  # e.g. --only validate into a folder of its own: publish DIR validate takes its table
  log "check skipped: $OUT has no runs of$missing"
fi
log "done in $(( $(date +%s) - start )) s; load average $(cut -d' ' -f1-3 /proc/loadavg)"
