"""scripts/fault_case42.py's accuracy verdict (issue 42: "accuracy within 0.5 points of a
fault-free run"): a case is compared with the mean of several fault-free runs, and the
difference of the means gets a 95 % interval; a verdict only where the interval supports it."""
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts"))
import fault_case42 as fc  # noqa: E402


def write_run(out, name, accuracy, finished=True):
    (out / name / "run").mkdir(parents=True)
    (out / f"{name}.log").write_text("")
    (out / name / "run" / "summary.json").write_text(
        json.dumps({"finished": finished, "test_accuracy": accuracy}))


def test_the_reference_is_the_mean_of_the_finished_clean_runs(tmp_path):
    for i, a in enumerate([0.84, 0.85, 0.86], start=1):
        write_run(tmp_path, f"clean-shm-e1-{i}", a)
    write_run(tmp_path, "clean-shm-e1-4", 0.10, finished=False)  # lost: not a reference
    write_run(tmp_path, "clean-shm-e1-6", 0.99)  # after a gap: not read
    assert fc.clean_accuracies(str(tmp_path), "shm", 1) == [0.84, 0.85, 0.86]
    assert fc.clean_accuracy(str(tmp_path), "shm", 1) == pytest.approx(0.85)
    assert fc.clean_accuracy(str(tmp_path), "tcp", 1) is None


def test_the_difference_of_the_means_has_a_welch_interval():
    d, half = fc.mean_difference([0.86, 0.88], [0.84, 0.86])
    assert d == pytest.approx(2.0)
    # each side: variance of the mean 0.0002 / 2 = 1e-4; se = sqrt(2e-4); df = 2 -> t 4.30
    assert half == pytest.approx(100 * 4.30 * 2e-4 ** 0.5, rel=1e-3)
    assert fc.mean_difference([0.85], [0.84, 0.86]) is None


def test_a_verdict_only_where_the_interval_supports_it():
    clean = [0.850, 0.852, 0.848, 0.851, 0.849]
    within = fc.accuracy_cell([0.1, -0.1], [0.851, 0.849, 0.850, 0.852, 0.848], clean)
    assert within.endswith("within 0.5")
    lower = fc.accuracy_cell([-2.0], [0.830, 0.829, 0.831, 0.830, 0.830], clean)
    assert lower.endswith("more than 0.5 lower")
    noisy = fc.accuracy_cell([-3.0, 3.0], [0.82, 0.88, 0.85, 0.83, 0.87], clean)
    assert noisy.endswith("not decided")
    assert fc.accuracy_cell([], [], clean) == "-"
