#!/usr/bin/env bash
# What a rejoin costs the healthy ranks, measured over many joins of one run: the MLP on 4
# ranks (quorum 3) under qring-launch --max-restarts K, and from outside a SIGKILL of rank 2
# (its current process) K times: first at step --first, then each time --gap steps after the
# previous incarnation was counted again. Each join's cost is the time its steps took beyond
# as many steps of the steady stretch after it (that stretch's median step): from 8 steps
# before the admission (the members reconnect a few steps before it; not before the view that
# evicted the lost incarnation) to 4 after the first step that counted the joiner. The same
# sum over windows of the same length inside the steady stretches, where nothing happens,
# gives the noise; the script prints both, their means and standard errors, and the
# admission step alone.
#
#   scripts/bench_join.sh [--joins 6] [--provider auto] [--isolate-joiner] [--evict-ms 1000]
#                         [--first 300] [--gap 250] [--restart-delay 1] [--rank 2]
#                         [--config configs/fmnist-mlp.toml] [--analyze-only]
#
# --isolate-joiner: the rank that is killed runs alone on the last CPU, in every incarnation,
# and the others share the rest (taskset), as on a cluster where a joiner has cores of its
# own: its start, state transfer and catch-up take no CPU time from the healthy ranks, and
# the steps before a kill are like those after the join. --analyze-only: print the tables again
# from the run in QRING_BENCH_OUT (default runs/bench-join).
#
# The issue "rejoin" asks that a join cost the healthy ranks at most one step's time.
set -euo pipefail
cd "$(dirname "$0")/.."
CONFIG=configs/fmnist-mlp.toml
JOINS=6
PROVIDER=auto
ISOLATE=0
EVICT=1000
FIRST=300
GAP=250
DELAY=1
VICTIM=2
ANALYZE_ONLY=0
while [ $# -gt 0 ]; do
  case "$1" in
    --config) CONFIG=$2; shift 2 ;;
    --joins) JOINS=$2; shift 2 ;;
    --provider) PROVIDER=$2; shift 2 ;;
    --isolate-joiner) ISOLATE=1; shift ;;
    --evict-ms) EVICT=$2; shift 2 ;;
    --first) FIRST=$2; shift 2 ;;
    --gap) GAP=$2; shift 2 ;;
    --restart-delay) DELAY=$2; shift 2 ;;
    --rank) VICTIM=$2; shift 2 ;;
    --analyze-only) ANALYZE_ONLY=1; shift ;;
    *) echo "bench_join.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
for v in JOINS EVICT FIRST GAP VICTIM; do
  [[ ${!v} =~ ^[0-9]+$ ]] || { echo "bench_join.sh: --${v,,} needs a whole number" >&2; exit 2; }
done
[[ $DELAY =~ ^[0-9]+(\.[0-9]+)?$ ]] || { echo "bench_join.sh: --restart-delay needs seconds" >&2; exit 2; }
[ "$JOINS" -ge 1 ] || { echo "bench_join.sh: --joins must be at least 1" >&2; exit 2; }
[ "$VICTIM" -ge 1 ] && [ "$VICTIM" -le 3 ] ||
  { echo "bench_join.sh: --rank must be 1, 2 or 3 (rank 0 writes the metrics)" >&2; exit 2; }
BUILD=${QRING_BUILD:-build}
OUT=${QRING_BENCH_OUT:-runs/bench-join}
NAME=joins
METRICS="$OUT/$NAME/metrics.jsonl"

if [ "$ANALYZE_ONLY" = 0 ]; then
  [ -x "$BUILD/train/qring-train" ] || QRING_TARGETS="qring-train qring-launch" scripts/build.sh "$BUILD"
  mkdir -p "$OUT"
  rm -rf "${OUT:?}/$NAME"
  # Enough steps for every cycle (eviction, restart and catch-up take a few hundred steps
  # here), and no evaluation before the end.
  STEPS=$(( FIRST + JOINS * (GAP + 400) + 200 ))
  # A restarted incarnation waits --restart-delay seconds before it starts, so that the
  # three healthy ranks step alone for a while after the eviction: their pace then is what
  # the steps up to the joiner's first counted contribution are compared with.
  PIN=""
  BIND=()
  if [ "$ISOLATE" = 1 ]; then
    last=$(( $(nproc) - 1 ))
    [ "$last" -ge 1 ] || { echo "bench_join.sh: --isolate-joiner needs 2 CPUs or more" >&2; exit 2; }
    PIN='if [ "$QRING_RANK" = '"$VICTIM"' ]; then set -- taskset -c '"$last"' "$@"; '`
        `'else set -- taskset -c 0-'"$(( last - 1 ))"' "$@"; fi; '
    BIND=(--bind none)
    echo "rank $VICTIM (every incarnation) alone on CPU $last, the other ranks on CPUs 0-$(( last - 1 ))"
  fi
  WRAP=(bash -c 'if [ "${QRING_RESTART:-0}" != 0 ]; then sleep '"$DELAY"'; fi; '"$PIN"'exec "$@"' wrap)
  echo "config $CONFIG, $STEPS steps, $JOINS SIGKILLs of rank $VICTIM (step $FIRST, then $GAP steps after each rejoin), provider $PROVIDER, evict_ms $EVICT"
  "$BUILD/net/qring-launch" -n 4 --tolerate-failures 1 --max-restarts "$JOINS" ${BIND[@]+"${BIND[@]}"} -- \
    ${WRAP[@]+"${WRAP[@]}"} "$BUILD/train/qring-train" --config "$CONFIG" "run.out_dir=$OUT" \
    "run.name=$NAME" log.progress=false "train.steps=$STEPS" train.eval_every=1000000000 \
    quorum.quorum=3 "quorum.evict_ms=$EVICT" "net.provider=$PROVIDER" > "$OUT/$NAME.log" 2>&1 &
  launcher=$!
  count() { local n; n=$(grep -c "\"type\":\"$1\"" "$METRICS" 2>/dev/null) || true; echo "${n:-0}"; }
  victim_pid() {
    local p
    for p in $(pgrep -x qring-train); do
      tr '\0' '\n' < "/proc/$p/environ" 2>/dev/null | grep -qx "QRING_RANK=$VICTIM" && { echo "$p"; return; }
    done
    return 0
  }
  # Waits (at most 120 s, and never past the launcher's end) until `cond` holds.
  wait_for() {
    local until=$(( SECONDS + 120 ))
    until eval "$1"; do
      kill -0 "$launcher" 2>/dev/null || return 1
      [ "$SECONDS" -lt "$until" ] || { echo "bench_join.sh: timed out waiting for: $2" >&2; return 1; }
      sleep 0.02
    done
  }
  killed=0
  for ((j = 0; j < JOINS; j++)); do
    if [ "$j" = 0 ]; then
      wait_for '[ "$(count step)" -ge "$FIRST" ]' "step $FIRST" || break
    else
      wait_for '[ "$(count rejoin)" -ge "$j" ]' "rejoin $j" || break
      at=$(count step)
      wait_for '[ "$(count step)" -ge $(( at + GAP )) ]' "$GAP steps after rejoin $j" || break
    fi
    pid=$(victim_pid)
    [ -n "$pid" ] || { echo "bench_join.sh: no process of rank $VICTIM found" >&2; break; }
    kill -KILL "$pid" && killed=$(( killed + 1 ))
    echo "  SIGKILL $killed of rank $VICTIM (pid $pid) at about step $(count step)"
  done
  status=0
  wait "$launcher" || status=$?
  echo "  launcher: exit $status"
  [ "$killed" = "$JOINS" ] || { echo "bench_join.sh: only $killed of $JOINS kills happened" >&2; exit 1; }
fi

python3 - "$OUT" "$NAME" <<'PY'
import json, math, statistics, sys
out, name = sys.argv[1], sys.argv[2]
wall, views, rejoins = {}, [], []
for line in open(f"{out}/{name}/metrics.jsonl"):
    j = json.loads(line)
    if j["type"] == "step":
        wall[j["step"]] = j["wall_s"]
    elif j["type"] == "view":
        views.append(j)
    elif j["type"] == "rejoin":
        rejoins.append(j)
dt = {s: 1000 * (wall[s] - wall[s - 1]) for s in wall if s - 1 in wall}
last = max(dt)

# Each loss: the step its view was logged at, and the last step before the lost rank's last
# sign of life (the kill).
losses = []
for v in views:
    if v["left"]:
        t_kill = v["wall_s"] - max(l["silent_ms"] for l in v["left"]) / 1000
        kill_step = max((s for s, w in wall.items() if w <= t_kill), default=0)
        losses.append((v["step"], kill_step))
joins = []
for r in rejoins:
    loss = max((l for l in losses if l[0] <= r["join_step"]), default=None)
    later = [ks for _, ks in losses if ks > r["counted_step"]]
    joins.append((r["join_step"], r["counted_step"], loss, min(later) if later else last))
if not joins:
    print("no rejoin in the run: see", f"{out}/{name}.log")
    sys.exit(1)

def mean_se(v):
    m = statistics.mean(v)
    return m, (statistics.stdev(v) / math.sqrt(len(v)) if len(v) > 1 else float("nan"))

# Until the joiner is counted, the steps are those of three contributors out of three: their
# baseline is the median step between the eviction and the window (the restart waits
# --restart-delay for it). From the first step that counts it, four
# ranks step with a quorum of three (the slowest is dropped): their baseline is the median of
# the steady stretch after the join.
rows, costs, costs_steps, adm, controls, controls_steps = [], [], [], [], [], []
for join_step, counted, loss, next_kill in joins:
    if loss is None:
        print(f"join at step {join_step}: no loss before it, left out")
        continue
    left_step, _ = loss
    first = max(join_step - 8, left_step + 1)
    window = [s for s in range(first, counted + 5) if s in dt]
    absent = [s for s in range(left_step + 3, first) if s in dt]
    steady = [s for s in range(counted + 10, next_kill - 5) if s in dt]
    if len(steady) < 3 * len(window) or len(absent) < 15:
        print(f"join at step {join_step}: {len(absent)} steps before it and {len(steady)} "
              "after it to compare with, too few; left out")
        continue
    base_before = statistics.median(dt[s] for s in absent)
    base = statistics.median(dt[s] for s in steady)
    cost = sum(dt[s] - (base_before if s < counted else base) for s in window)
    costs.append(cost)
    costs_steps.append(cost / base_before)
    adm.append((dt[join_step] - base_before) / base_before)
    n = len(window)
    mine = [sum(dt[s] - base for s in steady[a:a + n]) for a in range(0, len(steady) - n + 1, n)]
    controls += mine
    controls_steps += [c / base for c in mine]
    rows.append(f"| {join_step} → {counted} | {n} | {base_before:.2f} / {base:.2f} | "
                f"{dt[join_step]:.1f} | {cost:+.0f} ({cost / base_before:+.1f}) | "
                f"{min(mine):+.0f} to {max(mine):+.0f} |")
print()
print("| admitted → counted (step) | window (steps) | median step before / after (ms) | admission step (ms) "
      "| join cost, ms (steps) | windows without a join (ms) |")
print("|---|---|---|---|---|---|")
print("\n".join(rows))
m, se = mean_se(costs_steps)
cm, cse = mean_se(controls_steps)
sd = statistics.stdev(controls_steps) if len(controls_steps) > 1 else float("nan")
am, ase = mean_se(adm)
print()
print(f"{len(costs)} joins: cost {m:+.2f} ± {se:.2f} steps (mean ± standard error; "
      f"{statistics.mean(costs):+.1f} ms); {len(controls)} windows without a join: "
      f"{cm:+.2f} ± {cse:.2f} steps (sd {sd:.2f}); difference {m - cm:+.2f} steps")
print(f"admission step alone: {am:+.2f} ± {ase:.2f} steps beyond the median step before it")
print(f"at most one step's time (issue 'rejoin'): "
      f"{'yes' if m - cm + se <= 1 else ('within the standard error' if m - cm - se <= 1 else 'NO')}")
PY
