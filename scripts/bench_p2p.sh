#!/usr/bin/env bash
# Point-to-point bandwidth of qring's endpoint against libfabric's own fi_pingpong, on one host.
#
#   scripts/bench_p2p.sh [--pairs N] [--iters N] [--providers "shm tcp"] [--spin] [--pin]
#                        [--out DIR]
#
# For each provider (shm, tcp = "tcp;ofi_rxm"), runs interleaved pairs (A B A B ...):
#   A: fi_pingpong -e rdm -p P -I ITERS -S SIZE   (server and client on 127.0.0.1; untagged
#      messages, busy-polling the completion queue)
#   B: qring-launch -n 2 --provider P -- qring-bench --op sendrecv -b 1M -e 16M -f 16
#      (tagged messages, the endpoint's spin-yield-sleep wait; --spin adds a third contender
#      C that busy-polls like fi_pingpong)
# --pin binds both tools' two processes to CPUs 0 and 1 (taskset), the same way for both.
# Both report one-way bandwidth from a ping-pong: size / (round trip / 2), GB = 1e9 bytes.
# Prints per provider and size the median of each tool and the ratio qring / fi_pingpong.
# Target: ratio >= 0.9 at 1 MiB and 16 MiB. Raw results: OUT/p2p_raw.tsv, summary:
# OUT/p2p_summary.{json,md}.
#
# Environment: QRING_BUILD (build directory, default build; built here if the binaries are
# missing).
set -euo pipefail
cd "$(dirname "$0")/.."

PAIRS=3
ITERS=100
WARMUP=10
PROVIDERS="shm tcp"
SPIN=0
PIN=0
OUT=runs/bench
while [ $# -gt 0 ]; do
  case "$1" in
    --pairs) PAIRS=$2; shift 2 ;;
    --iters) ITERS=$2; shift 2 ;;
    --providers) PROVIDERS=$2; shift 2 ;;
    --spin) SPIN=1; shift ;;
    --pin) PIN=1; shift ;;
    --out) OUT=$2; shift 2 ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    *) echo "bench_p2p.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done

BUILD=${QRING_BUILD:-build}
BENCH=$BUILD/collectives/qring-bench
LAUNCH=$BUILD/net/qring-launch
if [ ! -x "$BENCH" ] || [ ! -x "$LAUNCH" ]; then
  echo "== building qring-bench and qring-launch in $BUILD"
  cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release >/dev/null
  cmake --build "$BUILD" -j "${QRING_JOBS:-2}" --target qring-bench qring-launch
fi
command -v fi_pingpong >/dev/null || { echo "bench_p2p.sh: fi_pingpong not found (libfabric-bin)" >&2; exit 1; }

echo "load average at start: $(cut -d" " -f1-3 /proc/loadavg) on $(nproc) cores" >&2
mkdir -p "$OUT"
RAW=$OUT/p2p_raw.tsv
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
printf "pair\tprovider\tsize\ttool\tgbps\n" >"$RAW"
SIZES="1048576 16777216"

NCPU=$(nproc)
pin() {  # pin CPU_INDEX: taskset prefix when --pin
  [ "$PIN" = 1 ] && echo "taskset -c $(($1 % NCPU))"
  return 0
}

fi_prov() { [ "$1" = tcp ] && echo "tcp;ofi_rxm" || echo "$1"; }

# fi_pingpong for one size; prints GB/s (its MB/sec column is size / usec-per-transfer).
run_fi_pingpong() {
  local prov=$1 size=$2 port attempt out
  for attempt in 1 2 3; do
    port=$((20000 + RANDOM % 20000))
    # shellcheck disable=SC2046
    $(pin 0) fi_pingpong -p "$prov" -e rdm -I "$ITERS" -S "$size" -B "$port" >"$TMP/srv" 2>&1 &
    local srv=$!
    sleep 0.3
    # shellcheck disable=SC2046
    if out=$(timeout 120 $(pin 1) fi_pingpong -p "$prov" -e rdm -I "$ITERS" -S "$size" -P "$port" 127.0.0.1 2>&1); then
      wait "$srv" || true
      echo "$out" | awk 'NR > 1 && NF >= 8 { printf "%.4f\n", $6 / 1000.0; exit }'
      return 0
    fi
    kill "$srv" 2>/dev/null || true
    wait "$srv" 2>/dev/null || true
  done
  echo "bench_p2p.sh: fi_pingpong -p '$prov' -S $size failed: $out" >&2
  return 1
}

# qring-bench sendrecv over both sizes; prints "size gbps" lines.
run_qring() {
  local prov=$1; shift
  local wrap=()
  # Rank r on CPU r, like the fi_pingpong server (0) and client (1).
  [ "$PIN" = 1 ] && wrap=(sh -c 'exec taskset -c $((QRING_RANK % $(nproc))) "$@"' sh)
  timeout 300 "$LAUNCH" -n 2 --provider "$prov" -- "${wrap[@]}" "$BENCH" --op sendrecv -b 1M \
    -e 16M -f 16 -n "$ITERS" -w "$WARMUP" --json "$TMP/q.json" "$@" >"$TMP/q.out" 2>&1 || {
    echo "bench_p2p.sh: qring-bench sendrecv over $prov failed:" >&2
    cat "$TMP/q.out" >&2
    return 1
  }
  python3 -c 'import json,sys
for r in json.load(open(sys.argv[1])): print(r["bytes"], "%.4f" % r["algbw_gbps"])' "$TMP/q.json"
}

for pair in $(seq 1 "$PAIRS"); do
  for p in $PROVIDERS; do
    fp=$(fi_prov "$p")
    for s in $SIZES; do
      g=$(run_fi_pingpong "$fp" "$s")
      printf "%s\t%s\t%s\t%s\t%s\n" "$pair" "$p" "$s" fi_pingpong "$g" >>"$RAW"
    done
    run_qring "$p" | while read -r s g; do
      printf "%s\t%s\t%s\t%s\t%s\n" "$pair" "$p" "$s" qring "$g" >>"$RAW"
    done
    if [ "$SPIN" = 1 ]; then
      run_qring "$p" --spin | while read -r s g; do
        printf "%s\t%s\t%s\t%s\t%s\n" "$pair" "$p" "$s" qring_spin "$g" >>"$RAW"
      done
    fi
    echo "pair $pair/$PAIRS $p done" >&2
  done
done

python3 - "$RAW" "$OUT" <<'EOF'
import csv, json, statistics, sys
raw, out = sys.argv[1], sys.argv[2]
rows = list(csv.DictReader(open(raw), delimiter="\t"))
data = {}
for r in rows:
    data.setdefault((r["provider"], int(r["size"])), {}).setdefault(r["tool"], []).append(float(r["gbps"]))
tools = [t for t in ("qring", "qring_spin") if any(t in v for v in data.values())]
summary = []
hdr = f"{'provider':<9} {'size':>9} {'fi_pingpong GB/s':>17}"
for t in tools:
    hdr += f" {t + ' GB/s':>16} {'ratio':>6}"
lines = [hdr]
for (prov, size), v in sorted(data.items()):
    ref = statistics.median(v["fi_pingpong"])
    line = f"{prov:<9} {size:>9} {ref:>17.3f}"
    entry = {"provider": prov, "bytes": size, "fi_pingpong_gbps": ref,
             "fi_pingpong_runs": v["fi_pingpong"]}
    for t in tools:
        q = statistics.median(v[t])
        line += f" {q:>16.3f} {q / ref:>6.2f}"
        entry[t + "_gbps"] = q
        entry[t + "_runs"] = v[t]
        entry[t + "_ratio"] = q / ref
    lines.append(line)
    summary.append(entry)
print("\n".join(lines))
json.dump(summary, open(f"{out}/p2p_summary.json", "w"), indent=1)
with open(f"{out}/p2p_summary.md", "w") as f:
    f.write("```\n" + "\n".join(lines) + "\n```\n")
EOF
echo "raw: $RAW  summary: $OUT/p2p_summary.json $OUT/p2p_summary.md"
echo "load average at end: $(cut -d" " -f1-3 /proc/loadavg) (the numbers above are only as quiet as the machine was)"
