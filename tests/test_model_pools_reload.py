"""Model pools across a reload that removes (and puts back) a busy replica.

End to end through the real proxy against the small replicas of
``test_model_pools``: a removed replica drains without putting its models
back into the table, and one put back while its old self drains is the same
replica (in the pool, its seats counted).
"""

from __future__ import annotations

import asyncio

from aiohttp import ClientResponse

from proxy.reload import apply_config
from tests.conftest import ProxyUnderTest
from tests.helpers import wait_for
from tests.test_model_pools import (
    AUTH_A,
    COMPLETIONS,
    ModelReplica,
    ServerFactory,
    Start,
    pooled_config,
    start_replica,
)

LONG = {"queue_ms": 60_000, "first_byte_ms": 60_000, "total_ms": 120_000}
FAST = {"interval_ms": 50}
BODY = {"model": "llama", "prompt": "x"}


async def test_a_removed_replica_still_draining_is_not_rediscovered_into_a_pool(
    aiohttp_server: ServerFactory, start_proxy: Start
) -> None:
    """r0 discovers llama, r1 discovers qwen. A request holds r1's seat; a reload
    removes r1 (it drains). The prober keeps probing the draining r1, and its
    answers must not put qwen back into the table the reload cleared (nothing
    would take it out again: qwen was answered 503 no_healthy_replica for good,
    and a body without ``model`` 400 "2 models are served"). Once r1 has left,
    llama is the one model served, so the proxy no longer routes by model: every
    body reaches r0 unchanged, as in any single-model deployment."""
    url0, _ = await start_replica(aiohttp_server, ["llama"])
    url1, second = await start_replica(aiohttp_server, ["qwen"])
    config = pooled_config([url0, url1], [None, None], health=FAST, budgets=LONG)
    proxy = await start_proxy(config)
    runtime = proxy.runtime
    table = runtime.models
    await wait_for(lambda: table.pool("llama") == {"r0"} and table.pool("qwen") == {"r1"})
    await wait_for(lambda: all(r.serving for r in runtime.pool.replicas))
    second.gate.clear()
    held = asyncio.create_task(
        proxy.client.post(COMPLETIONS, json={"model": "qwen", "prompt": "x"}, headers=AUTH_A)
    )
    await wait_for(lambda: len(second.bodies) == 1)
    apply_config(runtime, pooled_config([url0], [None], health=FAST, budgets=LONG))
    assert table.pool("qwen") == frozenset()  # the reload forgot r1's models
    listed = second.listed
    await wait_for(lambda: second.listed > listed + 1)  # the prober asked the draining r1 again
    second.gate.set()
    assert (await held).status == 200
    await wait_for(lambda: runtime.pool.get("r1") is None)  # r1 has left the proxy
    assert table.served_models() == {"llama"} and not table.pooled
    assert table.pool("qwen") == frozenset(), "a replica no longer configured serves a pool"
    resp = await proxy.client.post(COMPLETIONS, json={"prompt": "x"}, headers=AUTH_A)
    assert resp.status == 200, resp.headers.get("X-Admission-Reason")
    proxy.assert_idle()


async def _put_back_while_draining(
    aiohttp_server: ServerFactory, start_proxy: Start
) -> tuple[ProxyUnderTest, ModelReplica, ModelReplica, list[asyncio.Task[ClientResponse]]]:
    """r0 and r1 (static llama, one seat each), each seat held by a request; a reload
    removes r1 (retired, draining with its one request); a second reload (or a
    rollback) puts r1 back, and the new r1 warms and serves."""
    url0, first = await start_replica(aiohttp_server, ["llama"])
    url1, second = await start_replica(aiohttp_server, ["llama"])
    both = pooled_config([url0, url1], [["llama"], ["llama"]], health=FAST, budgets=LONG)
    proxy = await start_proxy(both)
    runtime = proxy.runtime
    await wait_for(lambda: all(r.serving for r in runtime.pool.replicas))
    first.gate.clear()
    second.gate.clear()
    held = [
        asyncio.create_task(proxy.client.post(COMPLETIONS, json=BODY, headers=AUTH_A))
        for _ in range(2)
    ]
    await wait_for(lambda: len(first.bodies) == 1 and len(second.bodies) == 1)
    apply_config(runtime, pooled_config([url0], [["llama"]], health=FAST, budgets=LONG))
    apply_config(runtime, both)  # put back (POST /admin/rollback does the same)
    await wait_for(lambda: (r := runtime.pool.get("r1")) is not None and r.serving)
    return proxy, first, second, held


async def test_a_replica_put_back_while_its_old_self_drains_stays_in_the_pool(
    aiohttp_server: ServerFactory, start_proxy: Start
) -> None:
    """``apply_config`` makes a new Replica r1 next to the draining old one. When the
    old one's last seat comes back, ``ReplicaPool.free`` pops the *name* r1, which is
    now the new replica: r1 vanishes from the proxy (no traffic, no probes, not in
    /admin/state) until the next reload, although the running config lists it."""
    proxy, first, second, held = await _put_back_while_draining(aiohttp_server, start_proxy)
    first.gate.set()
    second.gate.set()
    for task in held:
        assert (await task).status == 200
    await wait_for(lambda: not proxy.runtime.active)
    assert proxy.runtime.pool.get("r1") is not None, "r1 left the pool although configured"
    proxy.assert_idle()


async def test_a_replica_put_back_while_its_old_self_drains_keeps_its_limit(
    aiohttp_server: ServerFactory, start_proxy: Start
) -> None:
    """The new r1 counts 0 in flight while the old r1's request still runs on the same
    engine, so with local state a new request is sent to r1 at once: 2 requests on a
    replica of max_concurrency 1 (the contract: never exceeded)."""
    proxy, first, second, held = await _put_back_while_draining(aiohttp_server, start_proxy)
    runtime = proxy.runtime
    extra = asyncio.create_task(proxy.client.post(COMPLETIONS, json=BODY, headers=AUTH_A))
    await wait_for(lambda: len(runtime.dispatcher.scheduler) == 1 or len(second.bodies) == 2)
    over = len(second.bodies)
    first.gate.set()
    second.gate.set()
    for task in [*held, extra]:
        assert (await task).status == 200
    assert over == 1, "r1 ran 2 requests at once with max_concurrency 1"
