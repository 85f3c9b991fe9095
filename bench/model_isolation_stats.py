"""Statistics for the model isolation benchmark: tail ratios with bootstrap intervals.

A p99 over a phase of ~160 requests rests on its two slowest requests, so one
run's ratio of two p99s is noisy. Each ratio comes with a percentile bootstrap
interval: both samples are resampled with replacement, independently, and the
ratio of their p99s is taken each time; the interval is the middle 95 % of
those ratios. A ratio whose whole interval lies under the target meets it with
that confidence; one whose interval straddles it is undecided by this run.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from bench.load import percentile

RESAMPLES = 2000
CONFIDENCE = 0.95


@dataclass(frozen=True, slots=True)
class Ratio:
    """``numerator``'s p99 over ``denominator``'s, with its bootstrap interval."""

    value: float
    low: float
    high: float

    def verdict(self, target: float) -> str:
        """``meets`` (interval under target), ``misses`` (over it) or ``undecided``."""
        if self.high <= target:
            return "meets"
        if self.low > target:
            return "misses"
        return "undecided"


def p99(values: Sequence[float]) -> float:
    return percentile(sorted(values), 0.99)


def p99_ratio(
    numerator: Sequence[float],
    denominator: Sequence[float],
    *,
    resamples: int = RESAMPLES,
    seed: int = 15,
) -> Ratio:
    """The p99 ratio and its percentile bootstrap interval (both samples non-empty)."""
    if not numerator or not denominator:
        raise ValueError("a p99 ratio needs values on both sides")
    rng = random.Random(seed)
    ratios = sorted(
        p99(rng.choices(numerator, k=len(numerator)))
        / p99(rng.choices(denominator, k=len(denominator)))
        for _ in range(resamples)
    )
    tail = (1.0 - CONFIDENCE) / 2.0
    return Ratio(
        value=p99(numerator) / p99(denominator),
        low=ratios[int(tail * resamples)],
        high=ratios[min(resamples - 1, int((1.0 - tail) * resamples))],
    )
