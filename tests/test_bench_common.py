"""``bench.common.summarize_rounds``: the medians and per-round ratios both overhead
benchmarks report, on hand-made runs whose answers are worked out here."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from bench.common import summarize_rounds


@dataclass(slots=True)
class _Run:
    target: str
    round: int
    rps: float
    cpu: float


def _ratio(rr: dict[str, _Run]) -> dict[str, float]:
    return {
        "rps_ratio": rr["proxy"].rps / rr["base"].rps,
        "added_cpu": rr["proxy"].cpu - rr["base"].cpu,
    }


RUNS = [
    # Rounds out of order, targets in a different order each round.
    _Run("proxy", 1, rps=90.0, cpu=3.0),
    _Run("base", 1, rps=100.0, cpu=1.0),
    _Run("base", 0, rps=200.0, cpu=2.0),
    _Run("proxy", 0, rps=100.0, cpu=2.5),
    _Run("base", 2, rps=50.0, cpu=4.0),
    _Run("proxy", 2, rps=40.0, cpu=8.0),
]


def test_medians_per_target_over_rounds() -> None:
    summary = summarize_rounds(RUNS, ("base", "proxy"), ("rps", "cpu"), _ratio)
    assert summary["targets"] == {
        "base": {"rps": 100.0, "cpu": 2.0},
        "proxy": {"rps": 90.0, "cpu": 3.0},
    }


def test_ratios_are_taken_within_each_round_then_their_median() -> None:
    """Per round (in the order rounds first appear): 0.9 and 2.0, then 0.5 and 0.5, then
    0.8 and 4.0; the medians are 0.8 and 2.0, not the ratio of the medians (0.9)."""
    summary = summarize_rounds(RUNS, ("base", "proxy"), ("rps", "cpu"), _ratio)
    assert summary["ratios_by_round"] == [
        {"rps_ratio": 0.9, "added_cpu": 2.0},
        {"rps_ratio": 0.5, "added_cpu": 0.5},
        {"rps_ratio": 0.8, "added_cpu": 4.0},
    ]
    assert summary["ratios"] == {"rps_ratio": 0.8, "added_cpu": 2.0}
    assert list(summary) == ["targets", "ratios", "ratios_by_round"]


def test_a_round_missing_a_target_the_ratio_reads_is_an_error() -> None:
    with pytest.raises(KeyError):
        summarize_rounds([*RUNS, _Run("base", 3, 1.0, 1.0)], ("base", "proxy"), ("rps",), _ratio)
