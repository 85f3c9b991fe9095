"""The estimators admission predicts from, with plain numbers and no clock."""

from __future__ import annotations

import pytest

from proxy.estimators import (
    BACKLOG_WINDOW_S,
    DEFAULT_OUTPUT_TOKENS,
    MAX_OUTPUT_TOKENS_ESTIMATE,
    MIN_BACKLOGGED_DISPATCHES,
    RECENT_TAU_S,
    BackloggedTurnover,
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


def test_backlogged_turnover_is_measured_only_while_the_queue_never_empties() -> None:
    """Ten per second from a queue that stays full reads as ten per second; a minute
    of sparse requests that each emptied the queue, or a backlog begun afresh,
    measure nothing: a quiet period's rate is never taken as the drain."""
    turnover = BackloggedTurnover()
    now = 0.0
    for _ in range(60):  # a minute of sparse traffic: each dispatch leaves the queue empty
        now += 1.0
        turnover.began("a")
        turnover.dispatched("a", now, still_backlogged=False)
    assert turnover.rate("a", now) is None
    turnover.began("a")
    for i in range(MIN_BACKLOGGED_DISPATCHES - 1):
        turnover.dispatched("a", now + 0.1 * i, still_backlogged=True)
    assert turnover.rate("a", now + 0.7) is None  # too few dispatches yet
    for i in range(MIN_BACKLOGGED_DISPATCHES - 1, 40):
        turnover.dispatched("a", now + 0.1 * i, still_backlogged=True)
    now += 4.0
    assert turnover.rate("a", now) == pytest.approx(10.0, rel=0.06)  # the last 2 s only
    # A second's stall since the last dispatch: 10 dispatches in the 2 s window.
    assert turnover.rate("a", now + 1.0) == pytest.approx(10 / BACKLOG_WINDOW_S, rel=0.1)
    turnover.began("a")  # the queue emptied (expiry) and a new backlog starts
    assert turnover.rate("a", now) is None
    turnover.dispatched("b", now, still_backlogged=True)
    turnover.forget_idle(now + BACKLOG_WINDOW_S + 1)
    assert len(turnover) == 0
