#!/usr/bin/python3
"""The analysis half of scripts/reproduce.sh: Chen et al., "Revisiting Distributed Synchronous
SGD", on qring's own runs (docs/reproduction.md).

    scripts/reproduce.py analyze DIR           tables, plots and the claim table of DIR's runs
    scripts/reproduce.py check DIR             every artefact of analyze there, well formed
    scripts/reproduce.py publish DIR [TABLE...]
                                               DIR's plots and tables into docs/reproduction/,
                                               its claim table and numbers into the marked
                                               blocks of docs/reproduction.md (with TABLEs:
                                               those alone, e.g. validate or bsweep, and the
                                               claims of the page's results with those parts
                                               taken from DIR)
    scripts/reproduce.py calibrate OUT.json BENCH.json... [--min-bytes=N]
                                               the simulator's network model (from rows of
                                               N bytes and more)
    scripts/reproduce.py tune-async DIR PREFIX the best of the async grid DIR/PREFIX-*: its
                                               settings as key=value arguments
    scripts/reproduce.py step-cost RUN_DIR     a run's median step and compute time (ms)
    scripts/reproduce.py post-arrival OUT.json BASE.json RUN_DIR...
                                               BASE with the step costs beyond the decision
                                               that qring-train runs measured, by quorum
    scripts/reproduce.py fake-times OUT RANKS STEPS SEED     a made-up job trace ("STEP RANK
                                                             MS"), for --smoke

DIR is runs/reproduce (reproduce.sh --out): one folder per part (kth, bsweep, bsweep1000,
async, depth, real, validate) of run directories. analyze writes DIR/tables/*.json and *.md,
DIR/plots/*.png, DIR/claims.json and DIR/claims.md; every number is computed here from the
runs' files. Statistics: a claim's number is the mean over seeds with a 95 % interval
(Student's t over the seeds; for ratios of times, over the logarithms of the per-seed ratios,
so a ratio's interval is a geometric one); the optimum b's interval is a bootstrap over the
seeds (the b with the least mean time in each resample); a verdict is given only where the
interval supports it.
"""
import collections
import glob
import json
import math
import os
import random
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import plot  # noqa: E402
import palette  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REGIMES = ["trace", "lognormal", "shiftexp"]  # the b sweep's; the k-th curve adds slow-worker
TAIL_FRACTION = 0.05  # P1: the last 5 % of the gradients ...
TAIL_SHARE = 0.5      # ... take at least half of the spread between the first and the last
SAME_ACCURACY = 0.5   # P2: "the same accuracy": the final accuracy's interval within this (pts)
AUTO_WITHIN = 1.05    # auto within 5 % of the best fixed b
VALIDATION = 0.10     # the simulator within 10 % of the measured step time


def read_json(path):
    with open(path) as f:
        return json.load(f)


# ---------------------------------------------------------------- statistics

# Student's t, 97.5 % quantile, by degrees of freedom (1..30); 1.96 beyond.
T975 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
        2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
        2.060, 2.056, 2.052, 2.048, 2.045, 2.042]


def mean_ci(values):
    """(mean, low, high): the mean and its 95 % interval (t over the values); one value: no
    interval (low = high = None)."""
    v = [x for x in values if x is not None]
    if not v:
        return None, None, None
    m = sum(v) / len(v)
    if len(v) < 2:
        return m, None, None
    sd = math.sqrt(sum((x - m) ** 2 for x in v) / (len(v) - 1))
    h = (T975[len(v) - 2] if len(v) - 1 <= len(T975) else 1.96) * sd / math.sqrt(len(v))
    return m, m - h, m + h


def ratio_ci(pairs):
    """Geometric mean of a / b over the pairs (a, b > 0) and its 95 % interval."""
    logs = [math.log(a / b) for a, b in pairs if a and b]
    m, lo, hi = mean_ci(logs)
    if m is None:
        return None, None, None
    if lo is None:
        return math.exp(m), None, None
    return math.exp(m), math.exp(lo), math.exp(hi)


def fmt_ci(m, lo, hi, digits=2, unit=""):
    if m is None:
        return "-"
    if lo is None:
        return f"{m:.{digits}f}{unit} (one seed)"
    return f"{m:.{digits}f}{unit} [{lo:.{digits}f}, {hi:.{digits}f}]"


def bootstrap_best(table, resamples=2000, seed=1):
    """table: {b: {seed: time}} over the same seeds. The b with the least mean time, and the
    2.5 and 97.5 percentiles of that b over resamples of the seeds (None if every seed of no b
    reached the target)."""
    bs = sorted(table)
    seeds = sorted(set.intersection(*(set(table[b]) for b in bs))) if bs else []
    if not seeds:
        return None, None, None

    def best_of(chosen):
        means = {}
        for b in bs:
            v = [table[b][s] for s in chosen]
            means[b] = math.inf if any(x is None for x in v) else sum(v) / len(v)
        b = min(bs, key=lambda x: (means[x], x))
        return b if math.isfinite(means[b]) else None

    best = best_of(seeds)
    rng = random.Random(seed)
    draws = [best_of([rng.choice(seeds) for _ in seeds]) for _ in range(resamples)]
    draws = sorted(d for d in draws if d is not None)
    if not draws:
        return best, None, None
    return best, draws[int(0.025 * (len(draws) - 1))], draws[int(0.975 * (len(draws) - 1))]


# ---------------------------------------------------------------- reading runs

def time_to_target(evals, target):
    """Training time at which the test accuracy first reaches `target`, interpolated linearly
    between the evaluation before and the first at or above it (None: never)."""
    prev = None
    for _, t, a in evals:
        if a >= target:
            if prev is None or a == prev[1]:
                return t
            return prev[0] + (target - prev[1]) / (a - prev[1]) * (t - prev[0])
        prev = (t, a)
    return None


def run(run_dir):
    """What the tables need of one run directory (qring-train or qring-sim)."""
    s = read_json(os.path.join(run_dir, "summary.json"))
    evals = plot.train_time_evals(run_dir)
    target = s.get("target_accuracy")
    if target is None:
        m = re.search(r"^target_accuracy\s*=\s*([0-9.eE+-]+)",
                      open(os.path.join(run_dir, "config.toml")).read(), re.M)
        target = float(m.group(1)) if m else 0
    return {
        "name": os.path.basename(os.path.normpath(run_dir)),
        "dir": run_dir,
        "summary": s,
        "method": palette.method_of(s),
        "final": 100 * s.get("test_accuracy", 0),
        "ttt": time_to_target(evals, target) if target else None,
        "target": target,
        "evals": evals,
        "staleness": s.get("staleness_mean"),
    }


def runs(d, pattern=r"(.*)"):
    """{name: run} of the run directories in d whose name matches `pattern` (whole name)."""
    out = {}
    for p in sorted(glob.glob(os.path.join(d, "*"))):
        name = os.path.basename(p)
        if os.path.exists(os.path.join(p, "summary.json")) and re.fullmatch(pattern, name):
            out[name] = run(p)
    return out


def by_seed(rs, pattern):
    """{key: {seed: run}} of the runs whose name matches pattern (named groups key, seed)."""
    out = {}
    for name, r in rs.items():
        m = re.fullmatch(pattern, name)
        if m:
            out.setdefault(m.group("key"), {})[int(m.group("seed"))] = r
    return out


# ---------------------------------------------------------------- calibration

SMALL_ALLREDUCE_BYTES = 32 * 1024  # collectives/ring.h, as train/sim.cc
HALVING_DOUBLING_BYTES = 1 << 20


def allreduce_rounds(k, nbytes):
    """Dependent message rounds of qring's all-reduce among k ranks (sim_allreduce_rounds)."""
    if k <= 1:
        return 0
    lg = k.bit_length() - 1
    pow2 = k & (k - 1) == 0
    if nbytes <= SMALL_ALLREDUCE_BYTES:
        return lg + (0 if pow2 else 2)
    if pow2 and nbytes <= HALVING_DOUBLING_BYTES:
        return 2 * lg
    return 2 * (k - 1)


def calibrate(out, bench_files, min_bytes=0):
    """The simulator's network model from qring-bench --op quorum --compare-allreduce rows
    (the quorum op and the plain all-reduce alternating step by step, sizes 4 KiB up) of 2
    ranks, each with a core of its own as each simulated worker: alpha and beta of
    rounds(k, bytes) alpha + 2 (k - 1)/k bytes beta, fitted by least squares in the relative
    error to the all-reduce's medians; rtt, the READY/DECIDE round trip, the quorum-1 op's
    median at the smallest size (its reduction is empty). Rows run with --straggler
    shiftexp:IDLE:0 (every rank sleeps IDLE ms before each step) give, by contributor count
    N, the measured time of a step beyond its contributors' arrival (step_cost_ms), which
    the simulator then uses for those N instead of the model."""
    rows, duty = [], []
    for f in bench_files:
        data = read_json(f)
        for r in data if isinstance(data, list) else [data]:
            m = re.match(r"shiftexp:([0-9.]+):0$", r.get("straggler", ""))
            if m:
                r["idle_ms"] = float(m.group(1))
                duty.append(r)
            else:
                rows.append(r)
    ar = [r for r in rows if r.get("op") == "allreduce" and r.get("compare_allreduce")
          and r.get("ranks", 1) > 1]
    # Sizes within a rate-capped link's burst (tbf passes its bucket at full speed) say
    # nothing about the rate: only rows of at least min_bytes are fitted.
    two = [r for r in ar if r["ranks"] == 2 and r["p50_us"] > 0 and r["bytes"] >= min_bytes]
    if len(two) < 2:
        sys.exit("calibrate: needs 2-rank all-reduce rows (qring-bench -n 2 --op quorum "
                 "--quorum 1 --compare-allreduce) at two or more sizes")

    def x_of(r):  # the model's two terms, relative to the measurement (beta in ns/byte)
        k, n, t = r["ranks"], r["bytes"], r["p50_us"]
        return allreduce_rounds(k, n) / t, 2 * (k - 1) / k * n / 1000.0 / t

    def fit_rows(use):
        s11 = s12 = s22 = b1 = b2 = 0.0
        for r in use:
            x1, x2 = x_of(r)
            s11, s12, s22, b1, b2 = s11 + x1 * x1, s12 + x1 * x2, s22 + x2 * x2, b1 + x1, b2 + x2
        det = s11 * s22 - s12 * s12
        a = (b1 * s22 - b2 * s12) / det if det else -1
        b = (s11 * b2 - s12 * b1) / det if det else -1
        if a < 0 or b < 0:  # not physical (noise): the better one-term fit
            err = lambda a_, b_: sum((a_ * x1 + b_ * x2 - 1) ** 2 for x1, x2 in map(x_of, use))  # noqa
            a1, b1_ = b1 / s11, b2 / s22
            a, b = (a1, 0.0) if err(a1, 0) < err(0, b1_) else (0.0, b1_)
        return a, b

    def model_us(r, a, b):
        return allreduce_rounds(r["ranks"], r["bytes"]) * a + \
            2 * (r["ranks"] - 1) / r["ranks"] * r["bytes"] * b / 1000.0

    # One pass of outlier rejection: a row the first fit misses by more than 3x (a step
    # descheduled by other work on this machine) is left out of the second.
    alpha, beta = fit_rows(two)
    kept = [r for r in two if 1 / 3 <= model_us(r, alpha, beta) / r["p50_us"] <= 3]
    if len(kept) >= 2 and len(kept) < len(two):
        alpha, beta = fit_rows(kept)
    measured = {}
    for r in ar:
        measured.setdefault(str(r["ranks"]), []).append([r["bytes"], r["p50_us"]])
    fit = [{"bytes": r["bytes"], "measured_p50_us": r["p50_us"],
            "model_us": model_us(r, alpha, beta), "used": r in kept or len(kept) < 2}
           for r in two]
    q = [r for r in rows if r.get("op") == "quorum" and r.get("ranks") == 2 and
         r.get("quorum") == 1]
    small = min(q, key=lambda r: r["bytes"]) if q else None
    rtt = small["p50_us"] if small else 2 * alpha
    # Step costs in a training-like duty cycle (--straggler shiftexp:IDLE:0: every rank sleeps
    # IDLE ms before each step, then contributes): the quorum op's median minus IDLE, by the
    # number of contributors N; Q = k rows are full sync (its speculative ring), Q = k - 1
    # rows steps with a backup (READY, DECIDE, the reduction among N, the late rank's copy).
    cost = {"full": {}, "backup": {}}
    for r in duty:
        if r.get("op") != "quorum":
            continue
        kind = "full" if r["quorum"] == r["ranks"] else "backup"
        cost[kind][str(r["quorum"])] = max(0.0, r["p50_us"] / 1000.0 - r["idle_ms"])
    res = {"alpha_us": alpha, "beta_ns_per_byte": beta, "rtt_us": rtt,
           "step_cost_ms": cost,
           "step_cost_from": [{"ranks": r["ranks"], "quorum": r["quorum"], "bytes": r["bytes"],
                               "idle_ms": r["idle_ms"], "p50_us": r["p50_us"]}
                              for r in duty if r.get("op") == "quorum"],
           "rtt_from": small and {"ranks": 2, "quorum": 1, "bytes": small["bytes"],
                                  "quorum_p50_us": small["p50_us"]},
           "fit_2_ranks": fit, "allreduce_p50_us_by_ranks": measured, "sources": bench_files,
           "model": "allreduce(k, bytes) = rounds(k, bytes) alpha + 2 (k-1)/k bytes beta, "
                    "fitted to the 2-rank medians; rtt = the 2-rank quorum-1 op's median at "
                    "the smallest size (its own reduction is empty)"}
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(res, f, indent=2)
    ratios = ", ".join("%.2f" % (x["model_us"] / x["measured_p50_us"]) for x in fit)
    costs = "; ".join(f"{kind} " + ", ".join(f"N={n}: {v:.2f}" for n, v in sorted(
        cost[kind].items(), key=lambda x: int(x[0]))) for kind in ("full", "backup") if cost[kind])
    print(f"calibration: alpha {alpha:.2f} us, beta {beta:.4f} ns/byte, rtt {rtt:.1f} us "
          f"(2-rank fit, model/measured {ratios}); step cost (ms) {costs or 'not measured'} "
          f"-> {out}")


# ---------------------------------------------------------------- the parts

def harmonic(n):
    return sum(1.0 / i for i in range(1, n + 1))


def closed_form_shiftexp(spec, n, compute_ms):
    """E[T(k)] of n shifted exponentials (the paper's model): shift + mean (H(n) - H(n-k))."""
    shift, mean = (float(x) for x in spec.split(":")[1:3])
    hn = harmonic(n)
    return [compute_ms + shift + mean * (hn - harmonic(n - k)) for k in range(1, n + 1)]


def kth_part(d):
    """P1, the long tail: per regime and n, the mean k-th arrival over each seed's steps, and
    the share of the spread between the first and the last arrival that the last 5 % take."""
    rows = []
    groups = {}
    for name, r in runs(os.path.join(d, "kth")).items():
        m = re.fullmatch(r"(?P<regime>.+)-n(?P<n>\d+)-s(?P<seed>\d+)", name)
        if m:
            groups.setdefault((m["regime"], int(m["n"])), {})[int(m["seed"])] = r["summary"]
    for (regime, n), seeds in sorted(groups.items()):
        shares, curves = [], []
        for s in seeds.values():
            k = s["kth_arrival_mean_ms"]
            tail = max(1, math.ceil(TAIL_FRACTION * n))
            spread = k[-1] - k[0]
            shares.append((k[-1] - k[-1 - tail]) / spread if spread > 0 else 0.0)
            curves.append(k)
        curve = [sum(c[i] for c in curves) / len(curves) for i in range(n)]
        row = {"regime": regime, "n": n, "seeds": sorted(seeds), "tail": max(1, math.ceil(TAIL_FRACTION * n)),
               "share": mean_ci(shares), "curve_ms": curve,
               "first_ms": curve[0], "last_ms": curve[-1], "median_ms": curve[n // 2 - 1]}
        s0 = next(iter(seeds.values()))
        if regime == "shiftexp":
            cf = closed_form_shiftexp(s0["straggler"], n, s0.get("compute_ms", 0))
            row["closed_form_max_error"] = max(abs(a / b - 1) for a, b in zip(curve, cf))
        rows.append(row)
    return rows


def fixed_b(key):
    return int(key) if key.isdigit() else None


def sweep_part(d, sub, regime, workers):
    """The b sweep of one regime at N+b = workers, with auto: per configuration the time to
    the target and the final accuracy over the seeds; the best fixed b and its bootstrap
    interval; best against b = 0 and auto against best, paired by seed."""
    groups = by_seed(runs(os.path.join(d, sub)), rf"{re.escape(regime)}-s(?P<seed>\d+)-b(?P<key>.+)")
    if not groups:
        return None
    seeds = sorted(set.intersection(*(set(v) for v in groups.values())))
    configs = sorted(groups, key=lambda k: (fixed_b(k) is None, fixed_b(k) or 0, k))
    rows = []
    for c in configs:
        rs = [groups[c][s] for s in seeds]
        ttts = [r["ttt"] for r in rs]
        reached = [t for t in ttts if t is not None]
        hist = {}
        for r in rs:
            for q, n in (r["summary"].get("quorum_histogram") or {}).items():
                hist[int(q)] = hist.get(int(q), 0) + n
        steps = sum(hist.values())
        rows.append({"config": c, "b": fixed_b(c), "seeds": len(rs),
                     "reached": len(reached),
                     "ttt": mean_ci(reached) if len(reached) == len(rs) else (None, None, None),
                     "ttt_reached": mean_ci(reached),
                     "final": mean_ci([r["final"] for r in rs]),
                     "mean_quorum": sum(q * n for q, n in hist.items()) / steps if steps else None})
    table = {fixed_b(c): {s: groups[c][s]["ttt"] for s in seeds} for c in configs if fixed_b(c) is not None}
    best, lo, hi = bootstrap_best(table)
    out = {"regime": regime, "workers": workers, "seeds": seeds, "rows": rows,
           "best_b": best, "best_b_interval": [lo, hi], "b_values": sorted(table)}

    def paired(a, b):  # time of a over time of b, per seed; both reached
        return [(groups[a][s]["ttt"], groups[b][s]["ttt"]) for s in seeds
                if groups[a][s]["ttt"] and groups[b][s]["ttt"]]

    def acc_diff(a, b):
        return mean_ci([groups[a][s]["final"] - groups[b][s]["final"] for s in seeds])

    if best is not None and "0" in groups:
        out["best_vs_full"] = {"sooner": ratio_ci(paired("0", str(best))),
                               "pairs": len(paired("0", str(best))),
                               "accuracy_diff": acc_diff(str(best), "0")}
    for auto in ("auto", "auto-estimate"):
        if best is not None and auto in groups:
            out[auto + "_vs_best"] = {"ratio": ratio_ci(paired(auto, str(best))),
                                      "pairs": len(paired(auto, str(best))),
                                      "reached": sum(1 for s in seeds if groups[auto][s]["ttt"]),
                                      "accuracy_diff": acc_diff(auto, str(best))}
    return out


def async_part(d, sub, prefix="W"):
    """Sync (full, with backups) against the tuned async, per world size W (prefix "W": runs
    W<w>-s<seed>-<full|b<b>|async>) or depth (prefix "d"): time to the target and final
    accuracy over the seeds, sync against async paired by seed, and the async grid of the
    held-out seed (tune-<prefix><w>-*)."""
    rs = runs(os.path.join(d, sub))
    keys = sorted({m["w"] for n in rs for m in [re.fullmatch(rf"{prefix}(?P<w>\d+)-s\d+-.+", n)] if m},
                  key=int)
    out = []
    for w in keys:
        groups = by_seed(rs, rf"{prefix}{w}-s(?P<seed>\d+)-(?P<key>.+)")
        seeds = sorted(set.intersection(*(set(v) for v in groups.values())))
        methods = {}
        for key, per in groups.items():
            method = "async" if key == "async" else "full sync" if key == "full" else "backups"
            rs_ = [per[s] for s in seeds]
            reached = [r["ttt"] for r in rs_ if r["ttt"] is not None]
            methods[method] = {
                "config": key, "final": mean_ci([r["final"] for r in rs_]),
                "ttt": mean_ci(reached) if len(reached) == len(rs_) else (None, None, None),
                "reached": len(reached), "seeds": len(rs_),
                "staleness": mean_ci([r["staleness"] for r in rs_ if r["staleness"] is not None]),
                "per_seed": {s: (per[s]["ttt"], per[s]["final"]) for s in seeds}}
        row = {"key": int(w), "seeds": seeds, "methods": methods}
        tune = runs(os.path.join(d, sub), rf"tune-{prefix}{w}-.+")
        row["tuning"] = [{"name": n, "ttt": r["ttt"], "final": r["final"],
                          "args": async_args(r["dir"])} for n, r in sorted(tune.items())]
        for sync in ("backups", "full sync"):
            if sync in methods and "async" in methods:
                a, b = methods["async"]["per_seed"], methods[sync]["per_seed"]
                row[f"{sync} vs async"] = {
                    "accuracy_diff": mean_ci([b[s][1] - a[s][1] for s in seeds]),
                    "sooner": ratio_ci([(a[s][0], b[s][0]) for s in seeds if a[s][0] and b[s][0]]),
                    "both_reached": sum(1 for s in seeds if a[s][0] and b[s][0]),
                    "sync_only_reached": sum(1 for s in seeds if b[s][0] and not a[s][0]),
                    "async_only_reached": sum(1 for s in seeds if a[s][0] and not b[s][0])}
        out.append(row)
    return out


def async_args(run_dir):
    """The tuned settings of an async run (its config.toml): lr, warm-up, staleness rule. A
    qring-sim async run's config.toml holds the schedule it ran, in updates (warm-up x W):
    the setting is that over W."""
    text = open(os.path.join(run_dir, "config.toml")).read()
    s = read_json(os.path.join(run_dir, "summary.json"))

    def get(key):
        m = re.search(rf"^{key}\s*=\s*(.+)$", text, re.M)
        return m.group(1).strip().strip('"') if m else None
    warm = get("warmup_steps")
    if warm is not None and "workers" in s and s.get("mode") == "async":
        warm = str(int(warm) // int(s["workers"]))
    return {"train.async_staleness": get("async_staleness"), "train.lr": get("lr"),
            "train.warmup_steps": warm}


def tune_async(d, prefix):
    """The best run of the grid d/prefix-*: the soonest to the target (those that reached
    it), else the most accurate; its settings as key=value arguments."""
    grid = runs(d, re.escape(prefix) + r"-.+")
    if not grid:
        sys.exit(f"tune-async: no runs {d}/{prefix}-*")
    best = min(grid.values(), key=lambda r: (r["ttt"] is None, r["ttt"] or 0, -r["final"]))
    print(" ".join(f"{k}={v}" for k, v in async_args(best["dir"]).items()))


def depth_part(d):
    """P3c: the accuracy full sync has over tuned async, per depth (hidden layers), and how
    much more it is at four layers than at one, paired by seed."""
    rows = async_part(d, "depth", "d")
    for r in rows:
        m = r["methods"]
        if "full sync" in m and "async" in m:
            a, b = m["async"]["per_seed"], m["full sync"]["per_seed"]
            r["gap_per_seed"] = {s: b[s][1] - a[s][1] for s in r["seeds"]}
    out = {"rows": rows}
    if len(rows) == 2 and all("gap_per_seed" in r for r in rows):
        shallow, deep = rows
        seeds = sorted(set(shallow["gap_per_seed"]) & set(deep["gap_per_seed"]))
        out["gap_growth"] = mean_ci([deep["gap_per_seed"][s] - shallow["gap_per_seed"][s] for s in seeds])
    return out


SKIP_STEPS = 5  # the first steps of a run (connections, warm caches) are left out


def step_periods(run_dir):
    """A qring-train run's step times (ms, rank 0's wall time between consecutive step lines)
    or a qring-sim run's (its step_ms), after the first SKIP_STEPS steps."""
    steps = [j for j in plot.read_jsonl(os.path.join(run_dir, "metrics.jsonl")) if j.get("type") == "step"]
    if steps and "virtual_s" in steps[0]:
        return [j["step_ms"] for j in steps[SKIP_STEPS:]]
    return [1000 * (b["wall_s"] - a["wall_s"]) for a, b in zip(steps, steps[1:])][SKIP_STEPS:]


def median(v):
    v = sorted(v)
    return v[len(v) // 2] if v else None


def step_cost(run_dir):
    """qring's own step cost of a run without stragglers: the median step (ms) and the median
    compute time of a gradient (ms)."""
    steps = [j for j in plot.read_jsonl(os.path.join(run_dir, "metrics.jsonl")) if j.get("type") == "step"]
    periods = step_periods(run_dir)
    compute = [j["compute_ms"] for j in steps[SKIP_STEPS:] if j.get("compute_ms", 0) > 0]
    if not periods or not compute:
        sys.exit(f"step-cost: {run_dir} has {len(steps)} steps; more than {SKIP_STEPS + 1} needed")
    print(f"{median(periods):.3f} {median(compute):.4f}")


def post_arrival_ms(run_dir):
    """A qring-train run's cost of a step beyond its decision, as rank 0 sees it: per step
    after the first SKIP_STEPS, the time from the quorum-th READY to the end of rank 0's step
    (the ring or the reduction among the contributors, the update; for an excluded rank 0
    also the result's way to it); its median (clocked_steps says how each is measured)."""
    steps = clocked_steps(run_dir)
    if not steps:
        sys.exit(f"post-arrival: {run_dir} has no step after the first {SKIP_STEPS} that rank 0 "
                 f"contributed to or was excluded from within its idle time")
    return median([s.post_ms for s in steps]), steps[0].line["quorum"]


# One step of clocked_steps: its metrics line, ready_ms, the quorum-th READY's offset, rank 0's
# READY's offset (its own, or where an excluded rank 0's would have been) and the cost beyond
# the decision as rank 0 saw it (ms).
Clocked = collections.namedtuple("Clocked", "line ready quorum_th own post_ms")


def clocked_steps(run_dir):
    """A qring-train run's steps after the first SKIP_STEPS that have a clock on rank 0 (the
    coordinator, whose receive times ready_ms and decide_ms are):
    - rank 0 contributed: its own READY; beyond the decision, its wait_ms (from its READY to
      its result) less the time from its READY to the quorum-th;
    - rank 0 was excluded (it arrived last, e.g. because an excluded rank has its result
      later and so starts the next step late): it stopped idling at the decision
      (train/trainer.cc, compute_and_contribute), so its wait_ms runs from the decision to its
      result: that is the cost beyond the decision. Its READY would have come its delay_ms
      and compute time (its median in the run's steps; none computed: 0) after it started,
      and it started `idle` before the decision: its period (wall_s since the previous step)
      less wait_ms. Left out where rank 0 idled under SLICE_MS (it started after the
      decision: no clock)."""
    steps = [j for j in plot.read_jsonl(os.path.join(run_dir, "metrics.jsonl")) if j.get("type") == "step"]
    compute = median([j["compute_ms"] for j in steps[SKIP_STEPS:] if j.get("compute_ms", 0) > 0]) or 0.0
    out = []
    for i in range(max(SKIP_STEPS, 1), len(steps)):
        j, prev = steps[i], steps[i - 1]
        ready = j.get("ready_ms") or []
        got = sorted(x for x in ready if x >= 0)
        if not ready or j.get("skipped") or len(got) < j["quorum"]:
            continue
        quorum_th = got[j["quorum"] - 1]
        if ready[0] >= 0:
            out.append(Clocked(j, ready, quorum_th, ready[0], j["wait_ms"] - (quorum_th - ready[0])))
            continue
        idle = 1000 * (j["wall_s"] - prev["wall_s"]) - j["wait_ms"]
        if 0 not in j.get("dropped", []) or idle < SLICE_MS or "decide_ms" not in j:
            continue
        own = j["decide_ms"] - idle + j["delay_ms"] + compute
        out.append(Clocked(j, ready, quorum_th, own, j["wait_ms"] + j["decide_ms"] - quorum_th))
    return out


SLICE_MS = 0.25  # an idling rank asks whether it was excluded this often (collectives/straggler.cc)


def arrival_offsets(run_dir):
    """A qring-train run's arrival offsets, per step of clocked_steps: each rank's READY after
    rank 0's (its own or, excluded, where it would have been), in a run whose ranks all idle
    the same time, so that what is left is the ranks' start skew after the previous step and
    the READY's way; another rank's READY not in by the decision counts as the quorum-th (a
    lower bound)."""
    return [[0.0 if r == 0 else round((x if x >= 0 else s.quorum_th) - s.own, 3)
             for r, x in enumerate(s.ready)]
            for s in clocked_steps(run_dir)]


def post_arrival(out, base, run_dirs):
    """BASE (a calibration) with what the runs RUN_DIRS (qring-train with every rank idle the
    same time each step, so that the quorum's arrivals come together) measured, by quorum N:
    step_cost_ms, the cost beyond the decision ("full" where N is the world size: its
    speculative ring; else "backup"), and arrival_offsets_ms, each step's ranks' READYs after
    the coordinator's (the simulator replays them in order: train/sim.h)."""
    cal = read_json(base)
    cost = {"full": {}, "backup": {}}
    offsets = {}
    for run_dir in run_dirs:
        ms, quorum = post_arrival_ms(run_dir)
        world = read_json(os.path.join(run_dir, "summary.json"))["world"]
        cost["full" if quorum == world else "backup"][str(quorum)] = ms
        offsets[str(quorum)] = arrival_offsets(run_dir)
        last = median([max(r) for r in offsets[str(quorum)]])
        print(f"{run_dir}: {ms:.2f} ms beyond the decision, the last READY {last:.2f} ms after "
              f"the coordinator's (median; quorum {quorum} of {world})")
    cal["step_cost_ms"] = cost
    cal["arrival_offsets_ms"] = offsets
    cal["step_cost_from"] = run_dirs
    with open(out, "w") as f:
        json.dump(cal, f, indent=2)


def validate_part(d):
    """The simulator against qring-train on emulated hosts: per hosts and quorum, the p50 and
    mean step time, measured and simulated."""
    v = os.path.join(d, "validate")
    rows = []
    for meas in sorted(glob.glob(os.path.join(v, "measured-*-q*"))):
        m = re.search(r"measured-(\d+)-q(\d+)$", meas)
        if not m or not os.path.isdir(meas):
            continue
        sim_dir = os.path.join(v, f"simulated-{m.group(1)}-q{m.group(2)}")
        if not os.path.exists(os.path.join(sim_dir, "summary.json")):
            continue
        k, q = int(m.group(1)), int(m.group(2))
        mp, sp = step_periods(meas), step_periods(sim_dir)
        host = read_json(os.path.join(v, f"hosts-{k}.json"))
        s = read_json(os.path.join(sim_dir, "summary.json"))
        row = {"hosts": k, "quorum": q, "cost_ms": host["cost_ms"], "rate": host["rate"],
               "bytes": host["bytes"], "steps": len(mp),
               "measured_p50_ms": median(mp), "measured_mean_ms": sum(mp) / len(mp),
               "simulated_p50_ms": median(sp), "simulated_mean_ms": sum(sp) / len(sp),
               "delay_over_cost_max": max_trace_ratio(s["straggler"])}
        row["p50_error"] = row["simulated_p50_ms"] / row["measured_p50_ms"] - 1
        row["mean_error"] = row["simulated_mean_ms"] / row["measured_mean_ms"] - 1
        # The cost beyond the decision: measured in this run, in the duty-cycle runs (what
        # the prediction used) and the 2-host network model's (its prediction alongside).
        row["post_measured_ms"] = post_arrival_ms(meas)[0]
        cal_k = os.path.join(v, f"calibration-{k}.json")
        if os.path.exists(cal_k):
            costs = read_json(cal_k)["step_cost_ms"]
            row["post_duty_ms"] = costs["full" if q == k else "backup"].get(str(q))
            offs = read_json(cal_k).get("arrival_offsets_ms", {}).get(str(q))
            row["skew_duty_ms"] = median([max(o) for o in offs]) if offs else None
        together = os.path.join(v, f"together-{k}-q{q}")
        if os.path.exists(os.path.join(together, "summary.json")):
            tp = step_periods(together)
            row["together_p50_error"] = median(tp) / row["measured_p50_ms"] - 1
            row["together_mean_error"] = sum(tp) / len(tp) / row["measured_mean_ms"] - 1
        model2 = os.path.join(v, f"model2-{k}-q{q}")
        if os.path.exists(os.path.join(model2, "summary.json")):
            ms = [j for j in plot.read_jsonl(os.path.join(model2, "metrics.jsonl")) if j.get("type") == "step"]
            row["post_model2_ms"] = median([j["step_ms"] - j["kth_arrival_ms"] for j in ms])
            row["model2_p50_ms"] = median(step_periods(model2))
            row["model2_p50_error"] = row["model2_p50_ms"] / row["measured_p50_ms"] - 1
        rows.append(row)
    rows.sort(key=lambda r: (r["hosts"], -r["quorum"]))
    cal = os.path.join(v, "calibration.json")
    return {"rows": rows, "calibration": read_json(cal) if os.path.exists(cal) else None}


def max_trace_ratio(spec):
    """The largest delay of a resample: model over its scale (its job's slowest / fastest)."""
    m = re.fullmatch(r"resample:[^:]+:(.+)", spec or "")
    if not m or not os.path.exists(m.group(1)):
        return None
    steps = {}
    for line in open(m.group(1)):
        line = line.split("#")[0].split()
        if len(line) == 3:
            steps.setdefault(line[0], []).append(float(line[2]))
    return max(max(v) / min(v) for v in steps.values())
# ---------------------------------------------------------------- plots

def figure(rows, cols, width=6.0, height=4.2):
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(rows, cols, figsize=(width * cols, height * rows), squeeze=False)
    return fig, ax


def errbar(ax, x, m_lo_hi, **kw):
    """A point with its interval (nothing for a missing mean)."""
    m, lo, hi = m_lo_hi
    if m is None:
        return
    yerr = [[m - lo], [hi - m]] if lo is not None else None
    ax.errorbar([x], [m], yerr=yerr, capsize=4, fmt="o", **kw)


def plot_kth(kth, path):
    """The k-th arrival at N+b = 100 and 1000 as a share of the step's spread, per regime:
    linear axes, the last 5 % shaded (the claim is about a jump there)."""
    fig, ax = figure(1, 2)
    for i, n in enumerate((100, 1000)):
        a = ax[0][i]
        for r in (r for r in kth if r["n"] == n):
            c = r["curve_ms"]
            spread = c[-1] - c[0] or 1
            a.plot([(k + 1) / n for k in range(n)], [(v - c[0]) / spread for v in c],
                   color=palette.regime_color(r["regime"]),
                   label=f"{r['regime']} (last {r['tail']}: {100 * r['share'][0]:.0f} %)")
        a.axvspan(1 - TAIL_FRACTION, 1, color="#dddddd", zorder=0)
        a.set_title(f"k-th of {n} gradients (mean over steps and seeds)")
        a.set_xlabel("k / n")
        a.set_ylabel("(T(k) - T(1)) / (T(n) - T(1))")
        a.legend(loc="upper left")
    save(fig, path)


def plot_sweep(sweeps, path, title):
    """Time to the target against b, one panel per regime: each b's mean and 95 % interval,
    auto (the linear value) and auto-estimate (the noise scale estimated in the run) as lines,
    auto's interval as a band; seeds that never reached the target are said."""
    fig, ax = figure(1, len(sweeps), width=5.5)
    for i, sw in enumerate(sweeps):
        a = ax[0][i]
        fixed = [r for r in sw["rows"] if r["b"] is not None]
        xs = list(range(len(fixed)))
        for x, r in zip(xs, fixed):
            method = "full sync" if r["b"] == 0 else "backups"
            errbar(a, x, r["ttt"], color=palette.method_color(method))
            if r["reached"] < r["seeds"]:
                a.annotate(f"{r['reached']}/{r['seeds']}", (x, 0), xycoords=("data", "axes fraction"),
                           ha="center", va="bottom", fontsize=9)
        for r in sw["rows"]:
            if r["b"] is None and r["ttt"][0] is not None:
                m, lo, hi = r["ttt"]
                style = "-" if r["config"] == "auto" else "--"
                a.axhline(m, color=palette.method_color("auto"), linestyle=style,
                          label=f"{r['config']} (mean quorum {r['mean_quorum']:.0f})")
                if lo is not None and r["config"] == "auto":
                    a.axhspan(lo, hi, color=palette.method_color("auto"), alpha=0.15)
        a.set_xticks(xs)
        a.set_xticklabels([str(r["b"]) for r in fixed])
        a.set_xlabel(f"backup workers b (N + b = {sw['workers']})")
        a.set_ylabel("time to the target (virtual s)")
        lo, hi = sw["best_b_interval"]
        a.set_title(f"{sw['regime']}: best b = {sw['best_b']} [{lo}, {hi}], {len(sw['seeds'])} seeds")
        if a.get_legend_handles_labels()[0]:
            a.legend(loc="best")  # clear of the points (b = 64 under the trace is high)
    fig.suptitle(title)
    save(fig, path)


def plot_async(rows, path, title, key_label):
    """Time to the target and final accuracy of full sync, sync with backups and tuned async."""
    fig, ax = figure(1, 2)
    methods = ["full sync", "backups", "async"]
    for j, r in enumerate(rows):
        for i, m in enumerate(methods):
            if m not in r["methods"]:
                continue
            e = r["methods"][m]
            x = j + (i - 1) * 0.22
            errbar(ax[0][0], x, e["ttt"], color=palette.method_color(m), label=m if j == 0 else None)
            if e["reached"] < e["seeds"]:
                ax[0][0].annotate(f"{e['reached']}/{e['seeds']}", (x, 0),
                                  xycoords=("data", "axes fraction"), ha="center", va="bottom",
                                  fontsize=9, color=palette.method_color(m))
            errbar(ax[0][1], x, e["final"], color=palette.method_color(m), label=m if j == 0 else None)
    for a, y in ((ax[0][0], "time to the target (s)"), (ax[0][1], "final test accuracy (%)")):
        a.set_xticks(range(len(rows)))
        a.set_xticklabels([f"{key_label} {r['key']}" for r in rows])
        a.set_xlim(-0.5, len(rows) - 0.5)  # room for a method that never reached the target
        a.set_ylabel(y)
        a.legend()
    ax[0][0].set_title("time to the target (n/m: seeds that reached it)")
    ax[0][1].set_title("final test accuracy")
    fig.suptitle(title)
    save(fig, path)


def plot_auto(d, path):
    """quorum "auto" under the real trace at N+b = 100, one seed: Q(t) with the linear value
    (the default) and with the noise scale estimated in the run, and that estimate."""
    rs = runs(os.path.join(d, "bsweep"), r"trace-s1-bauto(-estimate)?")
    if not rs:
        return
    fig, ax = figure(1, 2)
    for name, r in sorted(rs.items()):
        steps = [j for j in plot.read_jsonl(os.path.join(r["dir"], "metrics.jsonl"))
                 if j.get("type") == "step"]
        est = name.endswith("estimate")
        style = {"color": palette.method_color("auto"), "linestyle": "--" if est else "-"}
        label = "auto, noise scale estimated" if est else "auto (linear value)"
        ax[0][0].plot([j["step"] for j in steps], [j["quorum"] for j in steps], label=label, **style)
        if est:
            ns = [(j["step"], j["noise_scale"] / 8) for j in steps if "noise_scale" in j]
            ax[0][1].plot([p[0] for p in ns], [p[1] for p in ns], **style)
    ax[0][0].set_title("quorum Q(t) chosen by auto (trace, seed 1)")
    ax[0][0].set_xlabel("step")
    ax[0][0].set_ylabel("Q(t) of 100")
    ax[0][0].legend()
    ax[0][1].set_yscale("log")
    ax[0][1].set_title("the run's estimate of the gradient-noise scale")
    ax[0][1].set_xlabel("step")
    ax[0][1].set_ylabel("B_simple (contributions of 8 samples)")
    save(fig, path)


def plot_validation(val, path):
    fig, ax = figure(1, 1, width=7)
    a = ax[0][0]
    rows = val["rows"]
    for i, r in enumerate(rows):
        a.bar(i - 0.27, r["measured_p50_ms"], width=0.27, color=palette.SOURCES["measured"],
              label="measured (qring-train)" if i == 0 else None)
        a.bar(i, r["simulated_p50_ms"], width=0.27, color=palette.SOURCES["simulated"],
              label="simulated, measured cost beyond the decision" if i == 0 else None)
        if r.get("model2_p50_ms") is not None:
            a.bar(i + 0.27, r["model2_p50_ms"], width=0.27, color=palette.SOURCES["network model"],
                  label="simulated, 2-host network model" if i == 0 else None)
    a.set_xticks(range(len(rows)))
    a.set_xticklabels([f"{r['hosts']} hosts\nQ = {r['quorum']}" for r in rows])
    a.set_ylabel("median step time (ms)")
    a.set_title(f"step time on emulated hosts ({rows[0]['rate'] if rows else ''} links)")
    a.legend()
    save(fig, path)


def save(fig, path):
    import matplotlib.pyplot as plt
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


# ---------------------------------------------------------------- claims and tables

def verdict_interval(lo, hi, threshold, above=True):
    """reproduced / not / undecided from an interval against a threshold."""
    if lo is None:
        return "undecided (one seed)"
    if above:
        return "reproduced" if lo > threshold else "not reproduced" if hi < threshold else "undecided"
    return "reproduced" if hi < threshold else "not reproduced" if lo > threshold else "undecided"


def claims_of(res):
    """The claim table's rows: (id, claim, the paper's number, qring's setup, qring's number
    with its interval, verdict)."""
    out = []

    def add(cid, claim, paper, setup, number, verdict):
        setup = re.sub(r"\b1 seeds\b", "1 seed", setup)
        out.append({"id": cid, "claim": claim, "paper": paper, "setup": setup,
                    "number": number, "verdict": verdict})

    for part in (claims_p1_p2, claims_p3, claims_p4_auto, claims_simulator):
        part(res, add)
    return out


def seeds_n(seeds):
    return "1 seed" if len(seeds) == 1 else f"{len(seeds)} seeds"


def same_accuracy_verdict(sooner, alo, ahi):
    same = alo is not None and alo > -SAME_ACCURACY and ahi < SAME_ACCURACY
    return "reproduced" if sooner == "reproduced" and same else \
        "partly" if sooner == "reproduced" else sooner


def claims_p1_p2(res, add):
    for r in res["kth"]:
        if r["n"] != 100:
            continue
        m, lo, hi = r["share"]
        add("P1", "the k-th gradient's arrival is flat for most k and jumps for the last few",
            "100 workers: the last few gradients take most of a step's wait (the k-th arrival figure)",
            f"qring-sim, N+b = 100, {r['regime']}, {len(r['seeds'])} seeds",
            f"last {r['tail']} of 100 take {fmt_ci(100 * m, lo and 100 * lo, hi and 100 * hi, 0, ' %')} "
            "of the spread (uniform: 5 %)", verdict_interval(lo, hi, TAIL_SHARE))
    for sw in res["bsweep"]:
        bf = sw.get("best_vs_full")
        if bf:
            m, lo, hi = bf["sooner"]
            am, alo, ahi = bf["accuracy_diff"]
            v = same_accuracy_verdict(verdict_interval(lo, hi, 1.0), alo, ahi)
            add("P2", "sync with backups reaches the target sooner than full sync, at the same accuracy",
                "Inception, 100 workers: 96 + 4 converges sooner than 100 + 0 (the b-sweep figure)",
                f"qring-sim, N+b = 100, {sw['regime']}, best b = {sw['best_b']} against b = 0, "
                f"{len(sw['seeds'])} seeds",
                f"{fmt_ci(m, lo, hi)}x sooner; final accuracy {fmt_ci(am, alo, ahi, 2, ' pts')}", v)
    for r in res["real"]:
        m = r["methods"]
        if "full sync" in m and "backups" in m:
            a, b = m["backups"]["per_seed"], m["full sync"]["per_seed"]
            s = r["seeds"]
            rm, rlo, rhi = ratio_ci([(b[x][0], a[x][0]) for x in s if a[x][0] and b[x][0]])
            am, alo, ahi = mean_ci([a[x][1] - b[x][1] for x in s])
            add("P2", "sync with backups reaches the target sooner than full sync, at the same accuracy",
                "(as above)", f"qring-train, {r['key']} ranks, Q = {r['key'] - 1} against Q = {r['key']}, "
                f"{len(s)} seeds", f"{fmt_ci(rm, rlo, rhi)}x sooner; final accuracy "
                f"{fmt_ci(am, alo, ahi, 2, ' pts')}",
                same_accuracy_verdict(verdict_interval(rlo, rhi, 1.0), alo, ahi))


def claims_p3(res, add):
    for where, rows, unit in (("qring-sim", res["async"], "simulated workers"),
                              ("qring-train", res["real"], "ranks")):
        for r in rows:
            e = r.get("backups vs async") or r.get("full sync vs async")
            if not e:
                continue
            sync = "sync with backups" if "backups vs async" in r else "full sync"
            am, alo, ahi = e["accuracy_diff"]
            st = r["methods"]["async"]["staleness"][0]
            add("P3a", "sync ends more accurate than async, the more so the more workers",
                "sync with backups ahead of async at 50-200 workers, the gap growing (Inception, the async-vs-sync figure)",
                f"{where}, {r['key']} {unit}, {sync} against tuned async (staleness {st:.0f}), "
                f"{seeds_n(r['seeds'])}", f"{fmt_ci(am, alo, ahi, 2, ' pts')}",
                verdict_interval(alo, ahi, 0.0))
            sm, slo, shi = e["sooner"]
            n = len(r["seeds"])
            reach = (f"; both reached the target in {e['both_reached']}/{n}, only sync in "
                     f"{e['sync_only_reached']}, only async in {e['async_only_reached']}")
            if e["both_reached"] >= 2:
                v = verdict_interval(slo, shi, 1.0)
                if e["async_only_reached"] > 0:
                    v = "undecided"
            elif e["sync_only_reached"] == n:
                v = "reproduced"
            elif e["async_only_reached"] == n:
                v = "contradicted"
            else:
                v = "undecided"
            if v == "not reproduced" and sm is not None and shi is not None and shi < 1:
                v = "contradicted"
            add("P3b", "sync with backups reaches the target sooner than async",
                "sync converges faster in wall time than async (the convergence figures)",
                f"{where}, {r['key']} {unit}, {sync} against tuned async, {n} seeds",
                f"{fmt_ci(sm, slo, shi)}x sooner{reach}", v)
    dp = res["depth"]
    if dp.get("gap_growth"):
        gm, glo, ghi = dp["gap_growth"]
        gaps = "; ".join(f"{r['key']} hidden: {fmt_ci(*r['full sync vs async']['accuracy_diff'], 2, ' pts')}"
                         for r in dp["rows"] if "full sync vs async" in r)
        add("P3c", "staleness hurts deeper models more",
            "the accuracy async loses to staleness grows with depth (the staleness figure)",
            f"qring-sim, W = {res['depth_w']}, MLP with 1 and 4 hidden layers, full sync against tuned async, "
            f"{len(dp['rows'][0]['seeds'])} seeds",
            f"gap at 4 layers minus gap at 1: {fmt_ci(gm, glo, ghi, 2, ' pts')} ({gaps})",
            verdict_interval(glo, ghi, 0.0))


def claims_p4_auto(res, add):
    for sw in res["bsweep"] + res["bsweep1000"]:
        lo, hi = sw["best_b_interval"]
        bs = sw["b_values"]
        interior = lo is not None and lo > bs[0] and hi < bs[-1]
        add("P4", "at fixed N + b the time to the target has an interior optimum in b",
            "100 workers: b = 4 (96 + 4)", f"qring-sim, N+b = {sw['workers']}, {sw['regime']}, "
            f"b in {bs[0]}..{bs[-1]}, {len(sw['seeds'])} seeds",
            f"best b = {sw['best_b']}, bootstrap interval [{lo}, {hi}]",
            "reproduced" if interior else "undecided" if lo is None or hi is None else "not reproduced")
    for sw in res["bsweep"]:
        for auto in ("auto", "auto-estimate"):
            e = sw.get(auto + "_vs_best")
            if not e:
                continue
            m, lo, hi = e["ratio"]
            n = len(sw["seeds"])
            # The page's rule: a verdict where the interval supports it, "undecided" where it
            # straddles the bar (one seed: its ratio alone).
            if m is None or e["reached"] < n or (lo if lo is not None else m) > AUTO_WITHIN:
                verdict = "not met"
            elif (hi if hi is not None else m) <= AUTO_WITHIN:
                verdict = "met"
            else:
                verdict = "undecided"
            what = ("the default: the linear value, no noise scale" if auto == "auto"
                    else "quorum.noise_scale = estimate: the noise scale estimated in the run")
            add("auto", f"quorum \"auto\" ({what}) within 5 % of the best fixed b",
                "(qring's own aim, issue 46)",
                f"qring-sim, N+b = 100, {sw['regime']}, same optimizer form, {n} seeds",
                f"{fmt_ci(m, lo, hi)}x the best fixed b's time (b = {sw['best_b']}); reached the "
                f"target in {e['reached']}/{n}", verdict)


def claims_simulator(res, add):
    for r in res["validate"]["rows"]:
        ok = abs(r["p50_error"]) <= VALIDATION and abs(r["mean_error"]) <= VALIDATION
        add("sim", "the simulator's step time within 10 % of qring's on emulated hosts",
            "(qring's own check, issue 46)",
            f"{r['hosts']} hosts, Q = {r['quorum']}, {r['rate']} links, {r['bytes']} B, delays "
            f"{r['cost_ms']:.1f}-{r['cost_ms'] * (r['delay_over_cost_max'] or 1):.1f} ms "
            f"(<= {r['delay_over_cost_max'] or 0:.1f}x the step cost {r['cost_ms']:.1f} ms)",
            f"p50 {r['simulated_p50_ms']:.1f} vs {r['measured_p50_ms']:.1f} ms ({100 * r['p50_error']:+.1f} %), "
            f"mean {r['simulated_mean_ms']:.1f} vs {r['measured_mean_ms']:.1f} ms ({100 * r['mean_error']:+.1f} %)",
            "met" if ok else "not met")
    for r in res["kth"]:
        if "closed_form_max_error" in r:
            e = r["closed_form_max_error"]
            add("sim", "the simulated order statistics follow the shifted exponential's closed form",
                "E[T(k)] = shift + mean (H(n) - H(n-k))", f"qring-sim, n = {r['n']}, {len(r['seeds'])} seeds",
                f"largest error {100 * e:.2f} %", "met" if e <= 0.02 else "not met")


def md_table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def auto_md(res):
    """quorum "auto" (the linear value; the in-run estimate) against the best fixed b, per
    regime at N+b = 100: the ratio of the times to the target, paired by seed."""
    rows = []
    for sw in res["bsweep"]:
        cells = []
        for auto in ("auto", "auto-estimate"):
            e = sw.get(auto + "_vs_best")
            cells.append(f"{fmt_ci(*e['ratio'])}x (reached {e['reached']}/{len(sw['seeds'])})" if e else "-")
        rows.append([sw["regime"], len(sw["seeds"]), sw["best_b"]] + cells)
    return md_table(["regime", "seeds", "best fixed b", "auto (linear value, the default)",
                     "auto with the estimate"], rows)


def tables_md(res):
    """The detailed tables, one markdown file per part (DIR/tables/*.md)."""
    t = {"auto": auto_md(res)}
    for sws, name in ((res["bsweep"], "bsweep"), (res["bsweep1000"], "bsweep1000")):
        parts = []
        for sw in sws:
            rows = []
            for r in sw["rows"]:
                ttt = fmt_ci(*r["ttt"]) if r["ttt"][0] is not None else \
                    f"{fmt_ci(*r['ttt_reached'])} (reached {r['reached']}/{r['seeds']})" if r["reached"] else "never"
                rows.append([r["config"], ttt, fmt_ci(*r["final"]),
                             f"{r['mean_quorum']:.1f}" if r["mean_quorum"] else "-"])
            parts.append(f"**{sw['regime']}**, N+b = {sw['workers']}, seeds {sw['seeds'][0]}-"
                         f"{sw['seeds'][-1]}: best b = {sw['best_b']}, bootstrap interval "
                         f"{sw['best_b_interval']}\n\n" +
                         md_table(["b", "time to target (virtual s)", "final accuracy (%)",
                                   "mean quorum"], rows))
        t[name] = "\n".join(parts)
    for rows_, name, label in ((res["async"], "async", "W"), (res["depth"]["rows"], "depth", "hidden layers"),
                               (res["real"], "real", "ranks")):
        out = []
        for r in rows_:
            for m, e in r["methods"].items():
                ttt = fmt_ci(*e["ttt"]) if e["ttt"][0] is not None else f"reached {e['reached']}/{e['seeds']}"
                st = fmt_ci(*e["staleness"], 1) if e["staleness"][0] is not None else "-"
                out.append([f"{label} {r['key']}", m, e["config"], ttt, fmt_ci(*e["final"]), st])
        grid = []
        for r in rows_:
            for g in r["tuning"]:
                a = g["args"]
                grid.append([f"{label} {r['key']}", a["train.async_staleness"],
                             f"{float(a['train.lr']):g}",
                             a["train.warmup_steps"], f"{g['ttt']:.2f}" if g["ttt"] else "never",
                             f"{g['final']:.2f}"])
        t[name] = md_table([label, "method", "run", "time to target (s)", "final accuracy (%)",
                            "staleness"], out)
        if grid:
            t[name] += "\nAsync tuned on the held-out seed (the first soonest to the target wins):\n\n" + \
                md_table([label, "staleness rule", "lr", "warm-up steps", "time to target (s)",
                          "final accuracy (%)"], grid)
    kth = [[r["regime"], r["n"], f"{r['first_ms']:.1f}", f"{r['median_ms']:.1f}",
            f"{r['last_ms']:.1f}", r["tail"], fmt_ci(*(100 * x if x is not None else None for x in r["share"]), 0)]
           for r in res["kth"]]
    t["kth"] = md_table(["regime", "n", "first (ms)", "median (ms)", "last (ms)", "tail k",
                         "tail share of the spread (%)"], kth)
    opt = lambda x, f="{:.1f}": "-" if x is None else f.format(x)  # noqa: E731
    v = [[r["hosts"], r["quorum"], f"{r['cost_ms']:.1f}", f"{r['measured_p50_ms']:.1f}",
          f"{r['simulated_p50_ms']:.1f}", f"{100 * r['p50_error']:+.1f} %", f"{r['measured_mean_ms']:.1f}",
          f"{r['simulated_mean_ms']:.1f}", f"{100 * r['mean_error']:+.1f} %",
          f"{opt(r.get('post_measured_ms'))} / {opt(r.get('post_duty_ms'))} / {opt(r.get('post_model2_ms'))}",
          opt(r.get("skew_duty_ms")),
          "-" if r.get("together_p50_error") is None else
          f"{100 * r['together_p50_error']:+.1f} % / {100 * r['together_mean_error']:+.1f} %",
          opt(r.get("model2_p50_error") and 100 * r["model2_p50_error"], "{:+.1f} %")]
         for r in res["validate"]["rows"]]
    t["validate"] = md_table(["hosts", "Q", "step cost c (ms)", "measured p50", "simulated p50", "error",
                              "measured mean", "simulated mean", "error",
                              "beyond the decision (ms): measured / idle runs / 2-host model",
                              "last READY after the coordinator's (idle runs, ms)",
                              "ranks starting together: p50 / mean error",
                              "2-host model: p50 error"], v)
    cal = res["validate"]["calibration"]
    if cal:
        t["validate"] += (f"\nNetwork model fitted on 2 emulated hosts: alpha {cal['alpha_us']:.1f} us, "
                          f"beta {cal['beta_ns_per_byte']:.2f} ns/B, rtt {cal['rtt_us']:.1f} us.\n")
    return t


# ---------------------------------------------------------------- commands

def claims_md(claims, ids=None):
    """The claim table (the rows whose id is in `ids`, all without)."""
    return md_table(["claim", "paper", "qring setup", "qring's number [95 % interval]", "verdict"],
                    [[f"{c['id']}: {c['claim']}", c["paper"], c["setup"], c["number"], c["verdict"]]
                     for c in claims if ids is None or c["id"] in ids])


def analyze(d):
    res = {"scale": read_json(os.path.join(d, "scale.json")) if os.path.exists(os.path.join(d, "scale.json")) else {},
           "kth": kth_part(d),
           "bsweep": [s for s in (sweep_part(d, "bsweep", g, 100) for g in REGIMES) if s],
           "bsweep1000": [s for s in [sweep_part(d, "bsweep1000", "trace", 1000)] if s],
           "async": async_part(d, "async"), "real": async_part(d, "real"),
           "depth": depth_part(d), "validate": validate_part(d)}
    res["depth_w"] = None
    for r in runs(os.path.join(d, "depth"), r"d\d+-s\d+-full").values():
        res["depth_w"] = r["summary"]["workers"]
        break
    claims = claims_of(res)
    os.makedirs(os.path.join(d, "tables"), exist_ok=True)
    with open(os.path.join(d, "tables", "results.json"), "w") as f:
        json.dump(res, f, indent=1, default=lambda o: None)
    for name, text in tables_md(res).items():
        with open(os.path.join(d, "tables", name + ".md"), "w") as f:
            f.write(text)
    with open(os.path.join(d, "claims.json"), "w") as f:
        json.dump(claims, f, indent=1)
    md = claims_md(claims)
    with open(os.path.join(d, "claims.md"), "w") as f:
        f.write(md)
    palette.apply()
    pd = os.path.join(d, "plots")
    if res["kth"]:
        plot_kth(res["kth"], os.path.join(pd, "kth-arrival.png"))
    if res["bsweep"]:
        plot_sweep(res["bsweep"], os.path.join(pd, "bsweep.png"),
                   "time to the target against backup workers, N + b = 100")
    if res["bsweep1000"]:
        plot_sweep(res["bsweep1000"], os.path.join(pd, "bsweep1000.png"),
                   "time to the target against backup workers, N + b = 1000")
    if res["async"]:
        plot_async(res["async"], os.path.join(pd, "async.png"),
                   "sync against tuned async, simulated workers, real trace", "W =")
    if res["depth"]["rows"]:
        plot_async(res["depth"]["rows"], os.path.join(pd, "depth.png"),
                   f"sync against tuned async by depth, W = {res['depth_w']}", "hidden layers:")
    if res["real"]:
        plot_async(res["real"], os.path.join(pd, "real.png"),
                   "qring-train: full sync, one backup, tuned async (real trace)", "ranks:")
    plot_auto(d, os.path.join(pd, "auto.png"))
    if res["validate"]["rows"]:
        plot_validation(res["validate"], os.path.join(pd, "validation.png"))
    print(md)


EXPECTED_PLOTS = ["kth-arrival", "bsweep", "bsweep1000", "async", "depth", "real", "auto", "validation"]
EXPECTED_TABLES = ["kth", "bsweep", "bsweep1000", "async", "depth", "real", "validate"]


def check(d):
    """Every artefact of analyze is there and well formed (not whether the claims hold)."""
    bad = []
    for name in EXPECTED_PLOTS:
        p = os.path.join(d, "plots", name + ".png")
        if name == "validation" and os.path.exists(os.path.join(d, "validate", "skipped.txt")):
            continue
        if not os.path.exists(p) or os.path.getsize(p) < 1000:
            bad.append(f"plot {p}")
    for name in EXPECTED_TABLES:
        p = os.path.join(d, "tables", name + ".md")
        if not os.path.exists(p) or "|" not in open(p).read():
            bad.append(f"table {p}")
    claims = read_json(os.path.join(d, "claims.json"))
    for cid in ("P1", "P2", "P3a", "P3b", "P3c", "P4", "auto"):
        if not any(c["id"] == cid for c in claims):
            bad.append(f"claim row {cid}")
    for c in claims:
        if not c["number"] or c["number"] == "-" or not c["verdict"]:
            bad.append(f"claim {c['id']} ({c['setup']}) without a number or verdict")
    if bad:
        sys.exit("check: missing or malformed:\n  " + "\n  ".join(bad))
    print(f"check: {len(EXPECTED_PLOTS)} plots, {len(EXPECTED_TABLES)} tables, {len(claims)} claims: ok")


PLOT_OF = {"kth": "kth-arrival", "validate": "validation"}  # a table's plot, where named apart
DERIVED = {"bsweep": ["auto"]}  # tables and plots made from another part's runs
PARTS = ("kth", "bsweep", "bsweep1000", "async", "real", "depth", "validate")


def int_keys(o):
    """JSON's string keys back to the integers (seeds, b values) analyze keyed them by."""
    if isinstance(o, dict):
        return {int(k) if isinstance(k, str) and k.lstrip("-").isdigit() else k: int_keys(v)
                for k, v in o.items()}
    return [int_keys(x) for x in o] if isinstance(o, list) else o


def merged_results(d, parts, tables):
    """The results behind the page (TABLES/results.json) with PARTS taken from DIR's own: the
    claims of every part when some were run again into a DIR of their own."""
    res = int_keys(read_json(os.path.join(tables, "results.json")))
    new = int_keys(read_json(os.path.join(d, "tables", "results.json")))
    for p in parts:
        res[p] = new[p]
    return res


def publish(d, only=(), docs=os.path.join(ROOT, "docs")):
    """DIR's plots and tables into docs/reproduction/, its claim table and tables into the
    blocks of docs/reproduction.md marked <!-- BEGIN name --> ... <!-- END name -->; with
    `only` (parts or table names, e.g. validate) those tables, their blocks and plots alone (a
    part run again into a DIR of its own), and the claims of the page's results with those
    parts replaced by DIR's."""
    import shutil
    dst = os.path.join(docs, "reproduction")
    os.makedirs(os.path.join(dst, "tables"), exist_ok=True)
    names = set(only) | {x for n in only for x in DERIVED.get(n, [])}
    wanted = lambda p: not only or os.path.basename(p).split(".")[0] in (  # noqa: E731
        names | {PLOT_OF.get(n, n) for n in names})
    for p in glob.glob(os.path.join(d, "plots", "*.png")):
        if wanted(p):
            shutil.copy(p, dst)
    for p in glob.glob(os.path.join(d, "tables", "*.md")) + [os.path.join(d, "tables", "results.json")]:
        if wanted(p):
            shutil.copy(p, os.path.join(dst, "tables"))
    parts = [n for n in only if n in PARTS]
    if not only:
        claims = read_json(os.path.join(d, "claims.json"))
    elif parts:
        res = merged_results(d, parts, os.path.join(dst, "tables"))
        claims = claims_of(res)
        with open(os.path.join(dst, "tables", "results.json"), "w") as f:
            json.dump(res, f, indent=1, default=lambda o: None)
    if not only or parts:
        with open(os.path.join(dst, "tables", "claims.json"), "w") as f:
            json.dump(claims, f, indent=1)
        with open(os.path.join(dst, "tables", "claims.md"), "w") as f:
            f.write(claims_md(claims))
    page = os.path.join(docs, "reproduction.md")
    text = open(page).read()
    # The page's claim table holds the paper's claims; the simulator's checks and the adaptive
    # quorum's have their own sections (blocks validate and auto).
    blocks = {} if only and not parts else {"claims": claims_md(claims, ("P1", "P2", "P3a", "P3b", "P3c", "P4"))}
    for p in glob.glob(os.path.join(d, "tables", "*.md")):
        if wanted(p):
            blocks[os.path.basename(p)[:-3]] = open(p).read()
    for name, body in blocks.items():
        text = re.sub(rf"(<!-- BEGIN {name} -->\n).*?(<!-- END {name} -->)",
                      lambda m: m.group(1) + body + m.group(2), text, flags=re.S)
    with open(page, "w") as f:
        f.write(text)
    print(f"publish: {d} -> {dst}, {page}")


def fake_times(out, ranks, steps, seed):
    """A made-up job trace for --smoke: lognormal per-rank times around 1000 ms."""
    rng = random.Random(seed)
    with open(out, "w") as f:
        f.write(f"# made up (reproduce.py fake-times, seed {seed}): STEP RANK MS\n")
        for s in range(steps):
            for r in range(ranks):
                f.write(f"{s} {r} {1000 * rng.lognormvariate(0, 0.2):.1f}\n")


def main():
    cmds = {"analyze": (1, lambda a: analyze(a[0])), "check": (1, lambda a: check(a[0])),
            "publish": (1, lambda a: publish(a[0], a[1:])),
            "calibrate": (2, lambda a: calibrate(a[0], [x for x in a[1:] if not x.startswith("--min-bytes=")],
                                                 min((int(x.split("=")[1]) for x in a[1:]
                                                      if x.startswith("--min-bytes=")), default=0))),
            "tune-async": (2, lambda a: tune_async(a[0], a[1])),
            "step-cost": (1, lambda a: step_cost(a[0])),
            "post-arrival": (3, lambda a: post_arrival(a[0], a[1], a[2:])),
            "fake-times": (4, lambda a: fake_times(a[0], int(a[1]), int(a[2]), int(a[3])))}
    if len(sys.argv) < 2 or sys.argv[1] not in cmds or len(sys.argv) - 2 < cmds[sys.argv[1]][0]:
        sys.exit(__doc__)
    cmds[sys.argv[1]][1](sys.argv[2:])


if __name__ == "__main__":
    main()
