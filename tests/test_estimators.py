"""The estimators admission predicts from, with plain numbers and no clock."""

from __future__ import annotations

import pytest

from proxy.estimators import (
    DEFAULT_OUTPUT_TOKENS,
    MAX_OUTPUT_TOKENS_ESTIMATE,
    RECENT_TAU_S,
    OutputTokens,
    RecentDispatches,
    SeatTime,
)


def test_seat_time_clips_a_few_stragglers_but_keeps_a_wide_spread() -> None:
    """Three 2 s requests among sixty of 50 ms count as 200 ms each; a spread of
    40 to 120 ms keeps its plain mean."""
    seat = SeatTime()
    for i in range(63):
        seat.record(2.0 if i in (5, 30, 60) else 0.05)
    assert seat.mean_s == pytest.approx((60 * 0.05 + 3 * 0.2) / 63)
    spread = SeatTime()
    times = [0.04 + 0.01 * (i % 9) for i in range(64)]
    for held in times:
        spread.record(held)
    assert spread.mean_s == pytest.approx(sum(times) / 64)
    assert spread.count == 64


def test_recent_dispatches_reach_the_steady_rate_and_forget_a_pause() -> None:
    """Ten per second for a minute reads as ten per second; a minute later, nothing."""
    recent = RecentDispatches()
    now = 0.0
    for _ in range(600):
        now += 0.1
        recent.record("a", now)
    assert recent.others_per_second("b", now) == pytest.approx(10.0, rel=0.05)
    assert recent.others_per_second("a", now) == pytest.approx(0.0, abs=1e-9)
    assert recent.active(now) == ["a"]
    later = now + 30 * RECENT_TAU_S
    assert recent.others_per_second("b", later) < 1e-6
    assert recent.active(later) == []
    recent.forget_idle(later)
    assert len(recent) == 0


@pytest.mark.parametrize(
    ("answers", "expected"),
    [
        ([], DEFAULT_OUTPUT_TOKENS),
        ([40, 40, 40], 40.0),
        ([100, 0], 90.0),  # exponentially weighted: 100 + 0.1 * (0 - 100)
        ([50_000], MAX_OUTPUT_TOKENS_ESTIMATE),
    ],
)
def test_output_tokens_are_the_tenants_recent_mean(answers: list[int], expected: float) -> None:
    """256 before any answer, then the moving mean of real counts, capped at 4096."""
    tokens = OutputTokens()
    for count in answers:
        tokens.record("a", count)
    assert tokens.expected("a") == pytest.approx(expected)
    assert tokens.expected("b") == DEFAULT_OUTPUT_TOKENS
