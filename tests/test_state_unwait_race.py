"""A waiting entry's removal racing a new seat call for the same tenant and replica.

``stop_waiting`` queues the removal of this process's entry; the release loop sends it
later. A seat call of the same tenant at the same replica may be in flight meanwhile:
its answer settles the entry itself (a grant removes it, a refusal writes it afresh),
so a removal sent during the call must not reach Redis after the refusal's write. On a
real redis-server; entries and leases last a minute, so nothing expires by itself.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis

from proxy.places import Blocked
from proxy.settings import StateConfig
from proxy.state import places as places_module
from proxy.state.client import StateClient
from proxy.state.keys import StateKeys
from proxy.state.leases import Lease, LeaseKeeper, LeaseStore, Share
from proxy.state.places import RedisPlaces
from tests.redis_server import RedisServer

pytestmark = pytest.mark.redis

KEYS = StateKeys("admission:")
WAITING_MS = 60_000
LEASE_MS = 60_000


@pytest.fixture
async def stores(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[tuple[RedisPlaces, LeaseStore, Redis]]:
    """This process's places (``p1``, its release loop not started: the test sends the
    removals itself) and another instance's bare store (``p2``) on one Redis."""
    monkeypatch.setattr(places_module, "WAITING_MS", WAITING_MS)
    config = StateConfig.model_validate(
        {"backend": "redis", "redis_url": redis_server.url, "timeout_ms": 2000}
    )
    clients = [StateClient(config) for _ in range(2)]
    here = LeaseStore(clients[0], "p1", LEASE_MS)
    other = LeaseStore(clients[1], "p2", LEASE_MS)
    places = RedisPlaces(clients[0], KEYS, here, LeaseKeeper(here, restore=True))
    redis = Redis.from_url(redis_server.url, decode_responses=True)
    try:
        yield places, other, redis
    finally:
        await redis.aclose()
        for client in clients:
            await client.aclose()


async def test_a_removal_sent_during_a_refused_seat_call_keeps_the_fresh_entry(
    stores: tuple[RedisPlaces, LeaseStore, Redis], monkeypatch: pytest.MonkeyPatch
) -> None:
    """a is refused r0 (full: p2 holds its one seat) and then stops waiting there; its
    removal is still pending when a asks r0 again and is refused again. The release loop
    sends the removal while that call is in flight, after Redis wrote the new entry: a
    waits at r0 and its entry must still be there (it was deleted, so other instances'
    tenants passed a by for up to its next ask)."""
    places, other, redis = stores
    share = Share("x", 1.0, KEYS.waiting("r0"), KEYS.waiting_weights("r0"), WAITING_MS)
    held = await other.acquire(KEYS.seats("r0"), 1, places.replica_channel("r0"), share)
    assert isinstance(held, Lease)
    first = await places.take("a", None, "r0", 1)
    assert isinstance(first, Blocked) and places.waiting_at("a") == ("r0",)
    places.stop_waiting("a", ["r0"])  # a's queue emptied: removal pending
    acquire = LeaseStore.acquire

    async def loop_runs_meanwhile(store: LeaseStore, *args: object, **kwargs: object) -> object:
        got = await acquire(store, *args, **kwargs)  # type: ignore[arg-type]
        await places._flush_unwaits()  # the release loop's turn, the answer on its way
        return got

    monkeypatch.setattr(LeaseStore, "acquire", loop_runs_meanwhile)
    again = await places.take("a", None, "r0", 1)
    assert isinstance(again, Blocked)
    assert places.waiting_at("a") == ("r0",)
    assert "a|p1" in await redis.zrange(KEYS.waiting("r0"), 0, -1)
