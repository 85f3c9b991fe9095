"""Headroom seats above the knee, for tenants below their fair share (fake clock)."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable

import pytest

from proxy.admitted import Deadline
from proxy.clock import FakeClock
from proxy.dispatch import Dispatcher, TenantLimits
from proxy.estimators import RecentUsage
from proxy.replicas import Replica, ReplicaPool
from proxy.scheduler import FairScheduler, Ticket
from proxy.settings import BudgetsConfig, ReplicaConfig
from tests.conftest import ProxyUnderTest
from tests.helpers import KEY_A, KEY_B, make_config, wait_for

Start = Callable[..., Awaitable[ProxyUnderTest]]
CHAT = "/v1/chat/completions"

WEIGHTS = {"interactive": 8.0, "standard": 3.0, "batch": 1.0}
BUDGETS = BudgetsConfig(queue_ms=1000, first_byte_ms=1000, total_ms=5000)


def make(
    clock: FakeClock, seats: int, headroom: int, caps: dict[str, int] | None = None
) -> Dispatcher:
    config = ReplicaConfig(
        name="r0", url="http://127.0.0.1:1", max_concurrency=seats, headroom=headroom
    )
    caps = caps or {}
    limits = {
        t: TenantLimits(max_concurrency=caps.get(t), queue_capacity=64) for t in ("flood", "light")
    }
    return Dispatcher(ReplicaPool([Replica(config)]), FairScheduler(WEIGHTS), clock, limits)


def send(d: Dispatcher, clock: FakeClock, tenant: str, priority: str = "standard") -> Ticket:
    return d.enqueue(tenant, priority, 10.0, Deadline.start(clock.now(), BUDGETS))


def flood(
    d: Dispatcher, clock: FakeClock, queued: int = 4, priority: str = "standard"
) -> list[Ticket]:
    """The flood takes every regular seat and keeps a backlog."""
    tickets = [send(d, clock, "flood", priority) for _ in range(d.pool.replicas[0].limit + queued)]
    clock.advance(0.5)
    return tickets


def test_recent_usage_decays_and_is_a_fraction() -> None:
    usage = RecentUsage(tau_s=2.0)
    usage.record("a", 30.0, 0.0)
    usage.record("b", 10.0, 0.0)
    assert usage.fraction("a", 0.0) == pytest.approx(0.75)
    assert usage.fraction("nobody", 0.0) == 0.0
    usage.record("b", 40.0, 2.0)  # a's 30 decayed to 30/e meanwhile
    a, b = 30.0 / math.e, 10.0 / math.e + 40.0
    assert usage.fraction("a", 2.0) == pytest.approx(a / (a + b))
    usage.forget_idle(100.0)
    assert len(usage) == 0


async def test_light_tenant_starts_on_headroom_while_a_flood_holds_every_seat() -> None:
    clock = FakeClock()
    d = make(clock, seats=4, headroom=2)
    flood(d, clock)
    assert d.pool.total_inflight() == 4 and d.scheduler.depth("flood") == 4
    light = send(d, clock, "light")
    assert light.seat is not None, "a tenant below its share must not queue behind the flood"
    assert d.pool.total_inflight() == 5 and d.headroom_grants == 1


async def test_the_flood_never_takes_a_headroom_seat() -> None:
    """Over its share, the flooding tenant queues even with headroom free."""
    clock = FakeClock()
    d = make(clock, seats=4, headroom=2)
    flood(d, clock)
    more = send(d, clock, "flood")
    assert more.seat is None and d.pool.total_inflight() == 4 and d.headroom_grants == 0


async def test_a_lone_tenant_gets_no_headroom() -> None:
    """With nobody else backlogged its share is 1.0: headroom is not extra capacity."""
    clock = FakeClock()
    d = make(clock, seats=2, headroom=2)
    tickets = [send(d, clock, "light") for _ in range(4)]
    assert [t.seat is not None for t in tickets] == [True, True, False, False]


async def test_headroom_is_bounded_and_then_the_light_tenant_queues_in_order() -> None:
    clock = FakeClock()
    d = make(clock, seats=4, headroom=2)
    flood(d, clock)
    light = [send(d, clock, "light") for _ in range(3)]
    assert [t.seat is not None for t in light] == [True, True, False]
    assert d.pool.total_inflight() == 6
    # Its queued ticket keeps its place: a later one may not jump it onto headroom.
    first_headroom = light[0]
    assert first_headroom.seat is not None
    d.finish(first_headroom, first_headroom.seat)
    later = send(d, clock, "light")
    assert later.seat is None and light[2].seat is None
    assert d.scheduler.depth("light") == 2


async def test_headroom_respects_the_tenant_cap() -> None:
    clock = FakeClock()
    d = make(clock, seats=4, headroom=4, caps={"light": 1})
    flood(d, clock)
    first, second = send(d, clock, "light"), send(d, clock, "light")
    assert first.seat is not None and second.seat is None


async def test_interactive_rides_headroom_past_a_batch_flood() -> None:
    clock = FakeClock()
    d = make(clock, seats=4, headroom=1)
    flood(d, clock, priority="batch")
    assert send(d, clock, "light", "interactive").seat is not None


async def test_a_tenant_over_its_share_loses_headroom() -> None:
    """Equal weights: once "light" has taken most of the recent work, it queues too."""
    clock = FakeClock()
    d = make(clock, seats=1, headroom=8)
    flood(d, clock, queued=1)  # one flood dispatch of cost 10
    granted = 0
    for _ in range(8):
        if send(d, clock, "light").seat is not None:
            granted += 1
    # light is below 1/2 of the recent work for its first grant only: 10/(10+10) is not < 0.5.
    assert granted == 1
    assert d.scheduler.depth("light") == 7


async def test_end_to_end_a_light_tenant_passes_a_queued_flood_on_headroom(
    start_proxy: Start, upstream_url: str
) -> None:
    """Through the proxy: two seats held by the flood with two more of its requests
    queued; the light tenant's request starts at once on a headroom seat and is
    answered while the flood still waits."""
    tenants = {
        "flood": {"api_keys": [KEY_A]},
        "light": {"api_keys": [KEY_B]},
    }
    replicas = [{"name": "r0", "url": upstream_url, "max_concurrency": 2, "headroom": 1}]
    proxy = await start_proxy(make_config([upstream_url], tenants=tenants, replicas=replicas))
    slow = {"messages": [], "max_tokens": 1, "hang_ms": 400}
    flood = [
        asyncio.create_task(
            proxy.client.post(CHAT, json=slow, headers={"Authorization": f"Bearer {KEY_A}"})
        )
        for _ in range(4)
    ]
    await wait_for(lambda: proxy.runtime.dispatcher.queued() == 2)
    light = await proxy.client.post(
        CHAT, json={"messages": [], "max_tokens": 1}, headers={"Authorization": f"Bearer {KEY_B}"}
    )
    assert light.status == 200
    assert proxy.runtime.dispatcher.queued() == 2, "the flood was still waiting"
    state = await (await proxy.client.get("/admin/state")).json()
    assert state["headroom_grants"] == 1 and state["replicas"]["r0"]["headroom"] == 1
    assert [r.status for r in await asyncio.gather(*flood)] == [200] * 4
    assert proxy.runtime.dispatcher.headroom_grants == 1
    metrics = await (await proxy.client.get("/metrics")).text()
    assert 'admission_headroom_dispatches_total{tenant="light"} 1.0' in metrics
    assert 'admission_headroom_dispatches_total{tenant="flood"}' not in metrics
    await wait_for(lambda: proxy.runtime.pool.total_inflight() == 0)
    proxy.assert_idle()
