#!/usr/bin/python3
"""Plot qring-train and qring-sim runs: loss and accuracy, the k-th arrival curve, step times.

    scripts/plot.py runs/fmnist-mlp-backup runs/fmnist-mlp-full -o runs/compare.png
    scripts/plot.py --kth runs/fmnist-mlp-full -o runs/kth.png
    scripts/plot.py --steptime runs/a runs/b -o runs/steps.png
    scripts/plot.py --quorum runs/auto -o runs/quorum.png

(Debian's /usr/bin/python3 with python3-matplotlib, which scripts/setup.sh installs.)

Each argument is a run directory (with metrics.jsonl, and arrivals.jsonl for --kth) or a
metrics.jsonl file. Default: one PNG with four panels: loss vs steps, loss vs time, test
accuracy vs steps, test accuracy vs time; one line per run, labelled with the run's name and
its quorum/straggler when known. Time is wall time for qring-train runs and virtual time for
qring-sim runs (their step lines carry virtual_s); for async runs a "step" is W updates, so
that one step is one gradient per worker in every mode.

--kth: the k-th arrival curve (Chen et al., figure 2): for each step, the time of the k-th of
the W contributions, in ms after the step's first, from arrivals.jsonl (qring-train's
coordinator log, or qring-sim's); median and p90 over steps against k. A contribution that
never arrived (a late rank that abandoned its step) counts as later than every other, so the
quantiles stay honest; a quantile that falls on one is not drawn.

--steptime: the distribution (CDF) of the step times: consecutive step lines' time
difference, leaving out steps that contained an evaluation.

--quorum: Q(t), the quorum each step was decided with (quorum "auto" chooses it per step).

Every figure has a title, labelled axes and a legend; a run's colour is its method's
(scripts/palette.py: full sync, backups, async, auto), runs of one method differ in line
style.
"""
import argparse
import json
import math
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import palette  # noqa: E402


def read_jsonl(path):
    out = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as e:
                sys.exit(f"{path}:{n}: not JSON ({e})")
    return out


def run_paths(path):
    metrics = path if path.endswith(".jsonl") else os.path.join(path, "metrics.jsonl")
    return metrics, os.path.dirname(metrics)


def summary_of(run_dir):
    p = os.path.join(run_dir, "summary.json")
    if os.path.exists(p):
        with open(p) as f:
            return json.load(f)
    return {}


def label_of(run_dir, s):
    label = os.path.basename(os.path.normpath(run_dir)) or run_dir
    if s.get("mode") == "async":
        label += f" (async, W={s.get('world', s.get('workers'))}, {s.get('straggler')})"
    elif "workers" in s:  # qring-sim
        label += f" (N={s.get('quorum')}/{s.get('workers')}, {s.get('straggler')})"
    elif s:
        label += f" (Q={s.get('quorum')}/{s.get('world')}, {s.get('straggler')})"
    return label


def style_of(runs):
    """Per run: its method's colour and, among the runs of one method, the next line style."""
    seen, out = {}, []
    for path in runs:
        _, run_dir = run_paths(path)
        m = palette.method_of(summary_of(run_dir))
        i = seen.get(m, 0)
        seen[m] = i + 1
        out.append({"color": palette.method_color(m),
                    "linestyle": palette.STYLES[i % len(palette.STYLES)]})
    return out


def time_of(line):
    return line["virtual_s"] if "virtual_s" in line else line["wall_s"]


def load(path):
    """(label, step lines, eval lines, summary, world) of a run."""
    metrics, run_dir = run_paths(path)
    lines = read_jsonl(metrics)
    steps = [j for j in lines if j.get("type", "step") == "step"]
    evals = [j for j in lines if j.get("type") == "eval"]
    s = summary_of(run_dir)
    world = int(s.get("world", s.get("workers", 1)) or 1)
    return label_of(run_dir, s), steps, evals, s, world


def step_scale(s, world):
    """Divides an async run's update numbers into steps of one gradient per worker."""
    return world if s.get("mode") == "async" and "workers" not in s else 1


def smooth(values, k=20):
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= k:
            acc -= values[i - k]
        out.append(acc / min(i + 1, k))
    return out


def step_times_ms(path):
    """Step durations (ms) of a run: consecutive step lines' time difference, leaving out the
    steps that contained an evaluation (for qring-sim, its own step_ms)."""
    metrics, _ = run_paths(path)
    lines = read_jsonl(metrics)
    if any("virtual_s" in j for j in lines):
        return [j["step_ms"] for j in lines if j.get("type", "step") == "step"]
    out, prev, after_eval = [], None, False
    for j in lines:
        if j.get("type") == "eval":
            after_eval = True
            continue
        if j.get("type", "step") != "step":
            continue
        if prev is not None and not after_eval:
            out.append(1000.0 * (j["wall_s"] - prev))
        prev, after_eval = j["wall_s"], False
    return out


def quantile(sorted_values, q):
    """Nearest-rank quantile of a sorted list (math.inf allowed)."""
    if not sorted_values:
        return math.nan
    i = min(len(sorted_values) - 1, max(0, int(round(q * (len(sorted_values) - 1)))))
    return sorted_values[i]


def kth_curve(path):
    """k, median and p90 of the k-th arrival (ms after the step's first) over the steps of a
    run's arrivals.jsonl; inf where the quantile falls on a contribution that never arrived."""
    _, run_dir = run_paths(path)
    arr = os.path.join(run_dir, "arrivals.jsonl")
    if not os.path.exists(arr):
        sys.exit(f"{arr}: no arrival log (qring-train's coordinator writes it)")
    per_step = []
    for j in read_jsonl(arr):
        offs = [o if o is not None and o >= 0 else math.inf for o in j["ready_ms"]]
        per_step.append(sorted(offs))
    if not per_step:
        sys.exit(f"{arr}: empty")
    n = max(len(s) for s in per_step)
    ks, med, p90 = [], [], []
    for k in range(1, n + 1):
        col = sorted(s[k - 1] if len(s) >= k else math.inf for s in per_step)
        ks.append(k)
        med.append(quantile(col, 0.5))
        p90.append(quantile(col, 0.9))
    return ks, med, p90


def train_time_evals(path):
    """(step, seconds, accuracy) of each evaluation, with the evaluations' own time taken out:
    for qring-train, the wall time of the last step before the evaluation minus the time spent
    in earlier evaluations (sync and async alike pause training to evaluate); for qring-sim,
    virtual time (evaluations take none)."""
    metrics, _ = run_paths(path)
    out, last_step_t, spent = [], 0.0, 0.0
    for j in read_jsonl(metrics):
        kind = j.get("type", "step")
        if "virtual_s" in j:
            if kind == "eval":
                out.append((j["step"], j["virtual_s"], j["test_accuracy"]))
            continue
        if kind == "step":
            last_step_t = j["wall_s"]
        elif kind == "eval":
            out.append((j["step"], last_step_t - spent, j["test_accuracy"]))
            spent += j["wall_s"] - last_step_t
            last_step_t = j["wall_s"]
    return out


def draw_accuracy(ax, runs, by="time", labels=None):
    """Test accuracy of each run against training time (evaluations taken out) or steps."""
    for i, (path, style) in enumerate(zip(runs, style_of(runs))):
        label, _, _, s, world = load(path)
        scale = step_scale(s, world)
        ev = train_time_evals(path)
        x = [t for _, t, _ in ev] if by == "time" else [st / scale for st, _, _ in ev]
        ax.plot(x, [100 * a for _, _, a in ev], marker="o", markersize=3,
                label=labels[i] if labels else label, **style)
    ax.set_xlabel("training time (s)" if by == "time" else "step")
    ax.set_ylabel("test accuracy (%)")
    ax.grid(alpha=0.3)


def draw_kth(ax, runs, fraction=False, labels=None):
    for i, path in enumerate(runs):
        _, run_dir = run_paths(path)
        label = labels[i] if labels else label_of(run_dir, summary_of(run_dir))
        ks, med, p90 = kth_curve(path)
        x = [k / len(ks) for k in ks] if fraction else ks
        fin = lambda v: [y if math.isfinite(y) else math.nan for y in v]  # noqa: E731
        color = f"C{i}"  # one run per colour: they are the same method
        ax.plot(x, fin(med), marker="." if len(ks) <= 16 else None, color=color,
                label=f"{label} median")
        ax.plot(x, fin(p90), linestyle="--", color=color, label=f"{label} p90")
    ax.set_xlabel("k / n" if fraction else "k (the k-th gradient of the step)")
    ax.set_ylabel("arrival after the step's first (ms)")
    ax.grid(alpha=0.3)


def draw_steptime(ax, runs, labels=None):
    for i, (path, style) in enumerate(zip(runs, style_of(runs))):
        _, run_dir = run_paths(path)
        s = summary_of(run_dir)
        if s.get("mode") == "async" and "workers" not in s:
            continue  # a parameter server has updates, not steps: no step time to show
        label = labels[i] if labels else label_of(run_dir, s)
        v = sorted(step_times_ms(path))
        if v:
            ax.plot(v, [(k + 1) / len(v) for k in range(len(v))], label=label, **style)
    ax.set_xlabel("step time (ms)")
    ax.set_ylabel("fraction of steps at most that long")
    ax.grid(alpha=0.3)


def draw_quorum(ax, runs, labels=None):
    """Q(t), the quorum each step was decided with (the `quorum` key of step lines)."""
    for i, (path, style) in enumerate(zip(runs, style_of(runs))):
        label, steps, _, s, world = load(path)
        pts = [(j["step"], j["quorum"]) for j in steps if "quorum" in j]
        if pts:
            ax.step([p[0] for p in pts], [p[1] for p in pts], where="post",
                    label=labels[i] if labels else label, **style)
    ax.set_xlabel("step")
    ax.set_ylabel("quorum Q(t)")
    ax.grid(alpha=0.3)


def plot_training(runs, smooth_steps=20, title=None, ylim=None):
    fig, ax = plt.subplots(2, 2, figsize=(12, 8.5))
    for path, style in zip(runs, style_of(runs)):
        label, steps, evals, s, world = load(path)
        scale = step_scale(s, world)
        if steps:
            x = [j["step"] / scale for j in steps]
            t = [time_of(j) for j in steps]
            loss = smooth([j["loss"] for j in steps], smooth_steps * scale)
            ax[0][0].plot(x, loss, label=label, **style)
            ax[0][1].plot(t, loss, label=label, **style)
        if evals:
            ax[1][0].plot([e["step"] / scale for e in evals],
                          [100 * e["test_accuracy"] for e in evals], marker="o", markersize=3,
                          label=label, **style)
            ax[1][1].plot([time_of(e) for e in evals], [100 * e["test_accuracy"] for e in evals],
                          marker="o", markersize=3, label=label, **style)
    panels = [("training loss against steps", "training loss (moving average)", "step"),
              ("training loss against time", "training loss (moving average)", "time (s)"),
              ("test accuracy against steps", "test accuracy (%)", "step"),
              ("test accuracy against time", "test accuracy (%)", "time (s)")]
    for a, (t, y, x) in zip([ax[0][0], ax[0][1], ax[1][0], ax[1][1]], panels):
        a.set_title(t)
        a.set_xlabel(x)
        a.set_ylabel(y)
    ax[0][0].set_yscale("log")
    ax[0][1].set_yscale("log")
    if ylim:
        ax[1][0].set_ylim(*ylim)
        ax[1][1].set_ylim(*ylim)
    ax[1][1].legend()
    fig.suptitle(title or "training runs (time: wall for qring-train, virtual for qring-sim)")
    return fig


def plot_kth(runs, fraction=False, title=None):
    fig, ax = plt.subplots(figsize=(7, 4.5))
    draw_kth(ax, runs, fraction)
    ax.legend()
    ax.set_title(title or "time until the k-th gradient of a step arrives")
    return fig


def plot_quorum(runs, title=None):
    fig, ax = plt.subplots(figsize=(7, 4))
    draw_quorum(ax, runs)
    ax.legend()
    ax.set_title(title or "quorum Q(t) of each step")
    return fig


def plot_steptime(runs, title=None):
    fig, ax = plt.subplots(figsize=(7, 4.5))
    draw_steptime(ax, runs)
    ax.legend()
    ax.set_title(title or "step-time distribution (sync runs)")
    return fig


def save(fig, output, dpi=100):
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    fig.savefig(output, dpi=dpi)
    plt.close(fig)
    print(f"wrote {output}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", help="run directories or metrics.jsonl files")
    ap.add_argument("-o", "--output", default="runs/plot.png", help="PNG to write")
    ap.add_argument("--smooth", type=int, default=20, help="moving average over N steps")
    ap.add_argument("--kth", action="store_true", help="the k-th arrival curve")
    ap.add_argument("--fraction", action="store_true", help="--kth: k / n on the x axis")
    ap.add_argument("--steptime", action="store_true", help="the step-time distribution")
    ap.add_argument("--quorum", action="store_true", help="Q(t), the quorum of every step")
    ap.add_argument("--title", help="figure title")
    ap.add_argument("--ylim", type=float, nargs=2, help="accuracy axis range (%%)")
    ap.add_argument("--dpi", type=int, default=100, help="resolution of the PNG")
    args = ap.parse_args()
    palette.apply()
    for path in args.runs:
        if not os.path.exists(path):
            sys.exit(f"{path}: no such run")
    if args.kth:
        fig = plot_kth(args.runs, args.fraction, args.title)
    elif args.steptime:
        fig = plot_steptime(args.runs, args.title)
    elif args.quorum:
        fig = plot_quorum(args.runs, args.title)
    else:
        fig = plot_training(args.runs, args.smooth, args.title, args.ylim)
    save(fig, args.output, args.dpi)


if __name__ == "__main__":
    main()
