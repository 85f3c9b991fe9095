"""Retries as a multi-model fleet meets them, end to end against simulator replicas.

Each test injects a fault into some replicas (``proxy/sim``'s fault flags) and
checks where the retry went, how long it may wait, and what the client, the
access log and the counters see. Routing is read from each simulator's own
request count, never from the proxy's view of itself.
"""

from __future__ import annotations

import asyncio
import io
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from proxy.sim import SimConfig, SimServer, start_sim
from tests.conftest import ProxyUnderTest
from tests.helpers import KEY_A, make_config, wait_for

Start = Callable[..., Awaitable[ProxyUnderTest]]
CHAT = "/v1/chat/completions"
AUTH = {"Authorization": f"Bearer {KEY_A}"}
QUICK_RETRY = {"base_backoff_ms": 1, "max_backoff_ms": 5}
#: Passive ejection kept out of the way: these tests watch where retries go, not health.
NO_EJECTION = {"eject_after_failures": 1000, "interval_ms": 60000}


async def start_sims(*models: str) -> list[SimServer]:
    return [
        await start_sim(
            SimConfig(slots=8, seed=i, decode_base_ms=1.0, decode_per_seq_ms=0.2, model_name=m)
        )
        for i, m in enumerate(models)
    ]


@pytest.fixture
async def three() -> AsyncIterator[list[SimServer]]:
    servers = await start_sims("m", "m", "m")
    try:
        yield servers
    finally:
        for server in servers:
            await server.close()


def chat(model: str | None = None, **extra: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
    if model is not None:
        doc["model"] = model
    return {**doc, **extra}


def received(sim: SimServer) -> int:
    """Inference requests this simulator was sent (injected errors included)."""
    return sim.state.requests_total


async def test_a_third_attempt_prefers_a_replica_that_has_not_failed_it(
    start_proxy: Start, three: list[SimServer]
) -> None:
    """Two of three replicas answer every request 503; with max_attempts 3 the last
    attempt goes to the third replica, not back to the one that failed the first: each
    request succeeds."""
    retry = {**QUICK_RETRY, "max_attempts": 3, "min_retries_per_s": 100}
    proxy = await start_proxy(
        make_config([s.url for s in three], seats=8, retry=retry, health=NO_EJECTION)
    )
    await wait_for(lambda: all(r.serving for r in proxy.runtime.pool.replicas))
    for sim in three[:2]:
        await sim.set_faults(error_rate=1.0, error_status=503)
    before = received(three[2])
    statuses = []
    for _ in range(20):  # one at a time: every replica is idle, the choice is the tie-break
        resp = await proxy.client.post(CHAT, json=chat(), headers=AUTH)
        await resp.read()
        statuses.append(resp.status)
    assert statuses == [200] * 20
    assert received(three[2]) - before == 20
    proxy.assert_idle()
