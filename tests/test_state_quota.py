"""Token quotas: the same rules, in memory and on a real redis-server, on a fake clock."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from proxy.clock import FakeClock
from proxy.settings import StateConfig
from proxy.state.client import StateClient
from proxy.state.keys import StateKeys
from proxy.state.quota import (
    Charge,
    LocalTokenQuotas,
    QuotaLimits,
    QuotaRefused,
    TokenQuotaStore,
)
from proxy.state.quota_redis import RedisTokenQuotas
from tests.redis_server import RedisServer

#: 2026-12-01 23:00:00 UTC: an hour before a day ends.
LATE = 1_796_166_000.0
MINUTE = QuotaLimits(per_minute=600)
DAY = QuotaLimits(per_day=1000)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(start=LATE)


@pytest.fixture(params=["local", pytest.param("redis", marks=pytest.mark.redis)])
async def store(request: pytest.FixtureRequest, clock: FakeClock) -> AsyncIterator[TokenQuotaStore]:
    if request.param == "local":
        yield LocalTokenQuotas(clock)
        return
    server: RedisServer = request.getfixturevalue("redis_server")
    config = StateConfig(backend="redis", redis_url=server.url, timeout_ms=2000)
    client = StateClient(config, clock=clock)
    yield RedisTokenQuotas(client, StateKeys("admission:"))
    await client.aclose()


async def test_minute_bucket_refuses_then_refills(store: TokenQuotaStore, clock: FakeClock) -> None:
    """600/min: 500 fits, 200 more waits the 10 s its 100 missing tokens take, then fits."""
    assert isinstance(await store.charge("acme", 500, MINUTE), Charge)
    refused = await store.charge("acme", 200, MINUTE)
    assert isinstance(refused, QuotaRefused) and refused.window == "minute"
    assert refused.retry_after_s == pytest.approx(10.0)
    assert (await store.remaining("acme", MINUTE)).minute == 100
    clock.advance(10)
    assert isinstance(await store.charge("acme", 200, MINUTE), Charge)


async def test_estimate_above_the_minute_quota_never_fits(store: TokenQuotaStore) -> None:
    refused = await store.charge("acme", 601, MINUTE)
    assert isinstance(refused, QuotaRefused) and refused.retry_after_s == 60


async def test_day_counter_refuses_until_utc_midnight(
    store: TokenQuotaStore, clock: FakeClock
) -> None:
    """1000/day: 900 used, 200 refused until midnight (an hour away), then fits."""
    assert isinstance(await store.charge("acme", 900, DAY), Charge)
    refused = await store.charge("acme", 200, DAY)
    assert isinstance(refused, QuotaRefused) and refused.window == "day"
    assert refused.retry_after_s == pytest.approx(3600)
    clock.advance(3600)
    assert isinstance(await store.charge("acme", 200, DAY), Charge)
    assert (await store.remaining("acme", DAY)).day == 800


async def test_correction_by_the_difference_never_below_zero(store: TokenQuotaStore) -> None:
    """Estimate 300, actual 100: 200 back; estimate 50, actual 0 on an empty day: stays 0."""
    charge = await store.charge("acme", 300, DAY)
    assert isinstance(charge, Charge)
    await store.correct(charge, 100)
    assert (await store.remaining("acme", DAY)).day == 900
    await store.correct(charge, 0)  # a second, bogus correction
    await store.correct(charge, 0)
    assert (await store.remaining("acme", DAY)).day == 1000


async def test_correction_after_midnight_leaves_the_new_day(
    store: TokenQuotaStore, clock: FakeClock
) -> None:
    limits = QuotaLimits(per_minute=600, per_day=1000)
    charge = await store.charge("acme", 100, limits)
    assert isinstance(charge, Charge)
    clock.advance(3600)
    await store.correct(charge, 400)
    remaining = await store.remaining("acme", limits)
    assert remaining.day == 1000 and remaining.day_resets_in_s == pytest.approx(86_400)
    assert remaining.minute == 300  # the minute bucket still pays the 300 more


async def test_tenants_are_separate(store: TokenQuotaStore) -> None:
    assert isinstance(await store.charge("acme", 600, MINUTE), Charge)
    assert isinstance(await store.charge("globex", 600, MINUTE), Charge)
    assert isinstance(await store.charge("acme", 1, MINUTE), QuotaRefused)


async def test_charge_and_correct_say_what_is_left(store: TokenQuotaStore) -> None:
    """What a charge, a refusal and a correction report left is what ``remaining`` reads."""
    limits = QuotaLimits(per_minute=600, per_day=1000)
    charge = await store.charge("acme", 400, limits)
    assert isinstance(charge, Charge) and charge.remaining is not None
    assert (charge.remaining.minute, charge.remaining.day) == (200, 600)
    refused = await store.charge("acme", 300, limits)
    assert isinstance(refused, QuotaRefused) and refused.remaining is not None
    assert (refused.remaining.minute, refused.remaining.day) == (200, 600)
    left = await store.correct(charge, 100)
    assert (left.minute, left.day) == (500, 900)
    assert await store.remaining("acme", limits) == left
