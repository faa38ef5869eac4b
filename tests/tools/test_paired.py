"""benchmarks/paired.py: the shuffled rounds and the paired ratios with their interval that
benchmarks/train_step.py and benchmarks/multi_gpu.py report."""

from __future__ import annotations

import importlib.util
import math

import pytest

from helpers import ROOT

_spec = importlib.util.spec_from_file_location("paired", ROOT / "benchmarks" / "paired.py")
paired = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(paired)


def coverage(n: int, k: int) -> float:
    """P(the k-th least and k-th greatest of n samples hold the median)."""
    return 1.0 - 2.0 * sum(math.comb(n, i) for i in range(k)) / 2.0**n


@pytest.mark.parametrize("n", range(1, 80))
def test_the_rank_is_the_widest_with_the_coverage(n: int) -> None:
    k = paired.order_rank(n)
    if k:
        assert coverage(n, k) >= paired.LEVEL
    assert k == n or coverage(n, k + 1) < paired.LEVEL


def test_known_ranks() -> None:
    # the textbook values: 9 rounds -> the 2nd least and greatest (96.1 %), 25 -> the 8th (95.7 %)
    assert [paired.order_rank(n) for n in (5, 6, 9, 25)] == [0, 1, 2, 8]


def test_the_coverage_said_is_the_intervals() -> None:
    # below 6 rounds the interval is the whole range: 1 - 2 / 2**n; from 6 on the binomial one, >= 95 %
    assert [paired.coverage(n) for n in (1, 3, 5)] == [0.0, 0.75, 0.9375]
    assert paired.coverage(6) == pytest.approx(1 - 2 / 64) and paired.coverage(9) == pytest.approx(1 - 20 / 512)
    assert all(paired.coverage(n) >= paired.LEVEL for n in range(6, 80))
    # many rounds: exact integers, no float overflow of 2**n
    assert paired.order_rank(3000) > 1400 and paired.coverage(3000) >= paired.LEVEL


def test_the_ratio_pairs_rounds() -> None:
    # each round's ratio is 1.1 while the runs' times drift 4x: the ratio of the medians would not say so
    den = [1.0, 4.0, 2.0, 3.0, 1.5, 2.5, 3.5, 1.2, 2.2]
    num = [1.1 * d for d in den]
    median, low, high = paired.ratio(num, den)
    assert median == pytest.approx(1.1) and low == pytest.approx(1.1) and high == pytest.approx(1.1)
    assert paired.verdict(low, high) == ">1"
    # and round by round, not each run's median over the other's: those are equal here (2 / 2), the ratios not
    assert paired.ratio([1.0, 2.0, 3.0], [3.0, 1.0, 2.0])[0] == 1.5


def test_the_interval_is_order_statistics() -> None:
    num = [0.8, 1.3, 0.9, 1.0, 1.2, 1.1, 0.95, 1.05, 1.15]
    median, low, high = paired.ratio(num, [1.0] * 9)
    assert (median, low, high) == (1.05, 0.9, 1.2)  # 9 rounds: the 2nd least and the 2nd greatest
    assert paired.verdict(low, high) == "~1"
    assert paired.verdict(0.8, 0.99) == "<1"
    assert paired.verdict(1.0, 1.2) == "~1" and paired.verdict(0.9, 1.0) == "~1"  # an end at 1 holds 1
    # too few rounds for 95 %: the whole range, and an even count's median is the mean of the middle two
    assert paired.ratio([1.0, 2.0, 3.0, 4.0], [1.0] * 4) == (2.5, 1.0, 4.0)


@pytest.mark.parametrize("num, den", [([], []), ([1.0], [1.0, 2.0])])
def test_bad_lists_are_named(num: list, den: list) -> None:
    with pytest.raises(ValueError, match="num, den: expected two equal, non-empty lists"):
        paired.ratio(num, den)


def test_every_round_runs_each_once_in_a_shuffled_order() -> None:
    log: list[str] = []
    runs = {name: (lambda name=name: log.append(name) or float(len(log))) for name in "abcde"}
    results = paired.interleave(runs, 40, seed=3)
    orders = [tuple(log[i:i + 5]) for i in range(0, len(log), 5)]
    assert all(sorted(order) == list("abcde") for order in orders) and len(orders) == 40
    assert len(set(orders)) > 10  # shuffled anew each round, not one order repeated
    assert all(len(v) == 40 for v in results.values())
    # the value a run returned is kept under its name, round by round
    for name, values in results.items():
        assert [log[int(v) - 1] for v in values] == [name] * 40
    log.clear()
    paired.interleave(runs, 40, seed=3)
    assert [tuple(log[i:i + 5]) for i in range(0, len(log), 5)] == orders  # one seed, one order: ranks keep in step


def test_bad_rounds_are_named() -> None:
    with pytest.raises(ValueError, match="rounds: expected 1 or more, got 0"):
        paired.interleave({"a": lambda: 1.0}, 0)


@pytest.mark.parametrize("script, arg", [("train_step.py", "--rounds"), ("multi_gpu.py", "--steps")])
def test_the_benchmarks_name_a_bad_count(script: str, arg: str) -> None:
    import subprocess
    import sys

    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), arg, "0"], capture_output=True,
                            text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"{arg}: expected 1 or more, got 0" in result.stderr and "Traceback" not in result.stderr
