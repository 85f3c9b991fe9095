"""A client that leaves while its token charge is being settled ends its request all the same.

The settlement of a token charge (``entrance._settle``) runs in the handler's
``finally`` after the answer went out; with ``state.backend: redis`` it is a round
trip. A client that closes its connection as soon as it has the whole answer
(as most do after ``data: [DONE]``) cancels the handler during that round trip.
The request must still leave the proxy's books (``Runtime.active``), be logged
and counted once, and have its charge corrected: before, the cancellation skipped
all of that, and the record stayed active for the process's life (a SIGTERM then
waited the whole grace for it).

Redis is made to hold the settlement with its own ``CLIENT PAUSE ... WRITE``
(real redis-server), so the client's leave lands inside it every time.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import pytest
import redis.asyncio as redis_asyncio

from proxy.sim import SimConfig, SimServer, start_sim
from proxy.state.quota import QuotaLimits
from tests.conftest import ProxyUnderTest
from tests.helpers import KEY_A, KEY_B, make_config, samples_by_label, wait_for
from tests.redis_server import RedisServer

pytestmark = pytest.mark.redis

Start = Callable[..., Awaitable[ProxyUnderTest]]
CHAT = "/v1/chat/completions"
#: How long Redis holds every write once paused: the settlement waits this long.
PAUSE_MS = 1500
MAX_TOKENS = 40
PER_DAY = 1_000_000


@pytest.fixture
async def sim() -> AsyncIterator[SimServer]:
    server = await start_sim(SimConfig(slots=4, seed=1, decode_base_ms=10.0))
    try:
        yield server
    finally:
        await server.close()


async def test_a_client_leaving_during_the_settlement_still_ends_its_request(
    start_proxy: Start, sim: SimServer, redis_server: RedisServer
) -> None:
    tenants = {
        "a": {"api_keys": [KEY_A], "token_quota": {"per_day": PER_DAY}},
        "b": {"api_keys": [KEY_B]},
    }
    # The settlement may wait out the pause (it is shorter than timeout_ms).
    state = {"backend": "redis", "redis_url": redis_server.url, "timeout_ms": 5000}
    proxy = await start_proxy(make_config([sim.url], seats=4, tenants=tenants, state=state))
    runtime = proxy.runtime
    await wait_for(lambda: all(r.serving for r in runtime.pool.replicas))
    pauser = redis_asyncio.from_url(redis_server.url)
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": MAX_TOKENS,
            "stream": True}  # fmt: skip
    try:
        connector = aiohttp.TCPConnector(force_close=True)
        async with aiohttp.ClientSession(connector=connector) as session:
            resp = await session.post(
                proxy.url + CHAT, json=body, headers={"Authorization": f"Bearer {KEY_A}"}
            )
            assert resp.status == 200
            assert await resp.content.readany()  # charged at admission, now streaming
            await pauser.client_pause(PAUSE_MS, all=False)  # WRITE: reads go on
            async with asyncio.timeout(30):
                while await resp.content.readany():  # the whole answer, [DONE] and the end
                    pass
            # The answer is whole; the handler now settles, held by the pause. The
            # client leaves, as clients do at [DONE].
            resp.close()
        await wait_for(lambda: not runtime.active, timeout_s=PAUSE_MS / 1000 + 10)
    finally:
        await pauser.client_unpause()
        await pauser.aclose()
    proxy.assert_idle()
    # Logged and counted once, and the charge corrected to what was used: the day's
    # use in Redis is the tokens the proxy counted for the answer, not the estimate.
    async with proxy.client.get("/metrics") as metrics:
        text = await metrics.text()
    requests = samples_by_label(text, "admission_requests_total", "tenant")
    assert requests.get("a") == 1, requests
    tokens = samples_by_label(text, "admission_tokens_total", "tenant")
    assert tokens.get("a", 0) > MAX_TOKENS, tokens
    left = await runtime.token_quotas.store.remaining("a", QuotaLimits(per_day=PER_DAY))
    assert left.day == PER_DAY - tokens["a"], (left, tokens)
