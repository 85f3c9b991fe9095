"""Retries with shared state give every seat and place back (real redis-server).

A retry gives its replica seat back for its backoff (in Redis too), keeps its
tenant's place, and takes a seat again; clients leave at any of those points.
However it ends, nothing may stay held: not in the process, not in Redis.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest

from proxy.sim import SimConfig, SimServer, start_sim
from tests.conftest import ProxyUnderTest
from tests.helpers import KEY_A, KEY_B, make_config, wait_for
from tests.redis_server import RedisServer
from tests.test_bounded_shared import settled

pytestmark = pytest.mark.redis
Start = Callable[..., Awaitable[ProxyUnderTest]]
CHAT = "/v1/chat/completions"
REQUESTS = 80


@pytest.fixture
async def sims() -> AsyncIterator[list[SimServer]]:
    servers = [
        await start_sim(SimConfig(slots=8, seed=i, decode_base_ms=2.0, decode_per_seq_ms=0.5))
        for i in range(2)
    ]
    try:
        yield servers
    finally:
        for server in servers:
            await server.close()


async def test_retries_and_clients_leaving_hold_nothing_afterwards(
    start_proxy: Start, sims: list[SimServer], redis_server: RedisServer
) -> None:
    """Two replicas of 2 seats, one answering half its requests 503, a capped tenant and
    an uncapped one, 3 attempts each: many requests at once, some clients leaving at
    random moments (queued, in backoff, waiting for a seat again, mid-answer). Every
    request ends; afterwards no seat or place is held in the process, no lease is
    renewed, and Redis holds none once any a cancelled call took has expired."""
    tenants = {
        "a": {"api_keys": [KEY_A], "max_concurrency": 2, "queue_capacity": 200},
        "b": {"api_keys": [KEY_B], "queue_capacity": 200},
    }
    # A client that leaves during a seat's Redis call may leave the lease that call took
    # there, unrenewed: it frees within lease_ms (proxy/state/client.py), kept short here.
    state = {"backend": "redis", "redis_url": redis_server.url, "timeout_ms": 2000,
             "lease_ms": 3000}  # fmt: skip
    retry = {"max_attempts": 3, "base_backoff_ms": 5, "max_backoff_ms": 40,
             "min_retries_per_s": 1000, "retry_on": ["connect_error", "http_503"]}  # fmt: skip
    config = make_config(
        [s.url for s in sims], seats=2, tenants=tenants, state=state, retry=retry,
        budgets={"queue_ms": 30_000, "first_byte_ms": 30_000, "total_ms": 60_000},
        health={"eject_after_failures": 1000}, timeouts={"cancel_grace_ms": 20},
    )  # fmt: skip
    proxy = await start_proxy(config)
    runtime = proxy.runtime
    shared = runtime.state
    assert shared is not None
    await wait_for(lambda: all(r.serving for r in runtime.pool.replicas))
    keys = [shared.keys.seats(r.name) for r in runtime.pool.replicas]
    keys += [shared.keys.tenant_places(t) for t in tenants]
    before = set(asyncio.all_tasks())
    await sims[0].set_faults(error_rate=0.5, error_status=503)
    rng = random.Random(7)
    statuses: list[int] = []
    async with aiohttp.ClientSession() as session:

        async def one(i: int) -> None:
            key = KEY_A if i % 2 else KEY_B
            headers = {"Authorization": f"Bearer {key}"}
            body: dict[str, Any] = {"messages": [{"role": "user", "content": f"q{i}"}],
                                    "max_tokens": 8, "stream": i % 3 == 0}  # fmt: skip
            async with session.post(proxy.url + CHAT, json=body, headers=headers) as resp:
                await resp.read()
                statuses.append(resp.status)

        tasks = [asyncio.ensure_future(one(i)) for i in range(REQUESTS)]
        # Leave at random moments: every retry stage is met by some of them.
        for task in rng.sample(tasks, REQUESTS // 4):
            await asyncio.sleep(rng.uniform(0.0, 0.02))
            task.cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
    assert all(r is None or isinstance(r, asyncio.CancelledError) for r in results), results
    assert statuses and set(statuses) <= {200, 503}
    assert sims[0].state.dice.errors_injected > 0
    assert runtime.telemetry.metrics.retries.labels("http_503")._value.get() > 0
    await settled(proxy, sims, before, keys)
