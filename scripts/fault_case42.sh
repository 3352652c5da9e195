#!/usr/bin/env bash
# Issue 42, cases 4 and 5 by hand (scripts/bench_faults.sh --case N runs this): real
# processes under qring-launch, real SIGKILLs. W=4, quorum 2, evict_ms 1000, the MLP for 4
# epochs, qring-launch --max-restarts 1 --tolerate-failures 2.
#   case 4: rank 1 killed at step 60 and restarted; its donor, rank 0 (the coordinator), is
#           killed as it is about to send the state (QRING_FAULT kill:0:60:donate).
#   case 5: rank 1 killed at step 60 and restarted; rank 0 (the coordinator) is SIGKILLed
#           from outside as soon as rank 1 logs that it rejoined (it then catches up).
# Per run: the launcher's exit, the parameter checksums the ranks logged at the end (one
# expected), and the recovery from rank 0's death: to the first view without it, to the view
# without the joiner's old incarnation (case 4), and to the rejoined rank's admission.
#
#   scripts/fault_case42.sh CASE RUNS PROVIDER BUILD OUT
set -euo pipefail
cd "$(dirname "$0")/.."
CASE=$1 RUNS=$2 PROVIDER=$3 BUILD=$4 OUT=$5
case "$CASE" in 4|5) ;; *) echo "fault_case42.sh: case 4 or 5, not '$CASE'" >&2; exit 2 ;; esac
[ -x "$BUILD/train/qring-train" ] || QRING_TARGETS="qring-train qring-launch" scripts/build.sh "$BUILD"
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)

# The qring-train of rank $1 of the run whose out_dir is $2 (this run's own processes only).
rank_pid() {
  for p in $(pgrep -x qring-train 2>/dev/null || true); do
    tr '\0' '\n' < "/proc/$p/cmdline" 2>/dev/null | grep -qx "run.out_dir=$2" || continue
    tr '\0' '\n' < "/proc/$p/environ" 2>/dev/null | grep -qx "QRING_RANK=$1" && { echo "$p"; return; }
  done
}

for i in $(seq 1 "$RUNS"); do
  name=case$CASE-$PROVIDER-$i
  dir=$OUT/$name
  mkdir -p "$dir"
  log=$dir.log
  fault="kill:1:60:step"
  [ "$CASE" = 4 ] && fault="$fault,kill:0:60:donate"
  : > "$log"
  status=0
  QRING_FAULT=$fault timeout 300 "$BUILD/net/qring-launch" -n 4 --tolerate-failures 2 \
    --max-restarts 1 -- "$BUILD/train/qring-train" --force --config configs/fmnist-mlp.toml \
    "run.out_dir=$dir" run.name=run log.progress=false train.epochs=4 quorum.quorum=2 \
    quorum.evict_ms=1000 "net.provider=$PROVIDER" > "$log" 2>&1 &
  launcher=$!
  if [ "$CASE" = 5 ]; then
    # Rank 0 dies while rank 1, just rejoined, catches up.
    for _ in $(seq 1 1200); do
      if grep -q "\[rank 1\] rank 1 rejoined at step" "$log"; then
        victim=$(rank_pid 0 "$dir")
        if [ -n "$victim" ]; then
          kill -KILL "$victim" && echo "KILLED rank 0 at $(date +%H:%M:%S.%3N)" >> "$dir.kill"
        fi
        break
      fi
      kill -0 "$launcher" 2>/dev/null || break
      sleep 0.05
    done
  fi
  wait "$launcher" || status=$?
  echo "$status" > "$dir.exit"
done

python3 - "$OUT" "$CASE" "$PROVIDER" "$RUNS" <<'PY'
import os, re, sys
from datetime import datetime
out, case, provider, runs = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
stamp = re.compile(r"^\[rank (\d+)\] \[(\d\d:\d\d:\d\d\.\d\d\d)\]")
def t(s):
    return datetime.strptime(s, "%H:%M:%S.%f")
print(f"\ncase {case}, {provider} (shared 2-core machine; no RDMA hardware: shm and tcp libfabric)")
print("| run | launcher exit | checksums | rank 0 dead -> view without it (s) | "
      "-> joiner's old incarnation out (s) | -> rank back (s) | metrics.jsonl steps missing, "
      "twice | summary failures, rejoins (logs) |")
print("|---|---|---|---|---|---|---|---|")
for i in range(1, runs + 1):
    name = f"case{case}-{provider}-{i}"
    base = os.path.join(out, name)
    lines = open(base + ".log", errors="replace").read().splitlines()
    status = open(base + ".exit").read().strip()
    sums = set(re.findall(r"params_checksum ([0-9a-f]{16})", "\n".join(lines)))
    dead = None
    if case == "4":
        for l in lines:
            if "injecting fault kill:0:60:donate" in l and stamp.match(l):
                dead = t(stamp.match(l).group(2))
    elif os.path.exists(base + ".kill"):
        dead = t(open(base + ".kill").read().split()[-1])
    def first(pred):
        for l in lines:
            m = stamp.match(l)
            if m and dead and t(m.group(2)) >= dead and pred(l):
                return (t(m.group(2)) - dead).total_seconds()
        return None
    no0 = first(lambda l: re.search(r"quorum: view \d+: members .*left: .*rank 0 \(", l))
    no1 = first(lambda l: re.search(r"quorum: view \d+: members .*left: .*rank 1 \(", l)) \
        if case == "4" else None
    back_rank = "1" if case == "4" else "0"
    back = first(lambda l: f"rank {back_rank} rejoined at step" in l and
                 l.startswith(f"[rank {back_rank}]"))
    f = lambda x: "-" if x is None else f"{x:.2f}"
    # Case 10: each step once in metrics.jsonl; the summary's counts against the logs' (each
    # view's departures as its coordinator logged them, each rejoin as the joiner logged it).
    steps, counts = [], "-"
    try:
        import json
        for l in open(os.path.join(base, "run", "metrics.jsonl")):
            j = json.loads(l)
            if j["type"] == "step":
                steps.append(j["step"])
        s = json.load(open(os.path.join(base, "run", "summary.json")))
        left = {}
        for l in lines:
            m = re.search(r"quorum: view (\d+): members \[[0-9, ]*\]; left: (.*)$", l)
            if m:
                left[m.group(1)] = len(re.findall(r"rank \d+ \(", m.group(2)))
        joins = len(re.findall(r"^\[rank (\d+)\] \[[^]]*\] \[[^]]*\] \[rank \d+\] rank \1 "
                               r"rejoined at step",
                               "\n".join(lines), re.M))
        counts = (f"{s['failures_survived']}, {s['rejoins']} "
                  f"({sum(left.values())}, {joins})")
    except (OSError, ValueError, KeyError):
        pass
    missing = len(set(range(max(steps) + 1)) - set(steps)) if steps else "-"
    twice = len(steps) - len(set(steps)) if steps else "-"
    print(f"| {name} | {status} | {len(sums)}: {' '.join(sorted(sums))} | {f(no0)} | {f(no1)} | "
          f"{f(back)} (rank {back_rank}) | {missing}, {twice} | {counts} |")
PY
