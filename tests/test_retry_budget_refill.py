"""The retry budget's refill time (the ``Retry-After`` of ``retry_budget_exhausted``).

It is the moment the oldest counted retry leaves the 10 s window: a retry asked
for then is allowed, one asked for a little before is not. Said later, clients
told to come back wait longer than the budget needs, fleet-wide with Redis too.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from proxy.clock import FakeClock
from proxy.retries import RetryBudget
from proxy.settings import StateConfig
from proxy.state.client import StateClient
from proxy.state.keys import StateKeys
from proxy.state.retry_budget import SharedRetryBudget
from tests.redis_server import RedisServer

#: ratio 0 and a floor of 0.1/s: exactly one retry per 10 s window. Times are
#: quarters of a second, exact in binary, so "at" and "just before" are exact too.
RATIO, FLOOR = 0.0, 0.1


@pytest.mark.parametrize("into_second", [0.0, 0.25, 0.75])
def test_the_local_budget_refills_when_it_says(into_second: float) -> None:
    clock = FakeClock(start=1_000.0 + into_second)
    budget = RetryBudget(RATIO, FLOOR, clock)
    assert budget.try_spend()
    clock.advance(0.5)
    assert not budget.try_spend()
    wait = budget.refill_in()
    clock.advance(wait - 0.25)
    assert not budget.try_spend(), "refilled before the time it gave"
    clock.advance(0.25)
    assert budget.try_spend(), f"not refilled {wait} s later, as it said"


@pytest.fixture
async def timed(redis_server: RedisServer) -> AsyncIterator[tuple[StateClient, FakeClock]]:
    clock = FakeClock(start=2_000_000.25)
    config = StateConfig(backend="redis", redis_url=redis_server.url, timeout_ms=2000)
    client = StateClient(config, clock=clock)
    yield client, clock
    await client.aclose()


@pytest.mark.redis
async def test_the_fleets_budget_refills_when_it_says(
    timed: tuple[StateClient, FakeClock],
) -> None:
    client, clock = timed
    shared = SharedRetryBudget(client, StateKeys("admission:"))
    assert await shared.try_spend(RATIO, FLOOR) == 0.0
    clock.advance(0.5)
    wait = await shared.try_spend(RATIO, FLOOR)
    assert wait > 0
    clock.advance(wait - 0.25)
    assert await shared.try_spend(RATIO, FLOOR) > 0, "refilled before the time it gave"
    clock.advance(0.25)
    assert await shared.try_spend(RATIO, FLOOR) == 0.0, f"not refilled {wait} s later"
