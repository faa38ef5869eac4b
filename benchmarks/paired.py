"""Paired rounds for benchmarks that compare runs whose times wander more than their difference.

A host-bound training step's time drifts by 5-15 % from one second to the next. ``interleave`` runs every
timed run once per round, in an order shuffled anew each round (a fixed order lets what ran before a run, a
cold cache or a queue left full, bias it the same way every round); ``ratio`` pairs the two runs' times round
by round, so a drift that hits both cancels, and gives the median of those ratios with a distribution-free
95 % interval (the binomial order statistics of the median; from 6 rounds on, and narrower than the range of the
ratios from 9): where the interval lies above 1, the first run is shown faster in that run; where it contains 1,
the difference is not resolved. ``coverage`` says what an interval of fewer rounds covers.
"""

from __future__ import annotations

import math
import random
from typing import Callable

#: Coverage of the interval ``ratio`` gives.
LEVEL = 0.95


def interleave(runs: dict[str, Callable[[], float]], rounds: int, seed: int = 0) -> dict[str, list[float]]:
    """Each run's results over ``rounds`` rounds; every round runs each once, in an order shuffled by a
    generator seeded with ``seed`` (the ranks of one job pass one seed and keep in step)."""
    if rounds < 1:
        raise ValueError(f"rounds: expected 1 or more, got {rounds}")
    rng = random.Random(seed)
    results: dict[str, list[float]] = {name: [] for name in runs}
    names = list(runs)
    for _ in range(rounds):
        rng.shuffle(names)
        for name in names:
            results[name].append(runs[name]())
    return results


def order_rank(n: int, level: float = LEVEL) -> int:
    """The 1-based rank k whose order statistics (k-th least and k-th greatest of n) bound the median with at
    least ``level`` coverage; 0 where no k does (n too small for that level)."""
    tail = (1.0 - level) / 2.0
    k, below = 0, 0
    while k < n:
        below += math.comb(n, k)  # / 2**n: P(fewer than k + 1 of n samples fall below the median)
        if below / (1 << n) > tail:  # exact integers: no overflow at any n
            break
        k += 1
    return k


def coverage(n: int, level: float = LEVEL) -> float:
    """How often the interval ``ratio`` gives for ``n`` rounds holds the median: ``level`` or more from 6 rounds
    on; below that the interval is the whole range of the ratios, which holds it 1 - 2 / 2**n of the time."""
    k = max(order_rank(n, level), 1)
    return 1.0 - 2 * sum(math.comb(n, i) for i in range(k)) / (1 << n)  # exact integers, then one division


def ratio(num: list[float], den: list[float], level: float = LEVEL) -> tuple[float, float, float]:
    """(median, low, high) of ``num[i] / den[i]`` over the rounds; (low, high) bound the median with
    ``level`` coverage, or are the least and greatest ratios where there are too few rounds for that."""
    if len(num) != len(den) or not num:
        raise ValueError(f"num, den: expected two equal, non-empty lists, got {len(num)} and {len(den)} values")
    ratios = sorted(a / b for a, b in zip(num, den))
    n = len(ratios)
    mid = n // 2
    median = ratios[mid] if n % 2 else (ratios[mid - 1] + ratios[mid]) / 2.0
    k = max(order_rank(n, level), 1)
    return median, ratios[k - 1], ratios[n - k]


def verdict(low: float, high: float) -> str:
    """'>1' where the interval lies above 1, '<1' where below, '~1' where it holds 1."""
    return ">1" if low > 1.0 else "<1" if high < 1.0 else "~1"
