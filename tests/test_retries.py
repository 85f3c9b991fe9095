"""RetryPolicy and RetryBudget on a seeded RNG and a fake clock: no sockets, no sleeps."""

from __future__ import annotations

import random
import statistics

import pytest

from proxy.clock import FakeClock
from proxy.errors import (
    ConnectTimeout,
    FirstByteTimeout,
    IdleTimeout,
    ProxyError,
    ResetBeforeFirstByte,
    UpstreamConnectError,
    UpstreamProtocolError,
)
from proxy.retries import RetryBudget, RetryPolicy, parse_retry_after, status_class
from proxy.settings import RetryConfig

DEFAULT = RetryConfig()


@pytest.mark.parametrize(
    ("failure", "expected_class", "retried_by_default"),
    [
        (UpstreamConnectError("x"), "connect_error", True),
        (ConnectTimeout("x"), "connect_timeout", True),
        (FirstByteTimeout("x"), "first_byte_timeout", False),
        (ResetBeforeFirstByte("x"), "reset_before_first_byte", False),
        (UpstreamProtocolError("x"), None, False),
        (IdleTimeout("x"), None, False),
        (429, "http_429", True),
        (503, "http_503", True),
        (500, "http_500", False),
        (502, "http_502", False),
        (504, "http_504", False),
        (400, None, False),
        (404, None, False),
    ],
)
def test_error_in_retryable_or_not(
    failure: ProxyError | int, expected_class: str | None, retried_by_default: bool
) -> None:
    """Each failure maps to its retry class; the default retry_on decides."""
    cls = status_class(failure) if isinstance(failure, int) else failure.retry_class
    assert cls == expected_class
    decision = RetryPolicy(DEFAULT, random.Random(1)).decide(
        cls, attempts=1, inference_route=True, remaining_s=60.0
    )
    assert decision.retry is retried_by_default


def test_non_inference_routes_retry_only_connection_failures() -> None:
    """A repeat may have side effects off the inference routes: only connect failures."""
    policy = RetryPolicy(DEFAULT, random.Random(1))
    assert policy.decide("connect_error", attempts=1, inference_route=False, remaining_s=9).retry
    decision = policy.decide("http_503", attempts=1, inference_route=False, remaining_s=9)
    assert (decision.retry, decision.refused_by) == (False, "class")


def test_attempts_and_deadline_bound_retries() -> None:
    """No retry past max_attempts, nor when the backoff would outlast the deadline."""
    policy = RetryPolicy(RetryConfig(max_attempts=3, jitter="none"), random.Random(1))
    assert policy.decide("http_503", attempts=2, inference_route=True, remaining_s=9).retry
    assert policy.decide(
        "http_503", attempts=3, inference_route=True, remaining_s=9
    ).refused_by == ("attempts")
    assert policy.decide(
        "http_503", attempts=1, inference_route=True, remaining_s=0.1
    ).refused_by == ("deadline")


def test_upstream_retry_after_is_honoured_only_when_it_fits() -> None:
    """Retry-After: 2 delays the retry to 2 s; with 1.5 s left the answer passes through."""
    policy = RetryPolicy(DEFAULT, random.Random(1))
    fits = policy.decide("http_429", attempts=1, inference_route=True, remaining_s=10,
                         upstream_retry_after_s=2.0)  # fmt: skip
    assert fits.retry and fits.delay_s >= 2.0
    late = policy.decide("http_429", attempts=1, inference_route=True, remaining_s=1.5,
                         upstream_retry_after_s=2.0)  # fmt: skip
    assert (late.retry, late.refused_by) == (False, "deadline")
    assert parse_retry_after("2") == 2.0
    assert parse_retry_after("soon") is None
    assert parse_retry_after("-1") is None


@pytest.mark.parametrize("n", [0, 1, 2, 5])
def test_full_jitter_is_uniform_below_the_capped_exponential(n: int) -> None:
    """Full jitter: uniform in [0, min(max, base * 2^n)); mean half the ceiling."""
    config = RetryConfig(base_backoff_ms=100, max_backoff_ms=1000, jitter="full")
    policy = RetryPolicy(config, random.Random(42))
    ceiling = min(1.0, 0.1 * 2**n)
    samples = [policy.backoff(n) for _ in range(20_000)]
    assert min(samples) >= 0.0 and max(samples) < ceiling
    assert statistics.fmean(samples) == pytest.approx(ceiling / 2, rel=0.03)
    # uniform: each tenth of the range holds about a tenth of the samples
    counts = [0] * 10
    for s in samples:
        counts[min(9, int(s / ceiling * 10))] += 1
    assert all(abs(c - 2000) < 200 for c in counts), counts


def test_equal_jitter_and_none() -> None:
    """Equal jitter: half the ceiling plus a uniform half; none: the ceiling itself."""
    equal = RetryPolicy(RetryConfig(base_backoff_ms=200, jitter="equal"), random.Random(7))
    samples = [equal.backoff(1) for _ in range(20_000)]
    assert min(samples) >= 0.2 and max(samples) <= 0.4
    assert statistics.fmean(samples) == pytest.approx(0.3, rel=0.02)
    none = RetryPolicy(RetryConfig(base_backoff_ms=200, jitter="none"), random.Random(7))
    assert [none.backoff(i) for i in range(6)] == [0.2, 0.4, 0.8, 1.6, 2.0, 2.0]


def test_budget_allows_ratio_of_requests_plus_floor() -> None:
    """100 requests in the window, ratio 0.2, floor 0.5/s over 10 s: 25 retries, then no."""
    clock = FakeClock()
    budget = RetryBudget(ratio=0.2, min_per_s=0.5, clock=clock)
    for _ in range(100):
        budget.record_request()
    assert budget.allowance() == pytest.approx(25.0)
    granted = sum(budget.try_spend() for _ in range(40))
    assert granted == 25
    assert 0 < budget.refill_in() <= 11


def test_budget_history_expires_with_the_window() -> None:
    """After the window passes, old requests and retries no longer count."""
    clock = FakeClock()
    budget = RetryBudget(ratio=0.2, min_per_s=0.0, clock=clock)
    for _ in range(50):
        budget.record_request()
    assert sum(budget.try_spend() for _ in range(20)) == 10
    clock.advance(11)
    assert not budget.try_spend()  # no recent requests, no floor
    for _ in range(10):
        budget.record_request()
    assert budget.try_spend() and budget.try_spend() and not budget.try_spend()
