#!/usr/bin/env bash
# The simulator checked where it is used (part "validate" of scripts/reproduce.sh;
# docs/reproduction.md, "The simulator"): its step times against qring-train's on emulated
# hosts, one rank per host, each host's link rate-capped with tbf (scripts/netns-cluster.sh,
# QRING_NETNS_RATE, default here 200mbit, and QRING_NETNS_BURST, default here 16kb: a bucket
# of tbf's default 512 KB refills during a step's injected delays and then carries the 407 KB
# gradient at memory speed, so the link would be rate-capped only back to back).
#   1. the network model: qring-bench --op quorum --quorum 1 --compare-allreduce on 2 hosts,
#      64 KiB to 1 MiB, fitted by scripts/reproduce.py calibrate (alpha, beta, rtt), as the
#      simulator's 100-1000 worker runs use their own 2-rank fit;
#   2. for K in VAL_HOSTS (4 8 16): qring-train (the simulator's model 784-128-10, batch 8,
#      synthetic data, no evaluation in the steps) without stragglers, Q = K: qring's own
#      step cost c (the median step) and compute time;
#   3. the cost of a step beyond its decision (the ring or the reduction among the
#      contributors, and the update) at Q = K and Q = K - 1, measured by qring-train with
#      every rank idle c ms each step (straggler shiftexp:c:0: arrivals together, no trace),
#      by scripts/reproduce.py post-arrival into calibration-K.json, with each step's
#      arrival offsets (every rank's READY after the coordinator's, or where an excluded
#      coordinator's would have come: the ranks' start skew);
#   4. Q = K and Q = K - 1 under the real trace scaled so that its fastest worker takes c
#      (resample:c:SEQLEN: injected delays of 1-2.3 c, at most 5x qring's own step cost),
#      measured by qring-train (rank 0's step lines) and predicted by qring-sim
#      --arrivals-only with the measured compute time, the same delays and the cost beyond
#      the decision and the arrival offsets of step 3 (simulated-K-qQ), the same without the
#      offsets (together-K-qQ: every rank starting a step together), and with the 2-host
#      network model of step 1 instead (model2-K-qQ).
# scripts/reproduce.py analyze compares the step times (p50 and mean within 10 %) and the
# costs beyond the decision (measured in the run, the duty-cycle runs', the 2-host model's).
#
#   scripts/validate_sim.sh DIR [model.hidden=[...]]   (root; TRAIN, BENCH, SIM, PY, CONFIG,
#                                                       SEQLEN, VAL_HOSTS, VAL_ITERS from
#                                                       reproduce.sh; VAL_ITERS: steps a run)
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=$1
HIDDEN=${2:-model.hidden=[128]}
: "${APPLY_MS:=0.077}" "${TRAIN:?}" "${BENCH:?}" "${SIM:?}" "${PY:?}" "${CONFIG:?}" "${SEQLEN:?}" "${VAL_HOSTS:?}" "${VAL_ITERS:?}"
export QRING_NETNS_NAME=${QRING_VAL_NETNS:-qring-val} QRING_NETNS_RATE=${QRING_NETNS_RATE:-200mbit} \
  QRING_NETNS_BURST=${QRING_NETNS_BURST:-16kb}
BENCH=$(realpath "$BENCH") SIM=$(realpath "$SIM") TRAIN=$(realpath "$TRAIN") CONFIG=$(realpath "$CONFIG")
CLUSTER=scripts/netns-cluster.sh
TIMEOUT=${QRING_VAL_TIMEOUT:-300}
mkdir -p "$DIR"
DIR=$(realpath "$DIR")
rm -rf "${DIR:?}"/*
if [ "$(id -u)" -ne 0 ]; then
  echo "validate_sim.sh: needs root (network namespaces); skipped" | tee "$DIR/skipped.txt"
  exit 0
fi
hosts=2
for k in $VAL_HOSTS; do [ "$k" -gt "$hosts" ] && hosts=$k; done
cleanup() { "$CLUSTER" stop >/dev/null 2>&1 || true; }
trap cleanup EXIT
"$CLUSTER" start "$hosts" >/dev/null

# The model's gradient and loss in bytes: 4 (P + 1), P of the MLP 784-HIDDEN-10.
BYTES=$("$PY" -c "
import re, sys
h = [int(x) for x in re.findall(r'[0-9]+', sys.argv[1])]
dims = [784] + h + [10]
print(4 * (sum(a * b + b for a, b in zip(dims, dims[1:])) + 1))" "$HIDDEN")

# run K NAME PROGRAM ARGS...: PROGRAM on hosts 1..K, one rank each; rank 0's output in
# DIR/NAME.txt.
run() {
  local k=$1 name=$2 port secret r pids=() rc=0
  shift 2
  port=$((20000 + RANDOM % 20000))
  secret=$(head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n')
  for r in $(seq 0 $((k - 1))); do
    "$CLUSTER" exec $((r + 1)) env QRING_RANK="$r" QRING_WORLD_SIZE="$k" QRING_LOCAL_RANK=0 \
      QRING_LOCAL_SIZE=1 QRING_STORE="$("$CLUSTER" addr 1):$port" QRING_JOB_SECRET="$secret" \
      QRING_JOB_ID="validate-$name-$$" OMP_NUM_THREADS=1 timeout "$TIMEOUT" \
      "$@" >"$DIR/$name.$r.txt" 2>&1 &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || rc=1; done
  mv "$DIR/$name.0.txt" "$DIR/$name.txt"
  rm -f "$DIR/$name".[0-9]*.txt
  [ "$rc" -eq 0 ] || { echo "validate_sim.sh: $name failed:"; tail -5 "$DIR/$name.txt"; exit 1; }
}

run 2 calibration-2 "$BENCH" --op quorum --quorum 1 --compare-allreduce -b 64K -e 1M -f 4 \
  -n "$VAL_ITERS" -w 3 --json "$DIR/calibration-2.json"
"$PY" scripts/reproduce.py calibrate "$DIR/calibration.json" "$DIR/calibration-2.json" \
  --min-bytes=65536 >/dev/null

model_args=("$HIDDEN" train.batch_per_rank=8 data.dataset=synthetic data.synthetic_train=4096
            data.synthetic_test=256 run.seed=7 train.steps="$VAL_ITERS" train.eval_every=1000000
            train.checksum_every=0 train.warmup_steps=5)
train() {  # train K NAME KEY=VALUE...: qring-train on K hosts into DIR/NAME
  local k=$1 name=$2
  shift 2
  run "$k" "$name" "$TRAIN" --config "$CONFIG" run.out_dir="$DIR" run.name="$name" \
    log.progress=false "${model_args[@]}" "$@"
}
for k in $VAL_HOSTS; do
  train "$k" "cost-$k" quorum.quorum="$k"
  read -r cost_ms compute_ms < <("$PY" scripts/reproduce.py step-cost "$DIR/cost-$k")
  model=resample:$cost_ms:$SEQLEN
  # The step's cost beyond its decision, measured without the trace: every rank idle c ms
  # each step (the trace's fastest worker), so that the arrivals come together.
  # Each right before the run it predicts, so that both see the same load on this machine.
  for q in "$k" $((k - 1)); do
    train "$k" "duty-$k-q$q" quorum.quorum="$q" straggler.model="shiftexp:$cost_ms:0"
    train "$k" "measured-$k-q$q" quorum.quorum="$q" straggler.model="$model"
  done
  "$PY" scripts/reproduce.py post-arrival "$DIR/calibration-$k.json" "$DIR/calibration.json" \
    "$DIR/duty-$k-q$k" "$DIR/duty-$k-q$((k - 1))" >"$DIR/calibration-$k.txt"
  "$PY" -c "import json, sys; c = json.load(open(sys.argv[1])); c.pop('arrival_offsets_ms');
json.dump(c, open(sys.argv[2], 'w'), indent=2)" "$DIR/calibration-$k.json" "$DIR/calibration-$k-together.json"
  for q in "$k" $((k - 1)); do
    # Predicted three times: with the measured cost beyond the decision and arrival offsets
    # (the row's number), the same with every rank starting together (no offsets), and with
    # the 2-host network model alone (what the 100-1000 worker runs rest on).
    for cal in "calibration-$k" "calibration-$k-together" calibration; do
      case $cal in
        calibration) name=model2-$k-q$q ;;
        *-together) name=together-$k-q$q ;;
        *) name=simulated-$k-q$q ;;
      esac
      "$SIM" --config "$CONFIG" --workers "$k" --backups $((k - q)) --arrivals-only \
        --compute-ms "$compute_ms" --apply-ms "$APPLY_MS" --calibration "$DIR/$cal.json" \
        "${model_args[@]}" straggler.model="$model" run.out_dir="$DIR" run.name="$name" \
        >"$DIR/$name.log" 2>&1
    done
  done
  echo "{\"hosts\": $k, \"bytes\": $BYTES, \"cost_ms\": $cost_ms, \"compute_ms\": $compute_ms, \"rate\": \"$QRING_NETNS_RATE\"}" \
    >"$DIR/hosts-$k.json"
done
