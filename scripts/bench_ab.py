#!/usr/bin/env python3
"""Side-by-side comparison of qring-bench configurations or builds, in rotating order.

  scripts/bench_ab.py --ranks N --provider P --rounds R
                      (--config "ARGS" ... | --bin PATH ...) -- COMMON_ARGS

Each round runs every configuration once (qring-launch -n N --provider P -- BENCH COMMON_ARGS
CONFIG_ARGS), starting one further along each round (A B C, B C A, C A B, ...), so neither
the machine's drift nor the order favours one. Prints per size the median out-of-place and
in-place time of each configuration and the median over rounds of its time divided by the
first configuration's time in the same round, with a 95 % confidence interval of that median
(distribution-free: order statistics of the ratios, binomial(n, 1/2); it needs 6 rounds or
more) and the range of those ratios. A 5 % difference on this machine, where one round's ratio
spans 0.6-1.7, needs about 100 rounds to show.
With --op quorum (its table: size count p50 p99 max busbw contrib dropped #wrong) it prints
per size the median p50/p99 step latency and the ratios of p50.

--config: extra qring-bench flags per configuration ("" for the defaults), one build; leading
          NAME=VALUE words are environment variables for that configuration's run
          (e.g. --config "QRING_TCP_CONGESTION=system").
--bin: one qring-bench binary per configuration (e.g. an old build in a git worktree).
          Builds before 403cab0 fill their buffers element by element (verifiable::fill_pattern),
          a quarter of a rank's CPU at 1 MiB whose speed moves with the code's placement: build
          an old commit with the current collectives/verifiable.h to compare libraries only.
Environment: QRING_BUILD (default build) for qring-launch and the default qring-bench.

Example (one lane against the default on 2 ranks over shm):
  scripts/bench_ab.py --ranks 2 --provider shm --rounds 5 --config "" --config "--inflight 1" \\
      -- -b 4M -e 64M -f 4 -n 20 -w 3 -c 0
Quorum steps, quorum 3 against all 4 ranks:
  scripts/bench_ab.py --ranks 4 --provider tcp --rounds 4 --config "--quorum 3" --config "" \\
      -- --op quorum -b 64K -e 1M -n 50 -w 5
"""
import argparse
import math
import os
import re
import shlex
import statistics
import subprocess
import sys

# Table rows as qring-launch prefixes them. Collectives (rank 0): size count type redop root
# | out-of-place time algbw busbw #wrong | in-place time ... -> size, oop time, in-place time.
ROW = re.compile(r"\[rank 0\]\s+(\d+)\s+\d+\s+\S+\s+\S+\s+\S+\s+([\d.]+)\s+\S+\s+\S+\s+\S+\s+([\d.]+)")
# --op quorum (printed by the coordinator, which need not be rank 0): size count p50 p99 max
# busbw contrib dropped #wrong [| compare columns] -> size, p50, p99.
QROW = re.compile(r"\[rank \d+\]\s+(\d+)\s+\d+\s+([\d.]+)\s+([\d.]+)\s+[\d.]+\s+[\d.]+\s+[\d.]+"
                  r"\s+\d+\s+\d+(\s+\|.*)?\s*$")


def median_ci(xs, level=0.95):
    """A distribution-free confidence interval of the median of xs: (lo, hi) order statistics
    such that P(x_(j) <= median <= x_(k)) >= level for independent draws; None when there are
    too few values for any interval at that level."""
    n = len(xs)
    xs = sorted(xs)
    pmf = [math.comb(n, i) / 2 ** n for i in range(n + 1)]
    if 2 * pmf[0] > 1 - level:
        return None
    # j: the largest index with 2 P(B <= j) <= 1 - level, B ~ binomial(n, 1/2): the median
    # lies outside xs[j]..xs[n - 1 - j] with that probability.
    j, tail = 0, pmf[0]
    while j + 1 <= n // 2 and 2 * (tail + pmf[j + 1]) <= 1 - level:
        tail += pmf[j + 1]
        j += 1
    return xs[j], xs[n - 1 - j]


def ratio_cell(ro):
    """median [95 % interval] (range) of one configuration's ratios."""
    ci = median_ci(ro)
    band = f" [{ci[0]:.2f}-{ci[1]:.2f} 95%]" if ci else ""
    return f"{statistics.median(ro):.2f}{band} ({min(ro):.2f}-{max(ro):.2f})"


def main():
    argv = sys.argv[1:]
    common = []
    if "--" in argv:
        i = argv.index("--")
        argv, common = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, required=True)
    ap.add_argument("--provider", required=True)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--config", action="append", default=[])
    ap.add_argument("--bin", action="append", default=[])
    a = ap.parse_args(argv)
    if bool(a.config) == bool(a.bin) or len(a.config or a.bin) < 2:
        ap.error("give two or more --config, or two or more --bin")
    build = os.environ.get("QRING_BUILD", "build")
    launch = os.path.join(build, "net", "qring-launch")
    default_bench = os.path.join(build, "collectives", "qring-bench")
    if a.config:
        runs = []
        for c in a.config:
            words = shlex.split(c)
            env = {}
            while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):
                k, v = words.pop(0).split("=", 1)
                env[k] = v
            runs.append((c or "default", default_bench, words, env))
    else:
        runs = [(b, b, [], {}) for b in a.bin]
    for path in [launch] + [r[1] for r in runs]:
        if not os.access(path, os.X_OK):
            sys.exit(f"bench_ab.py: {path} is missing (build qring-bench and qring-launch)")

    res = [dict() for _ in runs]  # per config: size -> list of (round, oop, ip) or (round, p50, p99)
    quorum = False  # rows of --op quorum seen
    for rnd in range(a.rounds):
        for k in range(len(runs)):
            i = (rnd + k) % len(runs)
            name, bench, extra, env = runs[i]
            cmd = [launch, "-n", str(a.ranks), "--provider", a.provider, "--", bench] + common + extra
            p = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **env})
            if p.returncode != 0:
                sys.exit(f"bench_ab.py: {' '.join(cmd)} failed ({p.returncode}):\n{p.stdout[-2000:]}{p.stderr[-2000:]}")
            for line in p.stdout.splitlines():
                m = ROW.match(line) or QROW.match(line)
                if m:
                    quorum = quorum or m.re is QROW
                    res[i].setdefault(int(m.group(1)), []).append((rnd, float(m.group(2)), float(m.group(3))))
        print(f"round {rnd + 1}/{a.rounds} done", file=sys.stderr)

    if not any(res):
        sys.exit("bench_ab.py: no table rows in the output (neither collective nor --op quorum)")
    if quorum:
        print(f"{a.ranks} ranks, {a.provider}, {a.rounds} rounds; quorum step latency in us (p50/p99),"
              f" ratio = p50 / {runs[0][0]}'s p50 in the same round (median [95 % interval of the"
              f" median] (range))")
    else:
        print(f"{a.ranks} ranks, {a.provider}, {a.rounds} rounds; times in us (out-of-place/in-place),"
              f" ratio = this / {runs[0][0]} in the same round (out-of-place: median [95 % interval of"
              f" the median] (range); in-place: median)")
    for size in sorted(res[0]):
        base = {r: (o, ip) for r, o, ip in res[0][size]}
        cells = []
        for (name, _, _, _), rr in zip(runs, res):
            v = rr.get(size, [])
            if not v:
                continue
            ro = [o / base[r][0] for r, o, _ in v if r in base and base[r][0] > 0]
            ri = [ip / base[r][1] for r, _, ip in v if r in base and base[r][1] > 0]
            med = f"{statistics.median(x[1] for x in v):.0f}/{statistics.median(x[2] for x in v):.0f}"
            if not ro:
                cells.append(f"{name}: {med} r -")
            elif quorum:
                cells.append(f"{name}: {med} r {ratio_cell(ro)}")
            else:
                mi = f"{statistics.median(ri):.2f}" if ri else "-"
                cells.append(f"{name}: {med} r {ratio_cell(ro)} in-place r {mi}")
        print(f"{size:>10} | " + " | ".join(cells))


if __name__ == "__main__":
    main()
