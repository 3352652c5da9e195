#!/usr/bin/python3
"""The analysis half of scripts/reproduce.sh (Chen et al., "Revisiting Distributed Synchronous
SGD", on qring's own runs; docs/reproduction.md).

    scripts/reproduce.py calibrate OUT.json BENCH.json...   the simulator's cost model
    scripts/reproduce.py trace ARRIVALS.jsonl OUT.txt        a full-sync run's arrivals as a
                                                             straggler trace for qring-sim
    scripts/reproduce.py regime-trace OUT W STEPS MU SIGMA SLOW FACTOR [FROM [SEED]]
                                                             the changing regime's trace
    scripts/reproduce.py replay-trace OUT TIMES W STEPS BASE_MS [SEED]
                                                             a real job's per-worker step
                                                             times as delays (../shared/traces)
    scripts/reproduce.py analyze DIR                         tables, plots, the claim table
    scripts/reproduce.py adaptive DIR                        part 4 alone (issue 18)
    scripts/reproduce.py check DIR                           every artefact there, well formed
    scripts/reproduce.py compare DIR...                      part 4's runs of several
                                                             directories: auto against the best
                                                             fixed quorum, with intervals

DIR is runs/reproduce (or the --out of reproduce.sh): real/ holds the qring-train runs,
sim/ the qring-sim runs, calibration/ the qring-bench rows. analyze writes DIR/tables/*.json,
DIR/plots/*.png, DIR/claims.json and DIR/claims.md, and prints the claim table; every number
in it is computed here from the runs' files.
"""
import glob
import json
import math
import os
import random
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import plot  # noqa: E402

TOLERANCE_VALIDATION = 0.10  # simulated vs measured step time (p50, p90)
TOLERANCE_CLOSED_FORM = 0.02  # simulated order statistics vs the closed form
TAIL_FRACTION = 0.05  # claim 1: the last 5 % of the gradients (at least one)
TAIL_SHARE = 0.5  # ... take at least half of the spread between the first and the last


# ---------------------------------------------------------------- reading runs

def read_json(path):
    with open(path) as f:
        return json.load(f)


def run_info(run_dir):
    """Everything the tables need about one run directory (qring-train or qring-sim)."""
    s = read_json(os.path.join(run_dir, "summary.json"))
    name = os.path.basename(os.path.normpath(run_dir))
    sim = "workers" in s
    world = s["workers"] if sim else s["world"]
    mode = s.get("mode", "sync")
    evals = plot.train_time_evals(run_dir)
    cfg_target = None
    cfg_path = os.path.join(run_dir, "config.toml")
    if os.path.exists(cfg_path):
        m = re.search(r"^target_accuracy\s*=\s*([0-9.eE+-]+)", open(cfg_path).read(), re.M)
        cfg_target = float(m.group(1)) if m else None
    target = s.get("target_accuracy", cfg_target)
    ttt = ttt3 = None
    if target:
        for _, t, a in evals:
            if a >= target:
                ttt = t
                break
        # The same on the running mean of three evaluations: less set by one evaluation
        # where the curve is flat near the target.
        for i in range(2, len(evals)):
            if sum(e[2] for e in evals[i - 2:i + 1]) / 3 >= target:
                ttt3 = evals[i][1]
                break
    steps = plot.step_times_ms(run_dir)
    srt = sorted(steps)
    info = {
        "name": name,
        "kind": "sim" if sim else "real",
        "mode": mode,
        "world": world,
        "quorum": None if mode == "async" else s.get("quorum"),
        "backups": None if mode == "async" or s.get("quorum") == "auto"
        else world - s.get("quorum", world),
        "quorum_histogram": s.get("quorum_histogram"),
        "straggler": s.get("straggler"),
        "final_accuracy": s.get("test_accuracy"),
        "best_accuracy": s.get("best_test_accuracy"),
        "target_accuracy": target,
        "time_to_target_s": ttt,
        "time_to_target_mean3_s": ttt3,
        "train_s": evals[-1][1] if evals else None,
        "step_p50_ms": plot.quantile(srt, 0.5) if srt else None,
        "step_p90_ms": plot.quantile(srt, 0.9) if srt else None,
        "steps": len(steps),
    }
    if mode == "async":
        info["staleness_mean"] = s.get("staleness_mean")
        info["staleness_max"] = s.get("staleness_max")
        if not sim:
            info["step_p50_ms"] = s.get("iteration_p50_ms")
            info["step_p90_ms"] = s.get("iteration_p90_ms")
    if not sim:
        info["wall_s"] = s.get("wall_s")
        info["mean_contributors"] = s.get("mean_contributors")
        comp = [j["compute_ms"] for j in plot.read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
                if j.get("type", "step") == "step" and j.get("compute_ms", 0) > 0]
        info["compute_p50_ms"] = plot.quantile(sorted(comp), 0.5) if comp else None
    else:
        info["virtual_s"] = s.get("virtual_s")
        info["kth_arrival_mean_ms"] = s.get("kth_arrival_mean_ms")
        info["compute_ms"] = s.get("compute_ms")
    return info


def runs_in(d):
    return sorted(p for p in glob.glob(os.path.join(d, "*"))
                  if os.path.exists(os.path.join(p, "summary.json")))


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


def calibrate(out, bench_files):
    """The simulator's cost model from qring-bench --op quorum --compare-allreduce rows (one
    run per rank count k, quorum k - 1, the quorum op and the plain all-reduce alternating
    step by step, sizes 4 KiB up), from the 2-rank rows, where each rank has a core of its
    own: the model's workers each have one (the 100-1000 simulated workers are a cluster that
    this 2-core machine cannot hold; with more ranks than cores a back-to-back all-reduce
    waits for descheduled peers at every round, 10-100x slower than in training, where ranks
    sleep between steps: the other rows are kept in the output for the record).
      alpha, beta   rounds(k, bytes) alpha + 2 (k - 1)/k bytes beta fitted by least squares
                    in the relative error to the plain all-reduce's medians at 2 ranks
      rtt           the READY/DECIDE round trip: the 2-rank quorum-1 op's median at the
                    smallest size (its reduction is empty)
    and, from rows run with --straggler shiftexp:IDLE:0 (every rank sleeps IDLE ms before
    each step, as ranks idle between steps in training), the measured time of a step beyond
    its contributors' arrival by the number of contributors N, full sync and with a backup:
    step_cost_ms, which the simulator uses for those N instead of rtt + the model (on this
    machine the reduction among N ranks, and with backups the READY/DECIDE exchange, cost
    milliseconds once the ranks must be woken and scheduled, where the model's 2-rank
    figures say microseconds)."""
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
    two = [r for r in ar if r["ranks"] == 2 and r["p50_us"] > 0]
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


def trace(arrivals, out):
    """A qring-train run's arrivals.jsonl as a straggler trace (lines "step rank ms"): each
    rank's delay = its arrival after the step's first. Needs every arrival (a full-sync run)."""
    lines = []
    for j in plot.read_jsonl(arrivals):
        for r, ms in enumerate(j["ready_ms"]):
            if ms is None or ms < 0:
                sys.exit(f"{arrivals}: step {j['step']}: rank {r} never arrived; only a "
                         "full-sync run's arrivals make a complete trace")
            lines.append(f"{j['step']} {r} {ms:.3f}")
    with open(out, "w") as f:
        f.write(f"# from {arrivals}: step rank ms (arrival after the step's first)\n")
        f.write("\n".join(lines) + "\n")
    print(f"trace: {len(lines)} entries -> {out}")


def regime_trace(out, workers, steps, mu, sigma, slow_rank, factor, start=None, seed=42):
    """A straggler trace (lines "step rank ms") for the regime that changes mid-run: every
    worker's delay lognormal(mu, sigma) ms (Python's generator, seeded), worker slow_rank's
    multiplied by `factor` from step `start` on (default steps / 2). The delays of the first
    steps do not depend on `steps`: a longer trace extends a shorter one."""
    import random
    rng = random.Random(seed)
    start = steps // 2 if start is None else start
    with open(out, "w") as f:
        f.write(f"# lognormal({mu}, {sigma}) ms every worker; worker {slow_rank} x{factor} from "
                f"step {start}\n")
        for t in range(steps):
            for w in range(workers):
                d = rng.lognormvariate(mu, sigma)
                if w == slow_rank and t >= start:
                    d *= factor
                f.write(f"{t} {w} {d:.3f}\n")
    print(f"trace: {workers} workers x {steps} steps -> {out}")


def replay_trace(out, times, workers, steps, base_ms, seed=42):
    """A straggler trace (lines "step rank ms") from a real job's per-worker compute times
    (TIMES: lines "STEP RANK MS", every step with the same ranks, e.g. ../shared/traces): step t
    replays the job's step t mod S (S its steps); in each pass over them (t div S) the workers
    are a fresh seeded random sample of the job's ranks, so W may be below the job's size and a
    pass does not repeat the last one rank for rank. A worker's delay is
    (MS / the fastest sampled worker's MS of that step - 1) x base_ms: the fastest maps to the
    model's own compute time, the others' excess to an injected delay."""
    steps_ms = {}
    try:
        f = open(times)
    except OSError as e:
        sys.exit(f"replay-trace: cannot read {times}: {e.strerror}")
    with f:
        for n, line in enumerate(f, 1):
            line = line.split("#")[0].strip()
            if not line:
                continue
            parts = line.split()
            try:
                if len(parts) != 3:
                    raise ValueError
                st, rank, ms = int(parts[0]), int(parts[1]), float(parts[2])
                if st < 0 or rank < 0 or not math.isfinite(ms) or ms <= 0:
                    raise ValueError
            except ValueError:
                sys.exit(f"replay-trace: {times}:{n}: expected 'STEP RANK MS' (MS > 0), got "
                         f"'{line}'")
            steps_ms.setdefault(st, {})[rank] = ms
    if not steps_ms:
        sys.exit(f"replay-trace: {times}: no entries")
    order = sorted(steps_ms)
    ranks = sorted(steps_ms[order[0]])
    for st in order:
        if sorted(steps_ms[st]) != ranks:
            sys.exit(f"replay-trace: {times}: step {st} has ranks other than step {order[0]}'s")
    if not 1 <= workers <= len(ranks):
        sys.exit(f"replay-trace: {workers} workers: the job has {len(ranks)} ranks")
    if steps < 1 or not math.isfinite(base_ms) or base_ms < 0:
        sys.exit("replay-trace: STEPS must be >= 1 and BASE_MS a number >= 0")
    rng = random.Random(seed)
    with open(out, "w") as f:
        f.write(f"# {os.path.basename(times)}: {len(order)} steps x {len(ranks)} ranks, "
                f"{workers} sampled per pass (seed {seed}); delay = (ms / fastest - 1) x "
                f"{base_ms} ms\n")
        sample = []
        for t in range(steps):
            if t % len(order) == 0:
                sample = rng.sample(ranks, workers)
            row = steps_ms[order[t % len(order)]]
            fastest = min(row[r] for r in sample)
            for w, r in enumerate(sample):
                f.write(f"{t} {w} {(row[r] / fastest - 1) * base_ms:.3f}\n")
    print(f"trace: {workers} workers x {steps} steps from {times} -> {out}")


# ---------------------------------------------------------------- the analysis

def harmonic(n):
    return sum(1.0 / i for i in range(1, n + 1))


def kth_medians(run_dir):
    ks, med, _ = plot.kth_curve(run_dir)
    return ks, med


def tail_share(run_dir):
    """Share of the spread of the median k-th arrival curve (k = 1 .. n) taken by the last
    ceil(5 % n) arrivals, and that number of arrivals."""
    ks, med = kth_medians(run_dir)
    n = len(ks)
    m = max(1, math.ceil(TAIL_FRACTION * n))
    if n < 2 or not all(math.isfinite(v) for v in med):
        return None, m, n
    spread = med[-1] - med[0]
    return ((med[-1] - med[-1 - m]) / spread if spread > 0 else 0.0), m, n


def fmt_s(v, unit="s", digits=1):
    return "not reached" if v is None else f"{v:.{digits}f} {unit}".strip()


ADAPTIVE_RE = re.compile(r"^(W|N)(\d+)-([a-z]+)-s(\d+)-(q\d+|b\d+|auto|bauto)$")

PART4_RE = re.compile(r"^(W|N)(\d+)-([a-z]+)-s(\d+)-([a-z]+\d*)$")


def part4_dirs(dirs, also_top=False):
    """The run directories of part 4 in DIRS (DIR/adaptive/real, DIR/adaptive/sim, and DIR itself
    if ALSO_TOP) named <W|N><world>-<regime>-s<seed>-<tag>, as (path, kind, world, regime, seed,
    tag); tag "q<Q>" / "b<b>" (fixed) or "auto..." ("bauto..." read as "auto...")."""
    for d in dirs:
        subs = ([(d, None)] if also_top else []) + [
            (os.path.join(d, "adaptive", k), k) for k in ("real", "sim")]
        for sub, kind in subs:
            for p in runs_in(sub):
                m = PART4_RE.match(os.path.basename(p))
                if not m:
                    continue
                tag = m.group(5)[1:] if m.group(5).startswith("bauto") else m.group(5)
                if not (tag.startswith("auto") or re.fullmatch(r"[qb]\d+", tag)):
                    continue
                yield (p, kind or ("real" if m.group(1) == "W" else "sim"), int(m.group(2)),
                       m.group(3), int(m.group(4)), tag)


def adaptive_runs(d):
    """Part 4's runs (DIR/adaptive/{real,sim}/<W|N><world>-<regime>-s<seed>-<config>), as
    {(kind, world, regime): {config: {seed: run_info}}}, config "auto" or the fixed quorum
    Q (real) / backups b (sim) as an int."""
    groups = {}
    for p, kind, world, regime, seed, tag in part4_dirs([d]):
        if tag.startswith("auto") and tag != "auto":  # a variant (auto600 ...): compare's
            continue
        info = run_info(p)
        s = read_json(os.path.join(p, "summary.json"))
        if kind == "sim":
            # (sync: only the N counted gradients of a step are computed)
            info["mean_contributors"] = (s["gradients_computed"] / info["steps"]
                                         if s.get("gradients_computed") and info["steps"]
                                         else None)
        info["budget"] = s.get("budget")
        cfg = "auto" if tag == "auto" else int(tag[1:])
        groups.setdefault((kind, world, regime), {}).setdefault(cfg, {})[seed] = info
    return groups


def mean(v):
    return sum(v) / len(v) if v else None


def adaptive_table(d):
    """One row per (kind, world, regime): every configuration's mean time to target and final
    accuracy over the seeds that every configuration ran (None: a seed did not reach it)."""
    rows = []
    for (kind, world, regime), cfgs in sorted(adaptive_runs(d).items()):
        seeds = sorted(set.intersection(*(set(v) for v in cfgs.values())))
        if not seeds or "auto" not in cfgs:
            continue
        per = {}
        for cfg, runs in cfgs.items():
            t = [runs[sd]["time_to_target_s"] for sd in seeds]
            t3 = [runs[sd]["time_to_target_mean3_s"] for sd in seeds]
            per[str(cfg)] = {
                "time_to_target_s": None if any(x is None for x in t) else mean(t),
                "time_to_target_by_seed_s": t,
                "time_to_target_mean3_s": None if any(x is None for x in t3) else mean(t3),
                "train_s": mean([runs[sd]["train_s"] for sd in seeds]),
                "final_accuracy": mean([runs[sd]["final_accuracy"] for sd in seeds]),
                "mean_contributors": mean([runs[sd]["mean_contributors"] for sd in seeds
                                           if runs[sd].get("mean_contributors") is not None]),
                "steps": mean([runs[sd]["steps"] for sd in seeds]),
            }
            if cfg == "auto":
                hist = {}
                for sd in seeds:
                    for q, c in (runs[sd].get("quorum_histogram") or {}).items():
                        hist[q] = hist.get(q, 0) + c
                per["auto"]["quorum_histogram"] = hist
        fixed = {c: v for c, v in per.items() if c != "auto" and v["time_to_target_s"]}
        best = min(fixed, key=lambda c: fixed[c]["time_to_target_s"]) if fixed else None
        full = str(world) if kind == "real" else "0"  # Q = W, b = 0
        rows.append({"kind": kind, "world": world, "regime": regime, "seeds": seeds,
                     "fixed": "quorum" if kind == "real" else "backups", "configs": per,
                     "best_fixed": int(best) if best else None, "full_sync": int(full),
                     "target_accuracy": next(iter(cfgs["auto"].values()))["target_accuracy"]})
    return rows


def adaptive_claims(d, claim, save):
    rows = adaptive_table(d)
    save("adaptive.json", rows)
    for r in rows:
        per, n = r["configs"], len(r["seeds"])
        a = per["auto"]["time_to_target_s"]
        best = per[str(r["best_fixed"])] if r["best_fixed"] is not None else None
        tb = best["time_to_target_s"] if best else None
        if r["kind"] == "sim":
            where = f"sim N+b={r['world']} {r['regime']}"
            text = f"18. {where}: auto within 5 % of the best fixed b in time to target (mean of {n} seed{'s' if n != 1 else ''})"
            if a and tb:
                claim(text, f"auto {a:.2f} s, best fixed b={r['best_fixed']} {tb:.2f} s "
                      f"({100 * (a / tb - 1):+.1f} %)", a <= 1.05 * tb, "plots/adaptive.png")
            else:
                claim(text, f"auto {fmt_s(a)}, best fixed {fmt_s(tb)}", False, "plots/adaptive.png")
            for b in (0, 20):
                if str(b) not in per:
                    continue
                t = per[str(b)]["time_to_target_s"]
                claim(f"18. {where}: auto >= 1.2x sooner than b={b} (mean of {n} seed{'s' if n != 1 else ''})",
                      f"{t / a:.2f}x" if a and t else f"auto {fmt_s(a)}, b={b} {fmt_s(t)}",
                      bool(a and (t is None or t / a >= 1.2)), "plots/adaptive.png")
        else:
            where = f"real W={r['world']} {r['regime']}"
            text = (f"18. {where}: auto at least matches the best fixed quorum in time to target "
                    f"(mean of {n} seed{'s' if n != 1 else ''})")
            if a and tb:
                claim(text, f"auto {a:.1f} s, best Q={r['best_fixed']} {tb:.1f} s ({tb / a:.2f}x)",
                      a <= tb, "plots/adaptive.png")
            else:
                claim(text, f"auto {fmt_s(a)}, best fixed {fmt_s(tb)}", False, "plots/adaptive.png")
            fa, ff = per["auto"]["final_accuracy"], per[str(r["full_sync"])]["final_accuracy"] \
                if str(r["full_sync"]) in per else None
            if fa is not None and ff is not None:
                dacc = 100 * (fa - ff)
                claim(f"18. {where}: auto's final accuracy within 0.3 pts of full sync or above "
                      f"(mean of {n} seed{'s' if n != 1 else ''})", f"{dacc:+.2f} pts", dacc >= -0.3, "plots/adaptive.png")
    plot_adaptive(d, rows)
    return rows


def plot_adaptive(d, rows):
    """plots/adaptive.png: mean time to target against the fixed quorum (real) or b (sim),
    auto as a horizontal line; plots/quorum.png: Q(t) of the first seed's auto runs."""
    if not rows:
        return
    import matplotlib.pyplot as plt
    pdir = os.path.join(d, "plots")
    os.makedirs(pdir, exist_ok=True)
    fig, ax = plt.subplots(1, len(rows), figsize=(3.2 * len(rows), 3.2), squeeze=False)
    for a, r in zip(ax[0], rows):
        fixed = sorted((int(c), v) for c, v in r["configs"].items() if c != "auto")
        xs = [c for c, v in fixed if v["time_to_target_s"]]
        a.plot(xs, [dict(fixed)[c]["time_to_target_s"] for c in xs], marker="o", label="fixed")
        t = r["configs"]["auto"]["time_to_target_s"]
        if t:
            a.axhline(t, color="C3", linestyle="--", label="auto")
        a.set_yscale("log")
        a.set_xlabel("fixed quorum Q" if r["kind"] == "real" else "backups b")
        a.set_title(f"{r['kind']} {'W' if r['kind'] == 'real' else 'N+b'}={r['world']} "
                    f"{r['regime']}", fontsize=8)
        a.grid(alpha=0.3)
    ax[0][0].set_ylabel("time to target (s), mean over seeds")
    ax[0][0].legend(fontsize=7)
    plot.save(fig, os.path.join(pdir, "adaptive.png"), dpi=60)
    autos = []
    for kind in ("real", "sim"):
        ps = [p for p in runs_in(os.path.join(d, "adaptive", kind))
              if (m := ADAPTIVE_RE.match(os.path.basename(p))) and m.group(5) in ("auto", "bauto")]
        first = min((int(ADAPTIVE_RE.match(os.path.basename(p)).group(4)) for p in ps), default=None)
        autos.append([p for p in ps if int(ADAPTIVE_RE.match(os.path.basename(p)).group(4)) == first])
    fig, ax = plt.subplots(1, 2, figsize=(12, 3.8))
    for a, ps, title in zip(ax, autos, ("qring-train, quorum auto: Q(t)",
                                        "qring-sim, quorum auto: N(t) of N+b=100")):
        if ps:
            plot.draw_quorum(a, ps, labels=[os.path.basename(p) for p in ps])
            a.legend(fontsize=6)
        a.set_title(title, fontsize=9)
    plot.save(fig, os.path.join(pdir, "quorum.png"), dpi=70)


def adaptive(d):
    """Part 4 alone (reproduce.sh --only adaptive): tables/adaptive.json, plots/adaptive.png,
    plots/quorum.png, adaptive/claims.{json,md}, and the claim table printed."""
    claims = []
    os.makedirs(os.path.join(d, "tables"), exist_ok=True)

    def save(name, obj):
        with open(os.path.join(d, "tables", name), "w") as f:
            json.dump(obj, f, indent=2)

    def claim(text, measured, holds, evidence):
        claims.append({"claim": text, "measured": measured, "holds": holds, "evidence": evidence})

    rows = adaptive_claims(d, claim, save)
    with open(os.path.join(d, "adaptive", "claims.json"), "w") as f:
        json.dump(claims, f, indent=2)
    md = ["| claim | measured here | holds? |", "|---|---|---|"]
    md += [f"| {c['claim']} | {c['measured']} | {'yes' if c['holds'] else 'no'} |" for c in claims]
    with open(os.path.join(d, "adaptive", "claims.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    with open(os.path.join(d, "adaptive", "tables.md"), "w") as f:
        f.write(adaptive_markdown(rows))
    print(adaptive_text(rows))
    print("\n".join(md))
    if not rows:
        sys.exit(f"reproduce.py adaptive: no runs of part 4 in {d}/adaptive")


def _cell(per, c, key, tail):
    """One table cell: configuration c's mean `key` (s, or — if a seed missed the target) and
    its `tail` ("acc": final accuracy in %, "train": training time in s)."""
    v = per.get(c)
    if v is None:
        return ""
    t = v[key]
    t = "—" if t is None else f"{t:.2f}"
    return f"{t} ({100 * v['final_accuracy']:.2f})" if tail == "acc" else f"{t} / {v['train_s']:.1f}"


def adaptive_markdown(rows):
    """Markdown tables of tables/adaptive.json, one per kind and world: a row per regime, a
    column per configuration, each cell the mean time to target (s) and final accuracy (%)."""
    out = []
    for kind, world in sorted({(r["kind"], r["world"]) for r in rows}):
        group = [r for r in rows if r["kind"] == kind and r["world"] == world]
        cfgs = sorted({c for r in group for c in r["configs"] if c != "auto"}, key=int)
        if kind == "real":
            out.append(f"qring-train, {world} ranks (fixed: the quorum Q):")
            heads = [f"Q={c}" for c in cfgs]
        else:
            out.append(f"qring-sim, N+b={world} (fixed: the backups b):")
            heads = [f"b={c}" for c in cfgs]
        out.append("Mean time to target in s (final accuracy in %) over the seeds.")
        out.append("")
        out.append("| regime (seeds) | " + " | ".join(heads) +
                   " | auto (mean N) | auto vs best fixed |")
        out.append("|---|" + "---|" * (len(heads) + 2))
        for r in group:
            per = r["configs"]
            a = per["auto"]["time_to_target_s"]
            best = per[str(r["best_fixed"])]["time_to_target_s"] if r["best_fixed"] is not None else None
            vs = f"{100 * (a / best - 1):+.1f} %" if a and best else "—"
            n = per["auto"]["mean_contributors"]
            out.append(f"| {r['regime']} ({', '.join(map(str, r['seeds']))}) | " +
                       " | ".join(_cell(per, c, "time_to_target_s", "acc") for c in cfgs) +
                       f" | {_cell(per, 'auto', 'time_to_target_s', 'acc')} "
                       f"({'' if n is None else f'{n:.1f}'}) | {vs} |")
        out.append("")
        out.append("The same runs: time to target on the running mean of three evaluations, and "
                   "the training time of the whole budget (s).")
        out.append("")
        out.append("| regime | " + " | ".join(heads) + " | auto | auto vs best fixed (mean of 3) |")
        out.append("|---|" + "---|" * (len(heads) + 2))
        for r in group:
            per = r["configs"]
            fx = [float(per[c]["time_to_target_mean3_s"]) for c in cfgs
                  if per.get(c) and per[c]["time_to_target_mean3_s"]]
            a3 = per["auto"]["time_to_target_mean3_s"]
            vs3 = f"{100 * (a3 / min(fx) - 1):+.1f} %" if a3 and fx else "—"
            out.append(f"| {r['regime']} | " +
                       " | ".join(_cell(per, c, "time_to_target_mean3_s", "train") for c in cfgs) +
                       f" | {_cell(per, 'auto', 'time_to_target_mean3_s', 'train')} | {vs3} |")
        out.append("")
    return "\n".join(out)


def adaptive_text(rows):
    """The table of tables/adaptive.json as text: mean time to target (s) per configuration."""
    out = []
    for r in rows:
        per = r["configs"]
        cfgs = sorted((c for c in per if c != "auto"), key=int) + ["auto"]
        out.append(f"{r['kind']} {'W' if r['kind'] == 'real' else 'N+b'}={r['world']} {r['regime']} "
                   f"(seeds {' '.join(map(str, r['seeds']))}), {r['fixed']}: time to target / final "
                   f"accuracy / mean contributors")
        for c in cfgs:
            v = per[c]
            n = v["mean_contributors"]
            out.append(f"  {c:>5}: {fmt_s(v['time_to_target_s'], digits=2):>11}  "
                       f"{100 * v['final_accuracy']:.2f} %  {'' if n is None else f'{n:.1f}'}")
    return "\n".join(out)


def analyze(d):
    real = [run_info(p) for p in runs_in(os.path.join(d, "real"))]
    sim = [run_info(p) for p in runs_in(os.path.join(d, "sim"))]
    tables = os.path.join(d, "tables")
    plots = os.path.join(d, "plots")
    os.makedirs(tables, exist_ok=True)
    os.makedirs(plots, exist_ok=True)
    by_name = {r["name"]: r for r in real + sim}
    claims = []

    def save(name, obj):
        with open(os.path.join(tables, name), "w") as f:
            json.dump(obj, f, indent=2)

    def claim(text, measured, holds, evidence):
        claims.append({"claim": text, "measured": measured, "holds": holds,
                       "evidence": evidence})

    save("real_runs.json", real)
    # Real runs are named W<world>-<regime>-<q<Q>|async>.
    regimes = sorted({r["name"].split("-")[1] for r in real})
    worlds = sorted({r["world"] for r in real})

    def real_run(w, regime, q):
        return by_name.get(f"W{w}-{regime}-{q}")

    # Claim 1: the k-th arrival curve has a long tail.
    kth_rows, kth_runs = [], []
    for r in real:
        if r["mode"] == "sync" and r["quorum"] == r["world"]:
            kth_runs.append(r)
    for r in sim:
        if r["name"].startswith("closedform-") or r["name"].startswith("bsweep"):
            if r["backups"] == 0 and r["mode"] == "sync":
                kth_runs.append(r)
    for r in kth_runs:
        run_dir = os.path.join(d, r["kind"], r["name"])
        share, m, n = tail_share(run_dir)
        kth_rows.append({"run": r["name"], "kind": r["kind"], "straggler": r["straggler"],
                         "n": n, "tail_arrivals": m, "tail_share": share})
    save("kth_arrival.json", kth_rows)
    for row in kth_rows:
        if row["tail_share"] is None:
            continue
        claim(f"1. the last {row['tail_arrivals']} of {row['n']} gradients take most of the "
              f"arrival spread ({row['kind']} {row['run']})",
              f"{100 * row['tail_share']:.0f} % of the spread "
              f"(uniform arrivals: {100 * row['tail_arrivals'] / max(1, row['n'] - 1):.0f} %)",
              row["tail_share"] >= TAIL_SHARE, "plots/kth-arrival.png")

    # Claim 2: sync with backups reaches the target sooner than full sync, same accuracy.
    c2 = []
    for w in worlds:
        for regime in regimes:
            full = real_run(w, regime, f"q{w}")
            if not full:
                continue
            for b in (1, 2):
                bk = real_run(w, regime, f"q{w - b}")
                if not bk:
                    continue
                ratio = (full["time_to_target_s"] / bk["time_to_target_s"]
                         if full["time_to_target_s"] and bk["time_to_target_s"] else None)
                dacc = 100 * (bk["final_accuracy"] - full["final_accuracy"])
                c2.append({"world": w, "regime": regime, "backups": b,
                           "full_time_to_target_s": full["time_to_target_s"],
                           "backup_time_to_target_s": bk["time_to_target_s"],
                           "speedup": ratio, "final_accuracy_delta_points": dacc,
                           "full_step_p50_ms": full["step_p50_ms"],
                           "backup_step_p50_ms": bk["step_p50_ms"]})
                meas = (f"{ratio:.2f}x sooner" if ratio else
                        f"target: full {fmt_s(full['time_to_target_s'])}, backups "
                        f"{fmt_s(bk['time_to_target_s'])}") + f", final accuracy {dacc:+.2f} pts"
                holds = bool(ratio and ratio > 1.0 and dacc >= -0.3)
                claim(f"2. W={w} {regime}: Q=W-{b} reaches the target sooner than Q=W, at the "
                      "same accuracy (within 0.3 pts)", meas, holds, "plots/real-accuracy.png")
    save("backup_vs_full.json", c2)
    aim = [x for x in c2 if x["world"] == 4 and x["regime"] == "lognormal" and x["backups"] == 1]
    if aim:
        x = aim[0]
        ok = bool(x["speedup"] and x["speedup"] >= 1.3 and abs(x["final_accuracy_delta_points"]) <= 0.3)
        claim("aim: lognormal, one backup of 4: target >= 1.3x sooner, final accuracy within "
              "0.3 pts",
              (f"{x['speedup']:.2f}x" if x["speedup"] else "target not reached") +
              f", {x['final_accuracy_delta_points']:+.2f} pts", ok, "plots/real-accuracy.png")

    # Claim 3: sync beats async in accuracy, more so with more workers (simulator), and async
    # staleness is about the number of workers.
    c3 = []
    for r in sim:
        mm = re.match(r"scale-W(\d+)-(async|b(\d+))$", r["name"])
        if not mm:
            continue
        c3.append({"workers": int(mm.group(1)), "run": r["name"], "mode": r["mode"],
                   "backups": r["backups"], "final_accuracy": r["final_accuracy"],
                   "best_accuracy": r["best_accuracy"], "time_to_target_s": r["time_to_target_s"],
                   "staleness_mean": r.get("staleness_mean")})
    c3.sort(key=lambda x: (x["workers"], x["mode"], x["backups"] or 0))
    save("async_vs_sync.json", c3)
    gaps = []
    for w in sorted({x["workers"] for x in c3}):
        a = [x for x in c3 if x["workers"] == w and x["mode"] == "async"]
        s = [x for x in c3 if x["workers"] == w and x["mode"] == "sync"]
        if not a or not s:
            continue
        best = max(s, key=lambda x: x["final_accuracy"])
        gap = 100 * (best["final_accuracy"] - a[0]["final_accuracy"])
        gaps.append((w, gap, best, a[0]))
        claim(f"3. {w} simulated workers: sync (b={best['backups']}) ends more accurate than "
              "async",
              f"{100 * best['final_accuracy']:.2f} % vs {100 * a[0]['final_accuracy']:.2f} % "
              f"({gap:+.2f} pts); async staleness mean {a[0]['staleness_mean']:.1f}",
              gap > 0, "plots/async-vs-sync.png")
    if len(gaps) >= 2:
        grows = all(gaps[i + 1][1] >= gaps[i][1] for i in range(len(gaps) - 1))
        claim("3. the gap grows with the number of workers",
              ", ".join(f"{w}: {g:+.2f}" for w, g, _, _ in gaps) + " pts", grows,
              "plots/async-vs-sync.png")
        stale_ok = all(abs(a["staleness_mean"] - (w - 1)) <= 0.2 * (w - 1) for w, _, _, a in gaps)
        claim("3. async gradients are stale by about the number of workers",
              ", ".join(f"W={w}: {a['staleness_mean']:.1f}" for w, _, _, a in gaps), stale_ok,
              "plots/async-vs-sync.png")
    for w in worlds:
        for regime in regimes:
            a = real_run(w, regime, "async")
            s = [real_run(w, regime, f"q{q}") for q in (w, w - 1, w - 2)]
            s = [x for x in s if x]
            if not a or not s:
                continue
            best = max(s, key=lambda x: x["final_accuracy"])
            gap = 100 * (best["final_accuracy"] - a["final_accuracy"])
            claim(f"3. real W={w} {regime}: sync (Q={best['quorum']}) ends more accurate than "
                  "async", f"{gap:+.2f} pts; async staleness mean {a['staleness_mean']:.1f}",
                  gap > 0, "plots/real-accuracy.png")
    if gaps:
        w100 = [g for g in gaps if g[0] == max(x[0] for x in gaps)][0]
        claim(f"aim: async below sync+backup in final accuracy at {w100[0]} simulated workers",
              f"{w100[1]:+.2f} pts", w100[1] > 0, "plots/async-vs-sync.png")

    # Claim 4: the b sweep at fixed N + b has an interior optimum in time to accuracy.
    for n in sorted({int(m.group(1)) for r in sim
                     for m in [re.match(r"bsweep(\d+)-b(\d+)$", r["name"])] if m}):
        rows = []
        for r in sim:
            mm = re.match(rf"bsweep{n}-b(\d+)$", r["name"])
            if mm:
                rows.append({"b": int(mm.group(1)), "time_to_target_s": r["time_to_target_s"],
                             "final_accuracy": r["final_accuracy"],
                             "step_p50_ms": r["step_p50_ms"], "step_p90_ms": r["step_p90_ms"],
                             "virtual_s": r["virtual_s"]})
        rows.sort(key=lambda x: x["b"])
        save(f"bsweep{n}.json", rows)
        reached = [x for x in rows if x["time_to_target_s"] is not None]
        base = [x for x in rows if x["b"] == 0]
        if not reached:
            claim(f"4. b sweep at N+b={n}: interior optimum", "no b reached the target", False,
                  "plots/bsweep.png")
            continue
        best = min(reached, key=lambda x: x["time_to_target_s"])
        interior = best["b"] != rows[0]["b"] and best["b"] != rows[-1]["b"]
        vs0 = (f", {base[0]['time_to_target_s'] / best['time_to_target_s']:.2f}x sooner than b=0"
               if base and base[0]["time_to_target_s"] else ", b=0 did not reach the target")
        claim(f"4. b sweep at N+b={n}: time to accuracy has an interior optimum "
              f"(b in {rows[0]['b']}..{rows[-1]['b']})",
              f"best b={best['b']} ({best['time_to_target_s']:.1f} virtual s){vs0}", interior,
              "plots/bsweep.png")

    # Validation: simulated step times against the measured ones, same model and workers.
    val = []
    for r in sim:
        mm = re.match(r"val-(W\d+-[a-z]+-q\d+)$", r["name"])
        if not mm or mm.group(1) not in by_name:
            continue
        m = by_name[mm.group(1)]
        e50 = r["step_p50_ms"] / m["step_p50_ms"] - 1
        e90 = r["step_p90_ms"] / m["step_p90_ms"] - 1
        val.append({"run": m["name"], "world": m["world"], "quorum": m["quorum"],
                    "measured_p50_ms": m["step_p50_ms"], "simulated_p50_ms": r["step_p50_ms"],
                    "measured_p90_ms": m["step_p90_ms"], "simulated_p90_ms": r["step_p90_ms"],
                    "error_p50": e50, "error_p90": e90, "compute_ms": r["compute_ms"]})
    save("validation.json", val)
    for v in val:
        claim(f"validation: simulated step time p50/p90 within 10 % of {v['run']}",
              f"p50 {v['simulated_p50_ms']:.1f} vs {v['measured_p50_ms']:.1f} ms "
              f"({100 * v['error_p50']:+.1f} %), p90 {v['simulated_p90_ms']:.1f} vs "
              f"{v['measured_p90_ms']:.1f} ms ({100 * v['error_p90']:+.1f} %)",
              abs(v["error_p50"]) <= TOLERANCE_VALIDATION and
              abs(v["error_p90"]) <= TOLERANCE_VALIDATION, "plots/validation.png")

    # Validation: the simulator's order statistics against the shifted-exponential closed form.
    cf = []
    for r in sim:
        mm = re.match(r"closedform-n(\d+)$", r["name"])
        if not mm or not r.get("kth_arrival_mean_ms"):
            continue
        sm = re.match(r"shiftexp:([0-9.]+):([0-9.]+)$", r["straggler"] or "")
        if not sm:
            continue
        shift, mean = float(sm.group(1)), float(sm.group(2))
        n = len(r["kth_arrival_mean_ms"])
        hn = harmonic(n)
        worst = 0.0
        for k in range(1, n + 1):
            expect = r["compute_ms"] + shift + mean * (hn - harmonic(n - k))
            worst = max(worst, abs(r["kth_arrival_mean_ms"][k - 1] / expect - 1))
        cf.append({"run": r["name"], "n": n, "steps": r["steps"], "straggler": r["straggler"],
                   "max_relative_error": worst})
        claim(f"validation: simulated E[T(k:{n})] within 2 % of shift + mean (H(n) - H(n-k)), "
              "every k", f"max error {100 * worst:.2f} % over {r['steps']} steps",
              worst <= TOLERANCE_CLOSED_FORM, "plots/kth-arrival.png")
    save("closed_form.json", cf)

    # Issue 18: the adaptive quorum against every fixed quorum (part 4, DIR/adaptive).
    adaptive_claims(d, claim, save)

    make_plots(d, real, sim, regimes, worlds, val)
    with open(os.path.join(d, "claims.json"), "w") as f:
        json.dump(claims, f, indent=2)
    md = ["| claim | measured here | holds? |", "|---|---|---|"]
    for c in claims:
        md.append(f"| {c['claim']} | {c['measured']} | {'yes' if c['holds'] else 'no'} |")
    with open(os.path.join(d, "claims.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    print("\n".join(md))


def make_plots(d, real, sim, regimes, worlds, val):
    import matplotlib.pyplot as plt
    pdir = os.path.join(d, "plots")
    rdir = os.path.join(d, "real")

    def names(w, regime):
        out = []
        for q in [f"q{w}", f"q{w - 1}", f"q{w - 2}", "async"]:
            p = os.path.join(rdir, f"W{w}-{regime}-{q}")
            if os.path.exists(os.path.join(p, "summary.json")):
                out.append((p, q if q in ("async", "auto") else f"Q={q[1:]}"))
        return out

    # Real runs: accuracy against training time and step-time distributions.
    if real:
        for what in ("accuracy", "steptime"):
            fig, ax = plt.subplots(len(worlds), len(regimes),
                                   figsize=(4.2 * len(regimes), 3.2 * len(worlds)), squeeze=False)
            for i, w in enumerate(worlds):
                for j, regime in enumerate(regimes):
                    runs = names(w, regime)
                    a = ax[i][j]
                    if what == "accuracy":
                        plot.draw_accuracy(a, [p for p, _ in runs], labels=[lab for _, lab in runs])
                        lo = min((100 * x["final_accuracy"] for x in real if x["world"] == w), default=0)
                        a.set_ylim(max(0, lo - 15), None)
                    else:
                        plot.draw_steptime(a, [p for p, _ in runs], labels=[lab for _, lab in runs])
                    a.set_title(f"W={w}, {regime}", fontsize=9)
                    a.legend(fontsize=7)
            fig.suptitle("qring-train: test accuracy vs training time" if what == "accuracy"
                         else "qring-train: step time (async: one worker's iteration)")
            plot.save(fig, os.path.join(pdir, f"real-{what}.png"), dpi=70)

    # The k-th arrival curve: real full-sync runs (k / n) and the simulator at 100 and 1000.
    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    reals = [os.path.join(rdir, x["name"]) for x in real
             if x["mode"] == "sync" and x["quorum"] == x["world"]]
    if reals:
        plot.draw_kth(ax[0], reals, fraction=True,
                      labels=[os.path.basename(p) for p in reals])
        ax[0].set_title("qring-train, full sync (coordinator's arrival log)", fontsize=9)
        ax[0].legend(fontsize=6)
    sims = [os.path.join(d, "sim", x["name"]) for x in sim
            if (x["name"].startswith("closedform-") or re.match(r"bsweep\d+-b0$", x["name"]))]
    if sims:
        plot.draw_kth(ax[1], sims, fraction=True, labels=[os.path.basename(p) for p in sims])
        ax[1].set_title("qring-sim", fontsize=9)
        ax[1].set_yscale("log")
        ax[1].legend(fontsize=6)
    plot.save(fig, os.path.join(pdir, "kth-arrival.png"), dpi=70)

    # The b sweeps: time to accuracy, step time and final accuracy against b.
    sweeps = sorted({int(m.group(1)) for x in sim
                     for m in [re.match(r"bsweep(\d+)-b\d+$", x["name"])] if m})
    if sweeps:
        fig, ax = plt.subplots(1, 3, figsize=(13, 3.8))
        for n in sweeps:
            rows = read_json(os.path.join(d, "tables", f"bsweep{n}.json"))
            bs = [r["b"] for r in rows]
            ax[0].plot(bs, [r["time_to_target_s"] if r["time_to_target_s"] is not None else math.nan
                            for r in rows], marker="o", label=f"N+b={n}")
            ax[1].plot(bs, [r["step_p50_ms"] for r in rows], marker="o", label=f"N+b={n}")
            ax[2].plot(bs, [100 * r["final_accuracy"] for r in rows], marker="o", label=f"N+b={n}")
        for a, y in zip(ax, ["virtual time to target (s)", "step time p50 (ms)",
                             "final test accuracy (%)"]):
            a.set_xlabel("backup workers b")
            a.set_ylabel(y)
            a.grid(alpha=0.3)
            a.legend(fontsize=7)
        fig.suptitle("qring-sim: the b sweep at fixed N + b")
        plot.save(fig, os.path.join(pdir, "bsweep.png"), dpi=70)
        # Accuracy against virtual time for the sweep at the smallest N + b.
        runs = sorted((x for x in sim if re.match(rf"bsweep{sweeps[0]}-b\d+$", x["name"])),
                      key=lambda x: x["backups"])
        fig, a = plt.subplots(figsize=(7, 4.2))
        plot.draw_accuracy(a, [os.path.join(d, "sim", x["name"]) for x in runs],
                           labels=[f"b={x['backups']}" for x in runs])
        a.set_xlabel("virtual time (s)")
        a.legend(fontsize=7, ncol=2)
        a.set_title(f"qring-sim, N+b={sweeps[0]}: test accuracy vs virtual time")
        plot.save(fig, os.path.join(pdir, "sim-accuracy.png"), dpi=70)

    # Async against sync at 10, 50, 100 simulated workers.
    rows = read_json(os.path.join(d, "tables", "async_vs_sync.json"))
    if rows:
        fig, ax = plt.subplots(1, 2, figsize=(11, 3.8))
        for label, sel in [("async", lambda x: x["mode"] == "async"),
                           ("sync b=0", lambda x: x["mode"] == "sync" and x["backups"] == 0),
                           ("sync with backups", lambda x: x["mode"] == "sync" and x["backups"])]:
            pts = sorted((x["workers"], 100 * x["final_accuracy"]) for x in rows if sel(x))
            if pts:
                ax[0].plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
        ax[0].set_xlabel("simulated workers")
        ax[0].set_ylabel("final test accuracy (%)")
        ax[0].set_xscale("log")
        ax[0].grid(alpha=0.3)
        ax[0].legend(fontsize=7)
        runs = [x for x in rows]
        plot.draw_accuracy(ax[1], [os.path.join(d, "sim", x["run"]) for x in runs],
                           labels=[x["run"].replace("scale-", "") for x in runs])
        ax[1].set_xlabel("virtual time (s)")
        ax[1].set_xscale("log")
        ax[1].legend(fontsize=6, ncol=2)
        fig.suptitle("qring-sim: sync vs async SGD")
        plot.save(fig, os.path.join(pdir, "async-vs-sync.png"), dpi=70)


    # Validation: simulated against measured step-time quantiles.
    if val:
        fig, a = plt.subplots(figsize=(5, 4.5))
        for q, mk in (("p50", "o"), ("p90", "s")):
            a.scatter([v[f"measured_{q}_ms"] for v in val], [v[f"simulated_{q}_ms"] for v in val],
                      marker=mk, label=q)
        hi = max(max(v["measured_p90_ms"], v["simulated_p90_ms"]) for v in val) * 1.1
        a.plot([0, hi], [0, hi], color="gray", linewidth=0.8)
        a.plot([0, hi], [0, 1.1 * hi], color="gray", linewidth=0.5, linestyle=":")
        a.plot([0, hi], [0, 0.9 * hi], color="gray", linewidth=0.5, linestyle=":")
        a.set_xlabel("qring-train step time (ms)")
        a.set_ylabel("qring-sim step time (ms)")
        a.grid(alpha=0.3)
        a.legend(fontsize=7)
        a.set_title("simulator vs real runs (dotted: +-10 %)")
        plot.save(fig, os.path.join(pdir, "validation.png"), dpi=70)


# ---------------------------------------------------------------- the artefact check

def check(d):
    """Every artefact of a reproduction is there and well formed; exits 1 naming what is not."""
    problems = []

    def need(cond, what):
        if not cond:
            problems.append(what)

    for sub in ("real", "sim"):
        runs = runs_in(os.path.join(d, sub))
        need(runs, f"{sub}/: no runs")
        for p in runs:
            s = read_json(os.path.join(p, "summary.json"))
            for key in ("test_accuracy", "best_test_accuracy"):
                need(isinstance(s.get(key), (int, float)) and 0 <= s[key] <= 1,
                     f"{p}/summary.json: {key}")
            lines = plot.read_jsonl(os.path.join(p, "metrics.jsonl"))
            need(any(j.get("type") == "step" for j in lines), f"{p}/metrics.jsonl: no step lines")
            if not s.get("arrivals_only"):
                need(any(j.get("type") == "eval" for j in lines), f"{p}/metrics.jsonl: no eval lines")
            if s.get("mode", "sync") == "sync" and not (sub == "sim" and "val-" in p):
                arr = os.path.join(p, "arrivals.jsonl")
                need(os.path.exists(arr) and plot.read_jsonl(arr), f"{p}/arrivals.jsonl")
            if s.get("mode") == "async":
                need(all("staleness" in j for j in lines if j.get("type") == "step"
                         and sub == "real") and "staleness_hist" in s,
                     f"{p}: async staleness missing")
    real_names = {os.path.basename(p) for p in runs_in(os.path.join(d, "real"))}
    for w in (4, 8):
        for regime in ("lognormal", "shiftexp", "noisy", "change"):
            runs = [f"q{w}", f"q{w - 1}", f"q{w - 2}"]
            runs += ["async"] if regime != "change" else []
            for q in runs:
                need(f"W{w}-{regime}-{q}" in real_names, f"real/W{w}-{regime}-{q} missing")
    sim_names = {os.path.basename(p) for p in runs_in(os.path.join(d, "sim"))}
    need(any(re.match(r"bsweep100-b\d+$", n) for n in sim_names), "sim/bsweep100-* missing")
    need(any(re.match(r"bsweep1000-b\d+$", n) for n in sim_names), "sim/bsweep1000-* missing")
    for w in (10, 50, 100):
        need(f"scale-W{w}-async" in sim_names, f"sim/scale-W{w}-async missing")
        need(any(re.match(rf"scale-W{w}-b\d+$", n) for n in sim_names), f"sim/scale-W{w}-b* missing")
    need(any(n.startswith("val-") for n in sim_names), "sim/val-* missing")
    need("bsweep1000-auto" in sim_names, "sim/bsweep1000-auto missing")
    # Part 4: every regime's auto and fixed runs, real at 4 and 8 ranks and simulated at 100.
    groups = adaptive_runs(d)
    for kind, worlds in (("real", (4, 8)), ("sim", (100,))):
        for w in worlds:
            for regime in ("lognormal", "shiftexp", "change"):
                cfgs = groups.get((kind, w, regime), {})
                need("auto" in cfgs and len(cfgs) >= 3,
                     f"adaptive/{kind}: {w} {regime}: auto and two fixed configurations needed")
                need(all(r.get("budget") == "gradients" for c in cfgs.values() for r in c.values()),
                     f"adaptive/{kind}: {w} {regime}: a run without train.budget = gradients")
    cmp_path = os.path.join(d, "adaptive", "compare.txt")
    need(os.path.exists(cmp_path), "adaptive/compare.txt missing")
    if os.path.exists(cmp_path):
        text = open(cmp_path).read()
        for head in ("## real W=4 ", "## real W=8 ", "## sim N+b=100 "):
            need(text.count(head) >= 3, f"adaptive/compare.txt: three regimes of {head[3:-1]}")
        need(text.count("  auto: ") >= 9, "adaptive/compare.txt: auto's gap in every group")
    need(any(n.startswith("closedform-") for n in sim_names), "sim/closedform-* missing")
    cal = os.path.join(d, "calibration", "calibration.json")
    need(os.path.exists(cal), "calibration/calibration.json missing")
    if os.path.exists(cal):
        c = read_json(cal)
        for k in ("alpha_us", "beta_ns_per_byte", "rtt_us"):
            need(isinstance(c.get(k), (int, float)) and c[k] >= 0, f"calibration.json: {k}")
    for t in ("real_runs", "kth_arrival", "backup_vs_full", "async_vs_sync", "bsweep100",
              "bsweep1000", "validation", "closed_form", "adaptive"):
        p = os.path.join(d, "tables", f"{t}.json")
        need(os.path.exists(p), f"tables/{t}.json missing")
        if os.path.exists(p):
            need(read_json(p), f"tables/{t}.json empty")
    for png in ("real-accuracy", "real-steptime", "kth-arrival", "bsweep", "sim-accuracy",
                "async-vs-sync", "validation", "quorum", "adaptive"):
        p = os.path.join(d, "plots", f"{png}.png")
        ok = os.path.exists(p) and os.path.getsize(p) > 1000
        if ok:
            with open(p, "rb") as f:
                ok = f.read(8) == b"\x89PNG\r\n\x1a\n"
        need(ok, f"plots/{png}.png missing or not a PNG")
    cj = os.path.join(d, "claims.json")
    need(os.path.exists(cj), "claims.json missing")
    if os.path.exists(cj):
        claims = read_json(cj)
        for prefix in ("1.", "2.", "3.", "4.", "validation: simulated step", "validation: simulated E",
                       "18. sim", "18. real"):
            need(any(c["claim"].startswith(prefix) for c in claims), f"claims.json: no '{prefix}' row")
        need(all(isinstance(c["holds"], bool) and c["measured"] for c in claims),
             "claims.json: a row without a measurement or verdict")
    if problems:
        print("reproduce check: FAILED\n  " + "\n  ".join(problems))
        sys.exit(1)
    print(f"reproduce check: every artefact in {d} is there and well formed")


# ---------------------------------------------------------------- compare (issue 18)

METRICS = (("time_to_target_s", "time to target (first crossing)"),
           ("time_to_target_mean3_s", "time to target (running mean of 3)"),
           ("train_s", "training time of the budget"))


def compare_runs(dirs):
    """Part 4's runs found in DIRS (each DIR, DIR/adaptive/real, DIR/adaptive/sim), as
    {(kind, world, regime): {config: {seed: run_info}}}; config "q<Q>" / "b<b>" (fixed) or the
    auto run's tag ("auto", "auto600": "bauto..." read as "auto..."). A later DIR's run
    replaces an earlier one of the same key (a rerun with a newer build)."""
    groups = {}
    for d in dirs:
        found = 0
        for p, kind, world, regime, seed, tag in part4_dirs([d], also_top=True):
            groups.setdefault((kind, world, regime), {}).setdefault(tag, {})[seed] = run_info(p)
            found += 1
        if not found:
            sys.exit(f"reproduce.py compare: no runs of part 4 in {d}")
    return groups


def compare_gap(per, auto, fixed, seeds, metric):
    """mean(auto) / min over the fixed configurations of their means - 1, over SEEDS."""
    a = mean([per[auto][s][metric] for s in seeds])
    best = min(mean([per[c][s][metric] for s in seeds]) for c in fixed)
    return a / best - 1


def compare(dirs, resamples=10000):
    """auto against the best fixed quorum, per (kind, world, regime) and metric, over the seeds
    that every configuration of the group ran and reached the target in: the means, the gap
    of auto's mean to the smallest fixed mean, its 95 % bootstrap interval (seeds drawn with
    replacement, the best fixed quorum chosen again in every draw, 10,000 draws with a fixed
    generator), and the paired gap: the geometric mean over the seeds of auto / the best fixed
    quorum (chosen on all the seeds) of the same seed, with its bootstrap interval."""
    rng = random.Random(1)
    out = []
    groups = compare_runs(dirs)
    for key in sorted(groups):
        per = groups[key]
        fixed = sorted((c for c in per if not c.startswith("auto")), key=lambda c: int(c[1:]))
        autos = sorted(c for c in per if c.startswith("auto"))
        if not fixed or not autos:
            continue
        kind, world, regime = key
        out.append(f"## {kind} {'W' if kind == 'real' else 'N+b'}={world} {regime}")
        cfgs = fixed + autos
        for metric, what in METRICS:
            seeds = sorted(set.intersection(*(set(s for s, i in per[c].items()
                                                   if i.get(metric) is not None)
                                               for c in cfgs)))
            if not seeds:
                continue
            means = {c: mean([per[c][s][metric] for s in seeds]) for c in cfgs}
            best = min(fixed, key=lambda c: means[c])
            out.append(f"{what}, {len(seeds)} seeds ({', '.join(map(str, seeds))}): "
                       + ", ".join(f"{c} {means[c]:.3f}" for c in cfgs) + f"; best fixed {best}")
            for a in autos:
                gap = means[a] / means[best] - 1
                draws, paired_draws = [], []
                logs = [math.log(per[a][s][metric] / per[best][s][metric]) for s in seeds]
                for _ in range(resamples):
                    pick = [rng.randrange(len(seeds)) for _ in seeds]
                    draws.append(compare_gap(per, a, fixed, [seeds[i] for i in pick], metric))
                    paired_draws.append(math.exp(mean([logs[i] for i in pick])) - 1)
                draws.sort()
                paired_draws.sort()
                lo, hi = draws[int(0.025 * resamples)], draws[int(0.975 * resamples) - 1]
                plo = paired_draws[int(0.025 * resamples)]
                phi = paired_draws[int(0.975 * resamples) - 1]
                paired = math.exp(mean(logs)) - 1
                wins = sum(1 for v in logs if v <= 0)
                out.append(f"  {a}: {gap * 100:+.1f} % [{lo * 100:+.1f}, {hi * 100:+.1f}] against "
                           f"{best}; paired {paired * 100:+.1f} % [{plo * 100:+.1f}, "
                           f"{phi * 100:+.1f}], at or before it in {wins} of {len(seeds)} seeds")
    print("\n".join(out))
    if not out:
        sys.exit("reproduce.py compare: no group has both a fixed quorum and auto")


def main():
    if len(sys.argv) < 3 or sys.argv[1] not in ("calibrate", "trace", "regime-trace",
                                                 "replay-trace", "analyze", "adaptive", "check",
                                                 "compare"):
        sys.exit(__doc__)
    cmd, args = sys.argv[1], sys.argv[2:]
    if cmd == "calibrate":
        calibrate(args[0], args[1:])
    elif cmd == "trace":
        trace(args[0], args[1])
    elif cmd == "regime-trace":
        if len(args) not in (7, 8, 9):
            sys.exit(__doc__)
        out, workers, steps, mu, sigma, slow, factor = args[:7]
        regime_trace(out, int(workers), int(steps), float(mu), float(sigma), int(slow),
                     float(factor), int(args[7]) if len(args) >= 8 else None,
                     int(args[8]) if len(args) == 9 else 42)
    elif cmd == "replay-trace":
        if len(args) not in (5, 6):
            sys.exit(__doc__)
        try:
            workers, steps, base = int(args[2]), int(args[3]), float(args[4])
            seed = int(args[5]) if len(args) == 6 else 42
        except ValueError:
            sys.exit("replay-trace: W, STEPS and SEED must be integers, BASE_MS a number")
        replay_trace(args[0], args[1], workers, steps, base, seed)
    elif cmd == "analyze":
        analyze(args[0])
    elif cmd == "adaptive":
        adaptive(args[0])
    elif cmd == "compare":
        compare(args)
    else:
        check(args[0])


if __name__ == "__main__":
    main()
