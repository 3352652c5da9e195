"""scripts/reproduce.py's reading of qring-train's duty-cycle runs (part "validate"): the cost
of a step beyond its decision and the ranks' arrival offsets on rank 0's clock, also where
rank 0 (the coordinator) is excluded on every step. Run with /usr/bin/python3 -m pytest
(reproduce.py imports matplotlib through scripts/plot.py)."""
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts"))
import reproduce  # noqa: E402

C = 50.0     # every rank's idle time a step (ms)
LATE = 12.0  # how much later than the others an excluded rank 0 starts the next step
POST = 30.0  # from the decision to rank 0's result


def step_line(t, ready, wait_ms, quorum=3, dropped=(), compute_ms=0.0):
    got = sorted(x for x in ready if x >= 0)
    return {"type": "step", "step": t, "quorum": quorum, "ready_ms": ready,
            "decide_ms": got[quorum - 1], "dropped": list(dropped), "delay_ms": C,
            "compute_ms": compute_ms, "wait_ms": wait_ms, "skipped": False}


def excluded_step(t, others):
    """Rank 0 starts LATE after the others (READY clock: they arrive at `others`), is
    excluded at the third READY and has its result POST later: its idle and its period."""
    decide = sorted(others)[2]
    idle = decide - (LATE - C)  # it started at LATE - C, its would-be READY at LATE
    line = step_line(t, [-1.0] + others, POST, dropped=[0])
    return line, idle + POST


def write_run(tmp_path, lines, world=4):
    d = tmp_path / "run"
    d.mkdir()
    wall = 0.0
    with open(d / "metrics.jsonl", "w") as f:
        for line, period_ms in lines:
            wall += period_ms / 1000
            line["wall_s"] = wall
            f.write(json.dumps(line) + "\n")
    (d / "summary.json").write_text(json.dumps({"world": world}))
    return str(d)


OTHERS = [[0.0, 1.5, 2.0], [0.5, 0.0, 3.0], [2.5, 1.0, 0.0]]


def test_rank0_excluded_on_every_step_is_clocked_by_its_decision(tmp_path):
    run = write_run(tmp_path, [excluded_step(t, OTHERS[t % 3]) for t in range(12)])
    ms, quorum = reproduce.post_arrival_ms(run)
    assert quorum == 3
    assert ms == pytest.approx(POST, abs=1e-6)
    offsets = reproduce.arrival_offsets(run)
    assert len(offsets) == 12 - reproduce.SKIP_STEPS
    for t, row in zip(range(reproduce.SKIP_STEPS, 12), offsets):
        assert row[0] == 0.0
        assert row[1:] == pytest.approx([x - LATE for x in OTHERS[t % 3]], abs=1e-3)


def test_rank0_contributing_keeps_its_own_ready_as_the_clock(tmp_path):
    # Rank 0 the second of the quorum: its wait runs from its READY (1.0) to its result.
    lines = [(step_line(t, [1.0, 0.0, 4.0, 9.0], wait_ms=3.0 + POST, dropped=[3]), C + POST)
             for t in range(8)]
    run = write_run(tmp_path, lines)
    assert reproduce.post_arrival_ms(run)[0] == pytest.approx(POST)
    assert reproduce.arrival_offsets(run)[0] == [0.0, -1.0, 3.0, 8.0]


def test_mixed_steps_are_all_counted(tmp_path):
    lines = [excluded_step(t, OTHERS[t % 3]) if t % 2 else
             (step_line(t, [0.0, 1.0, 2.0, 7.0], wait_ms=2.0 + POST, dropped=[3]), C + POST)
             for t in range(11)]
    run = write_run(tmp_path, lines)
    steps = reproduce.clocked_steps(run)
    assert len(steps) == 11 - reproduce.SKIP_STEPS
    assert sum(s.ready[0] < 0 for s in steps) == 3
    assert reproduce.post_arrival_ms(run)[0] == pytest.approx(POST)


def test_rank0_starting_after_the_decision_has_no_clock(tmp_path):
    # Its period no longer than its wait: it idled not at all, the decision came before it began.
    lines = [(step_line(t, [-1.0, 0.0, 1.0, 2.0], POST, dropped=[0]), POST) for t in range(8)]
    run = write_run(tmp_path, lines)
    assert reproduce.clocked_steps(run) == []
    with pytest.raises(SystemExit, match="post-arrival"):
        reproduce.post_arrival_ms(run)


def test_post_arrival_writes_the_calibration(tmp_path):
    run = write_run(tmp_path, [excluded_step(t, OTHERS[t % 3]) for t in range(9)])
    base, out = tmp_path / "base.json", tmp_path / "cal.json"
    base.write_text(json.dumps({"alpha_us": 1.0}))
    reproduce.post_arrival(str(out), str(base), [run])
    cal = json.loads(out.read_text())
    assert cal["alpha_us"] == 1.0
    assert cal["step_cost_ms"]["backup"]["3"] == pytest.approx(POST)
    assert cal["step_cost_ms"]["full"] == {}
    assert len(cal["arrival_offsets_ms"]["3"]) == 9 - reproduce.SKIP_STEPS


def auto_claims(ratio, reached=3, seeds=(1, 2, 3)):
    """The "auto" rows of a b sweep whose auto took `ratio` (mean, lo, hi) of the best b's time."""
    sw = {"regime": "trace", "workers": 100, "seeds": list(seeds), "best_b": 8,
          "best_b_interval": [8, 16], "b_values": [0, 8, 16, 32],
          "auto_vs_best": {"ratio": ratio, "pairs": reached, "reached": reached,
                           "accuracy_diff": (0.0, -0.1, 0.1)}}
    rows = []
    reproduce.claims_p4_auto({"bsweep": [sw], "bsweep1000": []}, lambda *a: rows.append(a))
    return [r for r in rows if r[0] == "auto"]


@pytest.mark.parametrize("ratio, verdict", [
    ((1.02, 0.99, 1.04), "met"),          # the whole interval within 5 %
    ((1.03, 1.00, 1.07), "undecided"),    # the mean within, the interval past 5 %
    ((1.08, 1.06, 1.10), "not met"),      # the whole interval past 5 %
    ((1.04, None, None), "met"),          # one seed: its ratio alone
])
def test_auto_verdict_follows_its_interval(ratio, verdict):
    (row,) = auto_claims(ratio)
    assert row[-1] == verdict


def test_auto_that_missed_the_target_on_a_seed_is_not_met():
    (row,) = auto_claims((1.0, 0.98, 1.02), reached=2)
    assert row[-1] == "not met"


def test_publish_of_one_part_recomputes_the_claims_of_the_page(tmp_path, monkeypatch):
    """publish DIR bsweep: the page's results with DIR's bsweep, the claims made again from
    them (the others' parts unchanged), the bsweep and auto tables and blocks from DIR."""
    docs = tmp_path / "docs"
    (docs / "reproduction" / "tables").mkdir(parents=True)
    page = ("x\n<!-- BEGIN claims -->\nold claims\n<!-- END claims -->\n"
            "<!-- BEGIN bsweep -->\nold sweep\n<!-- END bsweep -->\n"
            "<!-- BEGIN auto -->\nold auto\n<!-- END auto -->\n"
            "<!-- BEGIN async -->\nold async\n<!-- END async -->\n")
    (docs / "reproduction.md").write_text(page)
    # JSON keys are strings: the seeds and b values that analyze keyed by integers.
    page_res = {"kth": [], "bsweep": [{"old": True, "per": {"1": 2}}], "async": ["page's"]}
    (docs / "reproduction" / "tables" / "results.json").write_text(json.dumps(page_res))
    run = tmp_path / "run"
    (run / "tables").mkdir(parents=True)
    (run / "tables" / "results.json").write_text(
        json.dumps({"kth": [], "bsweep": [{"new": True, "per": {"7": 1}}], "async": ["run's"]}))
    (run / "tables" / "bsweep.md").write_text("new sweep\n")
    (run / "tables" / "auto.md").write_text("new auto\n")
    (run / "tables" / "async.md").write_text("run's async\n")
    seen = []

    def claims_of(res):
        seen.append(res)
        return [{"id": "P2", "claim": "c", "paper": "p", "setup": "s", "number": "n",
                 "verdict": "reproduced"}]
    monkeypatch.setattr(reproduce, "claims_of", claims_of)
    reproduce.publish(str(run), ["bsweep"], docs=str(docs))
    assert seen == [{"kth": [], "bsweep": [{"new": True, "per": {7: 1}}], "async": ["page's"]}]
    text = (docs / "reproduction.md").read_text()
    assert "new sweep" in text and "new auto" in text and "old async" in text
    assert "old claims" not in text and "| P2: c | p | s | n | reproduced |" in text
    tables = docs / "reproduction" / "tables"
    assert json.loads((tables / "claims.json").read_text())[0]["verdict"] == "reproduced"
    assert json.loads((tables / "results.json").read_text())["async"] == ["page's"]
    assert not (tables / "async.md").exists()
