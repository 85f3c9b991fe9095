"""Every shared-state loop ends at one ``cancel()``, whenever it lands (real redis-server).

redis-py sends each command through ``asyncio.wait_for``, which on Python 3.11
returns normally when the cancel lands just as the send finishes (CPython
gh-86296). The loops then went on after ``cancel()``: a worker stopped right
after it started hung in its shutdown. Each test starts the loop afresh and
cancels it once at each of its first ``STEPS`` event-loop steps, ``ROUNDS``
times over, with the loop set up to call Redis at once; the loop must have
ended, cancelled, within the generous ``ENDED_WITHIN_S``. Before the fix a
few of those moments in each loop left it running for good.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any

import pytest

from proxy.clock import MonotonicClock
from proxy.places import Held
from proxy.settings import StateConfig
from proxy.state import shared
from proxy.state.leases import Lease
from proxy.state.shared import SharedState
from proxy.tasks import stop
from tests.redis_server import RedisServer

pytestmark = pytest.mark.redis

#: Cancel at each of the loop's first STEPS steps, ROUNDS times: 120 cancels a loop.
STEPS = 40
ROUNDS = 3
#: A loop still running this long after its cancel() is taken as one that goes on.
ENDED_WITHIN_S = 5.0
#: Renewals and heartbeats only when a test asks (a third of this is 20 s).
LEASE_MS = 60_000

Loop = Callable[[], Coroutine[Any, Any, None]]


@pytest.fixture
async def state(redis_server: RedisServer) -> AsyncIterator[SharedState]:
    config = StateConfig(
        backend="redis", redis_url=redis_server.url, timeout_ms=2000, lease_ms=LEASE_MS
    )
    state = SharedState(config, MonotonicClock(), instance="cancel-test")
    yield state
    await state.client.aclose()


async def _cancel_at_each_step(loop: Loop, prepare: Callable[[], Awaitable[None]]) -> None:
    for attempt in range(STEPS * ROUNDS):
        await prepare()
        task = asyncio.create_task(loop())
        for _ in range(attempt % STEPS):
            await asyncio.sleep(0)
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=ENDED_WITHIN_S)
        if not done:
            await stop(task)  # cancels again until it ends: the test must not leak it
        assert done, f"still running after one cancel() at step {attempt % STEPS}"
        assert task.cancelled()


async def _nothing() -> None:
    return None


async def test_heartbeat_loop_ends_at_one_cancel(state: SharedState) -> None:
    """The instance registry beats at once when started: cancelled at any step, it ends."""
    await _cancel_at_each_step(state.registry.run, _nothing)


async def test_lease_renewal_loop_ends_at_one_cancel(state: SharedState) -> None:
    """A keeper holding a lease, asked to renew now: cancelled at any step, it ends."""
    keys = state.keys
    lease = await state.places.store.acquire(keys.seats("gpu-0"), 1, keys.freed_channel("x"))
    assert isinstance(lease, Lease)
    keeper = state.places.keeper
    keeper.add(lease)

    async def renew_now() -> None:
        keeper.renew_soon()

    await _cancel_at_each_step(keeper.run, renew_now)


async def test_release_loop_ends_at_one_cancel(state: SharedState) -> None:
    """A seat given back, its release pending: cancelled at any step, the loop ends."""
    places = state.places

    async def give_one_back() -> None:
        held = await places.take_seat("gpu-0", 10_000)
        assert isinstance(held, Held)
        places.give_back(held.seat)

    await _cancel_at_each_step(places.run, give_one_back)


async def test_request_count_loop_ends_at_one_cancel(
    state: SharedState, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Requests counted, flushed at the loop's first step: cancelled at any step, it ends."""
    monkeypatch.setattr(shared, "REQUEST_COUNT_FLUSH_S", 0.0)

    async def count_one() -> None:
        state.record_request()

    await _cancel_at_each_step(state._count_requests, count_one)


async def test_freed_listener_ends_at_one_cancel(state: SharedState) -> None:
    """The pub/sub listener connects and subscribes when started: cancelled at any step
    (connecting, subscribing, confirming, listening), it ends."""
    await _cancel_at_each_step(state.listener.run, _nothing)
