"""One look for every figure qring draws (scripts/plot.py, scripts/reproduce.py): one colour per
method and per straggler regime, the same in every figure, and font sizes readable at page
width. Colours are Okabe and Ito's colour-blind-safe set.

    import palette
    palette.apply()                          # fonts, grid, legend size
    ax.plot(x, y, color=palette.method_color("async"), label="async")
"""
import matplotlib

# Methods (what a run does with its workers' gradients).
METHODS = {
    "full sync": "#0072B2",   # blue: every worker, every step
    "backups": "#009E73",     # green: sync with b backup workers (first N of N + b)
    "async": "#D55E00",       # vermillion: parameter server, one gradient per update
    "auto": "#CC79A7",        # purple: the adaptive quorum
}
# Where a number comes from (the simulator's validation).
SOURCES = {
    "measured": "#000000",
    "simulated": "#E69F00",
    "closed form": "#999999",
    "network model": "#56B4E9",
}
# Straggler regimes (where worker times come from).
REGIMES = {
    "trace": "#000000",       # ../shared/traces/llm-seqlen-imbalance-32ranks.txt, resampled
    "slow-worker": "#56B4E9",  # ../shared/traces/llm-slow-worker-4ranks.txt, resampled
    "lognormal": "#E69F00",
    "shiftexp": "#999999",
}
# Runs of one method in one figure are told apart by line style, in this order.
STYLES = ["-", "--", ":", "-."]


def method_color(method):
    return METHODS[method]


def regime_color(regime):
    return REGIMES[regime]


def method_of(summary):
    """The method of a run from its summary.json (qring-train's or qring-sim's)."""
    if summary.get("mode") == "async":
        return "async"
    q = summary.get("quorum")
    if q == "auto":
        return "auto"
    world = summary.get("workers", summary.get("world"))
    try:
        return "full sync" if q is None or world is None or int(q) >= int(world) else "backups"
    except (TypeError, ValueError):
        return "full sync"


def apply():
    """Font sizes and grid for figures read at page width (about 7 inches per panel row)."""
    matplotlib.rcParams.update({
        "font.size": 11,
        "axes.titlesize": 12,
        "axes.labelsize": 11,
        "xtick.labelsize": 10,
        "ytick.labelsize": 10,
        "legend.fontsize": 10,
        "figure.titlesize": 13,
        "axes.grid": True,
        "grid.alpha": 0.3,
        "savefig.dpi": 100,
    })
