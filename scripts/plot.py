#!/usr/bin/python3
"""Plot qring-train runs: loss and test accuracy against wall time and steps.

    scripts/plot.py runs/fmnist-mlp-backup runs/fmnist-mlp-full -o runs/compare.png

(Debian's /usr/bin/python3 with python3-matplotlib, which scripts/setup.sh installs.)

Each argument is a run directory (with metrics.jsonl) or a metrics.jsonl file. One PNG with
four panels: loss vs steps, loss vs wall time, test accuracy vs steps, test accuracy vs wall
time; one line per run, labelled with the run's name and its quorum/straggler when known.
"""
import argparse
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def load(path):
    metrics = path if path.endswith(".jsonl") else os.path.join(path, "metrics.jsonl")
    run_dir = os.path.dirname(metrics)
    steps, evals = [], []
    with open(metrics) as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                j = json.loads(line)
            except json.JSONDecodeError as e:
                sys.exit(f"{metrics}:{n}: not JSON ({e})")
            (evals if j.get("type") == "eval" else steps).append(j)
    label = os.path.basename(os.path.normpath(run_dir)) or metrics
    summary = os.path.join(run_dir, "summary.json")
    if os.path.exists(summary):
        with open(summary) as f:
            s = json.load(f)
        label += f" (Q={s.get('quorum')}/{s.get('world')}, {s.get('straggler')})"
    return label, steps, evals


def smooth(values, k=20):
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= k:
            acc -= values[i - k]
        out.append(acc / min(i + 1, k))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", help="run directories or metrics.jsonl files")
    ap.add_argument("-o", "--output", default="runs/plot.png", help="PNG to write")
    ap.add_argument("--smooth", type=int, default=20, help="moving average over N steps")
    args = ap.parse_args()

    fig, ax = plt.subplots(2, 2, figsize=(12, 8))
    for path in args.runs:
        if not os.path.exists(path):
            sys.exit(f"{path}: no such run")
        label, steps, evals = load(path)
        if steps:
            x = [s["step"] for s in steps]
            t = [s["wall_s"] for s in steps]
            loss = smooth([s["loss"] for s in steps], args.smooth)
            ax[0][0].plot(x, loss, label=label)
            ax[0][1].plot(t, loss, label=label)
        if evals:
            ax[1][0].plot([e["step"] for e in evals], [100 * e["test_accuracy"] for e in evals],
                          marker="o", label=label)
            ax[1][1].plot([e["wall_s"] for e in evals], [100 * e["test_accuracy"] for e in evals],
                          marker="o", label=label)
    titles = [("training loss", "step"), ("training loss", "wall time (s)"),
              ("test accuracy (%)", "step"), ("test accuracy (%)", "wall time (s)")]
    for a, (y, x) in zip([ax[0][0], ax[0][1], ax[1][0], ax[1][1]], titles):
        a.set_xlabel(x)
        a.set_ylabel(y)
        a.grid(alpha=0.3)
    ax[0][0].set_yscale("log")
    ax[0][1].set_yscale("log")
    ax[1][1].legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    fig.savefig(args.output, dpi=100)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
