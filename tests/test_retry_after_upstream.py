"""An upstream's ``Retry-After`` in either of RFC 9110's forms, as the retry policy reads it."""

from __future__ import annotations

from datetime import UTC, datetime
from email.utils import format_datetime

import pytest

from proxy.retries import RetryPolicy, parse_retry_after
from proxy.settings import RetryConfig

#: A fixed wall time: 2026-12-02 12:00:00 UTC.
NOON = datetime(2026, 12, 2, 12, 0, 0, tzinfo=UTC).timestamp()


def http_date(unix: float) -> str:
    return format_datetime(datetime.fromtimestamp(unix, UTC), usegmt=True)


@pytest.mark.parametrize(("value", "seconds"), [
    (http_date(NOON + 30), 30.0),
    (http_date(NOON + 3600), 3600.0),
    (http_date(NOON - 5), 0.0),  # already past: no wait
    ("Wed, 02 Dec 2026 12:00:07 GMT", 7.0),
    ("  3  ", 3.0),
])  # fmt: skip
def test_delay_seconds_and_http_dates_are_both_read(value: str, seconds: float) -> None:
    assert parse_retry_after(value, wall_now=NOON) == pytest.approx(seconds)


@pytest.mark.parametrize("value", ["soon", "", "-1", "inf", "Wed, 02 Dec 2026 12:00:07"])
def test_unreadable_values_are_no_retry_after(value: str) -> None:
    assert parse_retry_after(value, wall_now=NOON) is None


def test_an_http_date_past_the_deadline_is_passed_through_at_once() -> None:
    """A 503 whose Retry-After is a date an hour away, with 60 s left: not retried (the
    upstream answer goes to the client at once); one 2 s away: retried after 2 s."""
    policy = RetryPolicy(RetryConfig(retry_on=("http_503",), jitter="none", base_backoff_ms=100))
    far = parse_retry_after(http_date(NOON + 3600), wall_now=NOON)
    refused = policy.decide(
        "http_503", attempts=1, inference_route=True, remaining_s=60.0, upstream_retry_after_s=far
    )
    assert not refused.retry and refused.refused_by == "deadline"
    near = parse_retry_after(http_date(NOON + 2), wall_now=NOON)
    retried = policy.decide(
        "http_503", attempts=1, inference_route=True, remaining_s=60.0, upstream_retry_after_s=near
    )
    assert retried.retry and retried.delay_s == pytest.approx(2.0)
