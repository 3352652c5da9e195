#!/usr/bin/env bash
# The simulator checked where it is used (part "validate" of scripts/reproduce.sh;
# docs/reproduction.md, "The simulator"): its step times against qring's own on emulated
# hosts, one rank per host, each host's link rate-capped with tbf (scripts/netns-cluster.sh,
# QRING_NETNS_RATE, default here 200mbit), so that the network, not this machine's two cores,
# sets the cost of a step.
#   1. the network model: qring-bench --op quorum --quorum 1 --compare-allreduce on 2 hosts,
#      4 KiB to 1 MiB, fitted by scripts/reproduce.py calibrate (alpha, beta, rtt);
#   2. for K in VAL_HOSTS (4 8 16): qring's own step cost at the model's gradient size without
#      stragglers (qring-bench --op quorum, Q = K: its p50, c), then Q = K and Q = K - 1
#      under the real trace scaled so that its fastest worker takes c (resample:c:SEQLEN:
#      injected delays of 1-2.3 c, at most 5x qring's own step cost), measured by qring-bench
#      and predicted by qring-sim --arrivals-only with the fitted model, the same delays.
# scripts/reproduce.py analyze compares the two (p50 and mean step time within 10 %).
#
#   scripts/validate_sim.sh DIR [model.hidden=[...]]   (root; BENCH, SIM, PY, CONFIG, SEQLEN,
#                                                       VAL_HOSTS, VAL_ITERS from reproduce.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=$1
HIDDEN=${2:-model.hidden=[128]}
: "${BENCH:?}" "${SIM:?}" "${PY:?}" "${CONFIG:?}" "${SEQLEN:?}" "${VAL_HOSTS:?}" "${VAL_ITERS:?}"
export QRING_NETNS_NAME=qring-val QRING_NETNS_RATE=${QRING_NETNS_RATE:-200mbit}
BENCH=$(realpath "$BENCH") SIM=$(realpath "$SIM")
CLUSTER=scripts/netns-cluster.sh
TIMEOUT=${QRING_VAL_TIMEOUT:-300}
mkdir -p "$DIR"
rm -f "$DIR"/*.json "$DIR"/*.txt
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

# run K NAME ARGS...: qring-bench on hosts 1..K, one rank each; rank 0's output in DIR/NAME.txt.
run() {
  local k=$1 name=$2 port secret r pids=() rc=0
  shift 2
  port=$((20000 + RANDOM % 20000))
  secret=$(head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n')
  for r in $(seq 0 $((k - 1))); do
    "$CLUSTER" exec $((r + 1)) env QRING_RANK="$r" QRING_WORLD_SIZE="$k" QRING_LOCAL_RANK=0 \
      QRING_LOCAL_SIZE=1 QRING_STORE="$("$CLUSTER" addr 1):$port" QRING_JOB_SECRET="$secret" \
      QRING_JOB_ID="validate-$name-$$" OMP_NUM_THREADS=1 timeout "$TIMEOUT" \
      "$BENCH" "$@" >"$DIR/$name.$r.txt" 2>&1 &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || rc=1; done
  mv "$DIR/$name.0.txt" "$DIR/$name.txt"
  rm -f "$DIR/$name".[0-9]*.txt
  [ "$rc" -eq 0 ] || { echo "validate_sim.sh: $name failed:"; tail -5 "$DIR/$name.txt"; exit 1; }
}

run 2 calibration-2 --op quorum --quorum 1 --compare-allreduce -b 4K -e 1M -f 4 -n "$VAL_ITERS" \
  -w 3 --json "$DIR/calibration-2.json"
"$PY" scripts/reproduce.py calibrate "$DIR/calibration.json" "$DIR/calibration-2.json" \
  --min-bytes=65536 >/dev/null

for k in $VAL_HOSTS; do
  run "$k" "cost-$k" --op quorum -b "$BYTES" -e "$BYTES" -n "$VAL_ITERS" -w 3 --json "$DIR/cost-$k.json"
  cost_ms=$("$PY" -c "import json, sys; print(round(json.load(open(sys.argv[1]))[0]['p50_us'] / 1000, 3))" \
    "$DIR/cost-$k.json")
  model=resample:$cost_ms:$SEQLEN
  for q in "$k" $((k - 1)); do
    run "$k" "measured-$k-q$q" --op quorum --quorum "$q" -b "$BYTES" -e "$BYTES" -n "$VAL_ITERS" \
      -w 3 --straggler "$model" --seed 7 --json "$DIR/measured-$k-q$q.json"
    "$SIM" --config "$CONFIG" --workers "$k" --backups $((k - q)) --arrivals-only --compute-ms 0 \
      --apply-ms 0 --calibration "$DIR/calibration.json" "$HIDDEN" data.dataset=synthetic \
      data.synthetic_train=1024 data.synthetic_test=128 straggler.model="$model" run.seed=7 \
      train.steps="$VAL_ITERS" run.out_dir="$DIR" run.name="simulated-$k-q$q" \
      >"$DIR/simulated-$k-q$q.log" 2>&1
  done
  echo "{\"hosts\": $k, \"bytes\": $BYTES, \"cost_ms\": $cost_ms, \"rate\": \"$QRING_NETNS_RATE\"}" \
    >"$DIR/hosts-$k.json"
done
