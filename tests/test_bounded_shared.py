"""Clients that leave give every shared place back, in Redis too (real redis-server).

With ``state.backend: redis`` a seat and a capped tenant's place are leases in
Redis as well as counts in the process. Clients that give up while queued,
while their seat waits for a first byte, or mid-stream must leave no lease in
Redis, no count, no renewed lease, no waiting entry and no stray task; the
leases are counted in Redis itself (``LeaseStore.held``), the ground truth.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest

from proxy.sim import SimServer
from proxy.state.shared import SharedState
from tests.conftest import ProxyUnderTest
from tests.helpers import KEY_A, KEY_B, make_config, running_sims, wait_for
from tests.redis_server import RedisServer
from tests.test_bounded_clients import assert_no_request_state, stray_tasks, upstream_connections

pytestmark = pytest.mark.redis

Start = Callable[..., Awaitable[ProxyUnderTest]]
CHAT = "/v1/chat/completions"
SEATS = 2
CAP_A = 2
ROUNDS = 25
#: Bound on each wait (2 loaded cores: generous).
SETTLE_S = 10.0
LONG = {"queue_ms": 60_000, "first_byte_ms": 60_000, "total_ms": 120_000}


@pytest.fixture
async def sims() -> AsyncIterator[list[SimServer]]:
    async with running_sims(decode_per_seq_ms=0.1) as servers:
        yield servers


def chat(**extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **extra}


async def leases_in_redis(state: SharedState, keys: list[str]) -> int:
    return sum([await state.places.store.held(key) for key in keys])


async def settled(
    proxy: ProxyUnderTest, sims: list[SimServer], before: set[Any], keys: list[str]
) -> None:
    """Until nothing runs (proxy, replicas), no place is held here or in Redis, no
    lease is renewed, no waiting entry is left and no task is left over."""
    runtime = proxy.runtime
    state = runtime.state
    assert state is not None
    places = state.places
    async with asyncio.timeout(SETTLE_S):
        while (
            runtime.active
            or runtime.pool.total_inflight()
            or runtime.dispatcher.total_inflight()
            or len(runtime.dispatcher.scheduler)
            or any(s.state.in_flight for s in sims)
            or any(places.counts.values())
            or len(places.keeper)
            or any(places.waiting_at(t) for t in ("a", "b"))
            or await leases_in_redis(state, keys)
            or stray_tasks(before)
        ):
            await asyncio.sleep(0.01)
    proxy.assert_idle()
    assert_no_request_state(runtime)


async def test_clients_that_leave_give_every_shared_place_back(
    start_proxy: Start, sims: list[SimServer], redis_server: RedisServer
) -> None:
    """Rounds of clients leaving while queued and while waiting for a first byte (the
    replicas hang), then mid-stream: after each, Redis holds no lease of any seat or
    of the capped tenant's places, and the process no count, lease or waiting entry."""
    tenants = {
        "a": {"api_keys": [KEY_A], "max_concurrency": CAP_A, "queue_capacity": 100},
        "b": {"api_keys": [KEY_B], "queue_capacity": 100},
    }
    state = {"backend": "redis", "redis_url": redis_server.url, "timeout_ms": 2000}
    config = make_config(
        [s.url for s in sims], seats=SEATS, tenants=tenants, state=state, budgets=LONG,
        timeouts={"cancel_grace_ms": 20},
    )  # fmt: skip
    proxy = await start_proxy(config)
    runtime = proxy.runtime
    assert runtime.state is not None
    shared = runtime.state
    await wait_for(lambda: all(r.serving for r in runtime.pool.replicas))
    keys = [shared.keys.seats(r.name) for r in runtime.pool.replicas]
    keys += [shared.keys.tenant_places(t) for t in tenants]
    before = set(asyncio.all_tasks())
    seats = SEATS * len(sims)
    url = proxy.url
    key_of = itertools.cycle([KEY_A, KEY_B])
    async with aiohttp.ClientSession() as session:

        async def post(body: dict[str, Any]) -> aiohttp.ClientResponse:
            headers = {"Authorization": f"Bearer {next(key_of)}"}
            return await session.post(url + CHAT, json=body, headers=headers)

        for sim in sims:
            await sim.set_faults(hang_before_first_byte_ms=-1)
        for _ in range(ROUNDS):
            # a: 2 running (its cap), 1 queued; b: 2 running, 1 queued.
            tasks = [asyncio.ensure_future(post(chat(stream=True))) for _ in range(seats + 2)]
            await wait_for(
                lambda: (
                    sum(s.state.in_flight for s in sims) == seats
                    and len(runtime.dispatcher.scheduler) == 2
                ),
                timeout_s=SETTLE_S,
            )
            assert await leases_in_redis(shared, keys) == seats + CAP_A
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await settled(proxy, sims, before, keys)
        for sim in sims:
            await sim.set_faults(hang_before_first_byte_ms=0)
        for _ in range(ROUNDS):
            responses = [await post(chat(stream=True, max_tokens=4000)) for _ in range(seats)]
            for resp in responses:
                assert resp.status == 200
                assert await resp.content.readany()
            for resp in responses:
                resp.close()
            await settled(proxy, sims, before, keys)
    await settled(proxy, sims, before, keys)
    for sim in sims:
        assert upstream_connections(sim.port) <= SEATS + 1
