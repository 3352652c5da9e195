#!/usr/bin/env bash
# qring's collectives against OpenMPI's on one host: the same sizes, data, check and table
# (qring-bench and qring-mpi-bench share collectives/bench/bench_common.h).
#
#   scripts/bench_vs_mpi.sh [--quick] [--op allreduce] [--pairs N] [--ranks "2 4"]
#                           [--transports "shm tcp"] [--bind cores|none] [--out DIR]
#
# Configurations: ranks x transport, where
#   shm: qring-launch -n N --provider shm -- qring-bench ...
#        vs mpirun --allow-run-as-root --oversubscribe -np N qring-mpi-bench ... (OpenMPI's
#        default selection: ob1 + vader shared memory)
#   tcp: qring-launch -n N --provider tcp -- qring-bench ...   ("tcp;ofi_rxm" over loopback)
#        vs mpirun ... --mca pml ob1 --mca btl tcp,self --mca btl_tcp_if_include lo ...
# Both bind their ranks the same way (--bind cores, the default): qring-launch's default
# binding (rank r on CPU r mod CPUs when ranks > CPUs, else a block each) and
# mpirun --map-by core:OVERSUBSCRIBE --bind-to core:overload-allowed, which places the ranks
# on the same CPUs. --bind none: qring-launch --bind none and mpirun --bind-to none.
# Each configuration runs interleaved pairs (qring, mpi, qring, mpi, ...; default 2 pairs).
# Sizes 4K..256M (x4), or 4K..16M (x16) with --quick; per size as many iterations (at most
# 200) as fit in ~0.3 s (--auto-iters), warmup up to 5, results checked bit-exactly.
# Prints per configuration and size the median out-of-place busbw of both, their ratio
# qring/mpi, and the time ratio at 4 KiB (latency). Writes OUT/vs_mpi_summary.{json,md} and
# the raw JSON of every run under OUT/raw/. Extra mpirun flags: $QRING_MPIRUN_FLAGS.
#
# Environment: QRING_BUILD (build directory, default build; built here if needed).
set -euo pipefail
cd "$(dirname "$0")/.."

QUICK=0
OP=allreduce
PAIRS=2
RANKS_LIST="2 4"
TRANSPORTS="shm tcp"
BIND=cores
OUT=runs/bench
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) QUICK=1; shift ;;
    --op) OP=$2; shift 2 ;;
    --pairs) PAIRS=$2; shift 2 ;;
    --ranks) RANKS_LIST=$2; shift 2 ;;
    --transports) TRANSPORTS=$2; shift 2 ;;
    --bind) BIND=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    -h|--help) sed -n '2,26p' "$0"; exit 0 ;;
    *) echo "bench_vs_mpi.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done

if [ "$QUICK" = 1 ]; then
  SWEEP=(-b 4K -e 16M -f 16 -n 200 -w 3 --auto-iters 0.1)
else
  SWEEP=(-b 4K -e 256M -f 4 -n 200 -w 5 --auto-iters 0.3)
fi

BUILD=${QRING_BUILD:-build}
BENCH=$BUILD/collectives/qring-bench
MPIBENCH=$BUILD/collectives/qring-mpi-bench
LAUNCH=$BUILD/net/qring-launch
if [ ! -x "$BENCH" ] || [ ! -x "$LAUNCH" ] || [ ! -x "$MPIBENCH" ]; then
  echo "== building qring-bench, qring-mpi-bench and qring-launch in $BUILD"
  cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release >/dev/null
  cmake --build "$BUILD" -j "${QRING_JOBS:-2}" --target qring-bench qring-mpi-bench qring-launch
fi
[ -x "$MPIBENCH" ] || { echo "bench_vs_mpi.sh: qring-mpi-bench was not built (MPI missing?)" >&2; exit 1; }

echo "load average at start: $(cut -d" " -f1-3 /proc/loadavg) on $(nproc) cores" >&2
mkdir -p "$OUT/raw"
case "$BIND" in
  cores) MPIBIND=(--map-by core:OVERSUBSCRIBE --bind-to core:overload-allowed) ;;
  none) MPIBIND=(--bind-to none) ;;
  *) echo "bench_vs_mpi.sh: --bind expects cores or none, got '$BIND'" >&2; exit 2 ;;
esac
MPIRUN=(mpirun --allow-run-as-root --oversubscribe "${MPIBIND[@]}")
# shellcheck disable=SC2206
MPIRUN+=(${QRING_MPIRUN_FLAGS:-})
start=$(date +%s)

run_one() {  # tool ranks transport pair
  local tool=$1 n=$2 tr=$3 pair=$4
  local json="$OUT/raw/${OP}_${tool}_${n}r_${tr}_p${pair}.json" log
  log="${json%.json}.log"
  if [ "$tool" = qring ]; then
    timeout 900 "$LAUNCH" -n "$n" --provider "$tr" --bind "$BIND" -- "$BENCH" --op "$OP" "${SWEEP[@]}" \
      --json "$json" >"$log" 2>&1
  else
    local net=()
    [ "$tr" = tcp ] && net=(--mca pml ob1 --mca btl tcp,self --mca btl_tcp_if_include lo)
    timeout 900 "${MPIRUN[@]}" "${net[@]}" -np "$n" "$MPIBENCH" --op "$OP" "${SWEEP[@]}" \
      --json "$json" >"$log" 2>&1
  fi || {
    echo "bench_vs_mpi.sh: $tool, $n ranks, $tr, pair $pair failed (log $log):" >&2
    tail -20 "$log" >&2
    return 1
  }
  echo "  $tool $n ranks $tr pair $pair: done ($(($(date +%s) - start)) s)" >&2
}

for n in $RANKS_LIST; do
  for tr in $TRANSPORTS; do
    for pair in $(seq 1 "$PAIRS"); do
      run_one qring "$n" "$tr" "$pair"
      run_one mpi "$n" "$tr" "$pair"
    done
  done
done

python3 - "$OUT" "$OP" "$PAIRS" "$RANKS_LIST" "$TRANSPORTS" "$QUICK" <<'EOF'
import json, statistics, sys
out, op, pairs, ranks_list, transports, quick = sys.argv[1:7]
pairs = int(pairs)
summary = {"op": op, "pairs": pairs, "quick": quick == "1", "configs": []}
lines = []
for n in ranks_list.split():
    for tr in transports.split():
        per = {}
        for tool in ("qring", "mpi"):
            for p in range(1, pairs + 1):
                for r in json.load(open(f"{out}/raw/{op}_{tool}_{n}r_{tr}_p{p}.json")):
                    if r["wrong"]:
                        sys.exit(f"{tool} {n} ranks {tr}: {r['wrong']} wrong elements at {r['bytes']} B")
                    key = (r["bytes"], r["in_place"])
                    per.setdefault(key, {}).setdefault(tool, []).append(r)
        cfg = {"ranks": int(n), "transport": tr, "sizes": []}
        lines.append(f"## {op}, {n} ranks, {tr} (qring provider "
                     f"{next(iter(per.values()))['qring'][0]['provider']} vs OpenMPI)")
        lines.append(f"{'size':>10} {'qring busbw':>12} {'mpi busbw':>10} {'ratio':>6}"
                     f" {'qring us':>10} {'mpi us':>10} {'pair ratios':>12}"
                     f"   (out-of-place, medians of {pairs}; pair ratios: min-max over the pairs)")
        for (b, ip), v in sorted(per.items()):
            med = lambda tool, k: statistics.median(x[k] for x in v[tool])
            e = {"bytes": b, "in_place": ip}
            for tool in ("qring", "mpi"):
                e[f"{tool}_busbw_gbps"] = med(tool, "busbw_gbps")
                e[f"{tool}_time_us"] = med(tool, "time_us")
                e[f"{tool}_busbw_runs"] = [x["busbw_gbps"] for x in v[tool]]
            e["busbw_ratio"] = e["qring_busbw_gbps"] / e["mpi_busbw_gbps"] if e["mpi_busbw_gbps"] else None
            # Pair i: qring run i and the OpenMPI run right after it (same machine state).
            e["pair_busbw_ratios"] = [q["busbw_gbps"] / m["busbw_gbps"]
                                      for q, m in zip(v["qring"], v["mpi"]) if m["busbw_gbps"]]
            e["time_ratio"] = e["qring_time_us"] / e["mpi_time_us"] if e["mpi_time_us"] else None
            cfg["sizes"].append(e)
            if not ip:
                lines.append(f"{b:>10} {e['qring_busbw_gbps']:>12.3f} {e['mpi_busbw_gbps']:>10.3f}"
                             f" {e['busbw_ratio']:>6.2f} {e['qring_time_us']:>10.1f}"
                             f" {e['mpi_time_us']:>10.1f}"
                             f" {min(e['pair_busbw_ratios']):>5.2f}-{max(e['pair_busbw_ratios']):<5.2f}")
        small = [e for e in cfg["sizes"] if e["bytes"] == 4096 and not e["in_place"]]
        if small:
            cfg["latency_ratio_4k"] = small[0]["time_ratio"]
            lines.append(f"latency ratio at 4 KiB (qring time / mpi time): {small[0]['time_ratio']:.2f}")
        lines.append("")
        summary["configs"].append(cfg)
print("\n".join(lines))
json.dump(summary, open(f"{out}/vs_mpi_summary.json", "w"), indent=1)
with open(f"{out}/vs_mpi_summary.md", "w") as f:
    f.write("```\n" + "\n".join(lines) + "```\n")
EOF
echo "took $(($(date +%s) - start)) s; summary: $OUT/vs_mpi_summary.json $OUT/vs_mpi_summary.md, raw: $OUT/raw/"
echo "load average at end: $(cut -d" " -f1-3 /proc/loadavg) (the numbers above are only as quiet as the machine was)"
