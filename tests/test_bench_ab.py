"""scripts/bench_ab.py's confidence interval of a median ratio (median_ci): the order
statistics of the binomial rule, no interval where the rounds are too few for one, and a
coverage of at least the level on independent draws."""
import os
import random
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts"))
import bench_ab  # noqa: E402


def test_the_binomial_order_statistics():
    # n = 6: the extremes (2 / 64 = 3.1 % outside); n = 16: 4th and 13th (2 P(B <= 3) = 2.1 %);
    # n = 100: 40th and 61st (3.5 %), as tables of the sign test give them.
    assert bench_ab.median_ci(list(range(6))) == (0, 5)
    assert bench_ab.median_ci(list(range(16))) == (3, 12)
    assert bench_ab.median_ci(list(range(100))) == (39, 60)


def test_too_few_rounds_give_no_interval():
    assert bench_ab.median_ci([1.0, 2.0, 3.0, 4.0, 5.0]) is None
    assert "95%" not in bench_ab.ratio_cell([1.0, 1.1, 0.9])
    assert bench_ab.ratio_cell([0.9, 1.0, 1.0, 1.1, 1.2, 1.3]) == "1.05 [0.90-1.30 95%] (0.90-1.30)"


def test_unsorted_input_and_coverage():
    rng = random.Random(7)
    xs = [rng.lognormvariate(0.05, 0.2) for _ in range(40)]
    lo, hi = bench_ab.median_ci(xs)
    assert (lo, hi) == bench_ab.median_ci(sorted(xs)) and lo < hi
    hits = 0
    for _ in range(2000):
        draws = [rng.gauss(1.0, 0.3) for _ in range(30)]
        lo, hi = bench_ab.median_ci(draws)
        hits += lo <= 1.0 <= hi
    assert hits / 2000 >= 0.94
