"""The model isolation benchmark's statistics: the p99 ratio, its bootstrap interval and
its verdict against a target, and the proxy's view of B's requests from the access log."""

from __future__ import annotations

import pytest

from bench.model_isolation import proxy_timings
from bench.model_isolation_stats import Ratio, p99_ratio


def test_ratio_of_equal_samples_is_one_and_its_interval_holds_it() -> None:
    """The same 200 values on both sides: the ratio is 1 and the interval holds 1."""
    values = [float(v) for v in range(1, 201)]
    ratio = p99_ratio(values, values)
    assert ratio.value == 1.0
    assert ratio.low <= 1.0 <= ratio.high


def test_ratio_is_of_nearest_rank_p99s() -> None:
    """100 values 1..100 over 100 values 2..200 by twos: p99s 99 and 198, ratio 0.5."""
    ratio = p99_ratio([float(v) for v in range(1, 101)], [2.0 * v for v in range(1, 101)])
    assert ratio.value == 0.5


def test_one_slow_request_widens_the_interval() -> None:
    """One outlier in 160 sits at the p99's edge: resampling moves the p99 across it, so
    the interval spans from no slowdown to the outlier's."""
    alone = [10.0] * 320
    flooded = [10.0] * 159 + [50.0]
    ratio = p99_ratio(flooded, alone)
    assert ratio.low == 1.0
    assert ratio.high == 5.0


def test_resampling_is_seeded() -> None:
    numerator = [float(v % 37) + 1.0 for v in range(150)]
    denominator = [float(v % 23) + 1.0 for v in range(300)]
    assert p99_ratio(numerator, denominator) == p99_ratio(numerator, denominator)


@pytest.mark.parametrize(
    ("low", "high", "verdict"),
    [(0.9, 1.1, "meets"), (0.9, 1.2, "meets"), (1.0, 1.5, "undecided"), (1.3, 2.0, "misses")],
)
def test_verdict_against_the_target(low: float, high: float, verdict: str) -> None:
    assert Ratio(value=(low + high) / 2, low=low, high=high).verdict(1.2) == verdict


def test_ratio_needs_values_on_both_sides() -> None:
    with pytest.raises(ValueError, match="both sides"):
        p99_ratio([], [1.0])


def test_proxy_timings_split_the_clients_ttft() -> None:
    """One access-log line: the proxy's TTFT 12 ms of which the engine's 9; the client
    saw 15 ms: 3 ms are the proxy's (1 of them waiting for a seat), 3 ms outside it. A line
    with no TTFT (a failed request) is left out."""
    lines = [
        {"request_id": "flooded-0", "queue_ms": 1.0, "ttft_ms": 12.0, "upstream_ms": 9.0},
        {"request_id": "flooded-1", "queue_ms": 0.05, "ttft_ms": None, "upstream_ms": None},
    ]
    summary = proxy_timings(lines, {"flooded-0": 0.015})
    assert summary["lines"] == 1
    assert summary["not_upstream_ms"]["p99"] == 3.0
    assert summary["own_ms"]["p99"] == 2.0
    assert summary["outside_ms"]["p99"] == pytest.approx(3.0)
    assert summary["queued"] == 0
