"""Two gateway instances on one real redis-server, for the dispatcher's shared-seat tests.

This process (``p1``): a ``Dispatcher`` on ``RedisPlaces``; the other instance (``p2``):
a bare ``LeaseStore`` the test asks seats of directly. Both clients run their scripts on
one fake clock, so waiting entries and leases expire only when a test moves it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass

from proxy.clock import FakeClock
from proxy.dispatch import Dispatcher, TenantLimits
from proxy.replicas import Replica, ReplicaPool
from proxy.scheduler import FairScheduler
from proxy.settings import ReplicaConfig, StateConfig
from proxy.state.client import StateClient
from proxy.state.keys import StateKeys
from proxy.state.leases import LeaseKeeper, LeaseStore
from proxy.state.places import RedisPlaces

KEYS = StateKeys("admission:")


@dataclass
class Instances:
    d: Dispatcher
    places: RedisPlaces
    clock: FakeClock
    here: LeaseStore
    other: LeaseStore


@asynccontextmanager
async def two_instances(
    redis_url: str, replicas: Mapping[str, int], *, start: float, lease_ms: int
) -> AsyncIterator[Instances]:
    """Replicas ``name -> seats`` (unreachable urls: nothing is sent), tenants a and b
    (queues of 8, no cap), one fair class."""
    config = StateConfig.model_validate(
        {"backend": "redis", "redis_url": redis_url, "timeout_ms": 2000}
    )
    clock = FakeClock(start=start)
    clients = [StateClient(config, clock=clock) for _ in range(2)]
    here = LeaseStore(clients[0], "p1", lease_ms)
    other = LeaseStore(clients[1], "p2", lease_ms)
    pool = ReplicaPool(
        Replica(ReplicaConfig(name=name, url="http://127.0.0.1:1", max_concurrency=seats))
        for name, seats in replicas.items()
    )
    limits = {t: TenantLimits(max_concurrency=None, queue_capacity=8) for t in ("a", "b")}
    d = Dispatcher(pool, FairScheduler({"standard": 1.0}), clock, limits)
    places = RedisPlaces(clients[0], KEYS, here, LeaseKeeper(here, restore=True))
    d.shared = places
    try:
        yield Instances(d, places, clock, here, other)
    finally:
        for client in clients:
            await client.aclose()
