"""Entrance rate limits on a fake clock, and tenant caps under random churn."""

from __future__ import annotations

import random

import pytest

from proxy.clock import FakeClock
from proxy.dispatch import TenantLimits
from proxy.quotas import EntranceQuotas, RateTake, TokenBucket
from proxy.replicas import Seat
from proxy.scheduler import Ticket
from tests.test_dispatch import enqueue, make_dispatcher


def test_bucket_allows_a_burst_then_the_rate() -> None:
    """burst tokens at once, then one per 1/rate seconds; refusals take no token."""
    clock = FakeClock()
    bucket = TokenBucket(rate_per_s=4.0, burst=2.0, clock=clock)
    assert bucket.try_take() == 0.0
    assert bucket.try_take() == 0.0
    wait = bucket.try_take()
    assert wait == pytest.approx(0.25)
    assert bucket.try_take() == pytest.approx(0.25)  # the refusal took nothing
    clock.advance(0.25)
    assert bucket.try_take() == 0.0
    clock.advance(0.1)
    assert bucket.try_take() == pytest.approx(0.15)


def test_a_take_says_what_is_left_for_the_headers() -> None:
    """take() is try_take() with the bucket after it: tokens left, burst and rate (the
    x-ratelimit-*-requests headers); a tenant without a rate has no bucket to take from."""
    clock = FakeClock()
    quotas = EntranceQuotas(clock)
    quotas.configure({"a": (4.0, 2.0), "b": None})
    first, second, third = quotas.take("a"), quotas.take("a"), quotas.take("a")
    assert first == RateTake(0.0, 1.0, 2.0, 4.0)
    assert second == RateTake(0.0, 0.0, 2.0, 4.0)
    assert third is not None and third.wait_s == pytest.approx(0.25) and third.level == 0.0
    clock.advance(0.125)
    half = quotas.take("a")
    assert half is not None and half.wait_s == pytest.approx(0.125)
    assert half.level == pytest.approx(0.5)  # a refusal leaves the refill where it was
    assert quotas.take("b") is None


def test_bucket_never_holds_more_than_its_burst() -> None:
    """A long idle period refills to the burst, not beyond."""
    clock = FakeClock()
    bucket = TokenBucket(rate_per_s=10.0, burst=3.0, clock=clock)
    clock.advance(3600)
    assert [bucket.try_take() == 0.0 for _ in range(4)] == [True, True, True, False]


def test_reconfigure_keeps_earned_tokens_and_applies_the_new_rate() -> None:
    """A reload changes rate and burst at once without resetting the bucket."""
    clock = FakeClock()
    quotas = EntranceQuotas(clock)
    quotas.configure({"a": (1.0, 1.0), "b": None})
    assert quotas.try_take("a") == 0.0
    assert quotas.try_take("a") == pytest.approx(1.0)
    quotas.configure({"a": (10.0, 5.0), "b": None})
    assert quotas.try_take("a") == pytest.approx(0.1)
    assert all(quotas.try_take("b") == 0.0 for _ in range(100))  # unlimited
    with pytest.raises(ValueError, match="rate_per_s"):
        TokenBucket(rate_per_s=0, burst=1, clock=clock)


async def test_tenant_cap_holds_at_every_instant_under_churn() -> None:
    """Random arrivals and completions: a capped tenant never exceeds its cap, an
    uncapped one fills the seats the capped one leaves."""
    clock = FakeClock()
    limits = {
        "capped": TenantLimits(max_concurrency=2, queue_capacity=50),
        "free": TenantLimits(max_concurrency=None, queue_capacity=50),
    }
    d = make_dispatcher(clock, seats=5, limits=limits)
    rng = random.Random(3)
    running: list[tuple[Ticket, Seat]] = []
    queued: list[Ticket] = []
    peak = {"capped": 0, "free": 0}
    for _ in range(2000):
        tenant = rng.choice(["capped", "free"])
        if rng.random() < 0.55 and d.scheduler.depth(tenant) < 50:
            queued.append(enqueue(d, clock, tenant))
        elif running:
            ticket, seat = running.pop(rng.randrange(len(running)))
            d.finish(ticket, seat)
        for t in list(queued):
            if t.seat is not None:
                queued.remove(t)
                running.append((t, t.seat))
        assert d.inflight("capped") <= 2
        assert d.pool.total_inflight() <= 5
        for tenant in peak:
            peak[tenant] = max(peak[tenant], d.inflight(tenant))
    assert peak == {"capped": 2, "free": 5}
    for t, seat in running:
        d.finish(t, seat)
    d.close()


async def test_a_lone_tenant_uses_every_seat_up_to_its_cap() -> None:
    """Work-conserving: alone, a tenant takes min(cap, seats) seats."""
    clock = FakeClock()
    for cap, expected in ((None, 4), (3, 3)):
        limits = {"a": TenantLimits(max_concurrency=cap, queue_capacity=10)}
        d = make_dispatcher(clock, seats=4, limits=limits)
        tickets = [enqueue(d, clock, "a") for _ in range(6)]
        assert d.inflight("a") == expected == d.pool.total_inflight()
        granted = [t for t in tickets if t.seat is not None]
        for t in granted:
            d.finish(t, await d.wait(t))
        d.close()
