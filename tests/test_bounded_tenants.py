"""Tenants that come and go by reload leave no label, series or place behind.

Tenants are the operator's, but over weeks of reloads (customers onboarded and
offboarded) their names churn. The metric labels are capped at
``telemetry.max_tenant_labels``; a tenant a reload removed keeps its label only
while its requests still run, so the label set stays within the cap. End to end
through the real proxy and its reload path, in front of simulator replicas.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from proxy.reload import apply_config
from proxy.settings import Config
from proxy.sim import SimConfig, SimServer, start_sim
from tests.conftest import ProxyUnderTest
from tests.helpers import KEY_A, make_config, wait_for

Start = Callable[..., Awaitable[ProxyUnderTest]]
CHAT = "/v1/chat/completions"
BODY = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
ROUNDS = 40
#: The round whose tenant has a request running across the reload that removes it.
BUSY_ROUND = 20


@pytest.fixture
async def sims() -> AsyncIterator[list[SimServer]]:
    servers = [await start_sim(SimConfig(seed=i, decode_base_ms=1.0)) for i in range(2)]
    try:
        yield servers
    finally:
        for server in servers:
            await server.close()


def config(urls: list[str], rotating: int) -> Config:
    """Tenant ``keep`` and tenant ``rot-<rotating>``, two labels at most."""
    tenants: dict[str, Any] = {
        "keep": {"api_keys": [KEY_A]},
        f"rot-{rotating}": {
            "api_keys": [f"sk-rot-{rotating}"],
            "token_quota": {"per_day": 1_000_000},
        },
    }
    return make_config(urls, seats=1, tenants=tenants, telemetry={"max_tenant_labels": 2})


def tenant_labels(metrics: str) -> set[str]:
    return {
        sample.labels["tenant"]
        for family in text_string_to_metric_families(metrics)
        for sample in family.samples
        if "tenant" in sample.labels
    }


async def send(proxy: ProxyUnderTest, key: str) -> int:
    resp = await proxy.client.post(CHAT, json=BODY, headers={"Authorization": f"Bearer {key}"})
    await resp.read()
    return resp.status


async def test_reloads_that_rotate_tenants_keep_the_labels_within_the_cap(
    start_proxy: Start, sims: list[SimServer]
) -> None:
    """Forty reloads, each replacing the rotating tenant by a new one that then sends
    three requests at once (on two seats): the metrics name ``keep``, the tenant of now
    and ``other``/``unknown`` only, and the proxy keeps per-tenant figures (queue
    high-water marks, mean output, last quota reading) for those only. The tenant
    removed while its request still ran is counted under its own label (that request
    ends after the reload), and forgotten at the next reload."""
    urls = [s.url for s in sims]
    proxy = await start_proxy(config(urls, 0))
    runtime = proxy.runtime
    assert await send(proxy, "sk-rot-0") == 200
    for i in range(1, ROUNDS + 1):
        busy = None
        if i == BUSY_ROUND:
            for sim in sims:
                await sim.set_faults(hang_before_first_byte_ms=-1)
            busy = asyncio.ensure_future(send(proxy, f"sk-rot-{i - 1}"))
            await wait_for(lambda: runtime.pool.total_inflight() == 1)
        apply_config(runtime, config(urls, i))
        if busy is not None:
            busy.cancel()
            await asyncio.gather(busy, return_exceptions=True)
            for sim in sims:
                await sim.set_faults(hang_before_first_byte_ms=0)
            await wait_for(lambda: not runtime.active)
            metrics = await (await proxy.client.get("/metrics")).text()
            assert f"rot-{i - 1}" in tenant_labels(metrics)  # its own, though removed
        # Three at once on two seats: one may queue (a queue high-water mark to keep).
        statuses = await asyncio.gather(*(send(proxy, f"sk-rot-{i}") for _ in range(3)))
        assert statuses == [200, 200, 200]
        assert await send(proxy, KEY_A) == 200
    metrics = await (await proxy.client.get("/metrics")).text()
    now = {"keep", f"rot-{ROUNDS}"}
    assert tenant_labels(metrics) <= now | {"other", "unknown"}
    # What is kept per tenant follows the tenants of now (removed ones fold into other).
    assert set(runtime.dispatcher.depth_high_water()) <= now | {"other"}
    assert len(runtime.output_tokens) <= len(now)
    assert set(runtime.token_quotas._seen) <= now  # the last quota readings (private)
    # The cancelled request's seat comes back after ``cancel_grace_ms``.
    await wait_for(lambda: runtime.pool.total_inflight() == 0)
    proxy.assert_idle()
