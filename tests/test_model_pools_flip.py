"""Requests admitted before the proxy routes by model, when it starts to.

While discovery has found one model (the second replica's engine is still
loading and answers nothing), ``ModelTable.pooled`` is false and tickets wait
in the one implicit pool, any replica. When the second replica comes up and
lists another model, the table becomes pooled: each ticket queued before moves
to the pool its body's model names (else the entrance's refusal), so a request
for llama is never granted the seat of the replica that serves only qwen (it
was, when the tickets kept the implicit pool). End to end, and the dispatcher
on a fake clock.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aiohttp import web

from proxy.admitted import Deadline
from proxy.clock import FakeClock
from proxy.dispatch import Dispatcher, TenantLimits
from proxy.errors import BadRequest
from proxy.models import ModelTable
from proxy.replicas import Replica, ReplicaPool
from proxy.scheduler import FairScheduler
from proxy.settings import BudgetsConfig, ReplicaConfig
from tests.helpers import wait_for
from tests.test_model_pools import (
    AUTH_A,
    COMPLETIONS,
    REPLICA,
    ModelReplica,
    ServerFactory,
    Start,
    _complete,
    _health,
    _list,
    pooled_config,
    start_replica,
)

LONG = {"queue_ms": 60_000, "first_byte_ms": 60_000, "total_ms": 120_000}


async def _loading_replica(
    aiohttp_server: ServerFactory, models: list[str]
) -> tuple[str, ModelReplica, asyncio.Event]:
    """A replica whose engine answers 503 on every path until ``up`` is set (vLLM
    loading its weights)."""
    up = asyncio.Event()

    @web.middleware
    async def loading(request: web.Request, handler: Any) -> web.StreamResponse:
        if not up.is_set():
            return web.json_response({"error": "loading"}, status=503)
        response: web.StreamResponse = await handler(request)
        return response

    app = web.Application(middlewares=[loading])
    app[REPLICA] = state = ModelReplica(list(models))
    app.router.add_get("/v1/models", _list)
    app.router.add_get("/health", _health)
    app.router.add_post(COMPLETIONS, _complete)
    server = await aiohttp_server(app)
    return str(server.make_url("")).rstrip("/"), state, up


async def test_a_request_queued_before_pools_exist_never_reaches_another_models_replica(
    aiohttp_server: ServerFactory, start_proxy: Start
) -> None:
    """r0 lists llama; r1's engine is still loading. A llama request holds r0's seat
    and another queues; r1 comes up listing qwen: the queued llama request waits
    for r0 (r1's free seat is not its pool's), and a queued request for a model
    nobody serves is answered 404 at the flip, not sent to r1."""
    url0, llama = await start_replica(aiohttp_server, ["llama"])
    url1, qwen, up = await _loading_replica(aiohttp_server, ["qwen"])
    config = pooled_config([url0, url1], [None, None], health={"interval_ms": 50}, budgets=LONG)
    proxy = await start_proxy(config)
    runtime = proxy.runtime
    await wait_for(lambda: runtime.models.served_models() == {"llama"})
    assert not runtime.models.pooled  # one model known: the implicit pool
    llama.gate.clear()
    body = {"model": "llama", "prompt": "x"}
    held = asyncio.create_task(proxy.client.post(COMPLETIONS, json=body, headers=AUTH_A))
    await wait_for(lambda: len(llama.bodies) == 1)
    queued = asyncio.create_task(proxy.client.post(COMPLETIONS, json=body, headers=AUTH_A))
    unknown = asyncio.create_task(
        proxy.client.post(COMPLETIONS, json={"model": "gpt-x", "prompt": "x"}, headers=AUTH_A)
    )
    await wait_for(lambda: len(runtime.dispatcher.scheduler) == 2)
    up.set()  # r1's engine has loaded: it lists qwen and serves
    await wait_for(lambda: runtime.models.pooled)
    await wait_for(lambda: (r := runtime.pool.get("r1")) is not None and r.serving)
    # r1 turned serving and the dispatcher pumped in that same step (the prober's
    # change hook): a grant of r1's free seat has happened by now if it is to happen.
    llama.gate.set()
    assert (await held).status == 200
    assert (await queued).status == 200
    resp = await unknown
    assert (resp.status, resp.headers["X-Admission-Reason"]) == (404, "model_not_found")
    assert qwen.named() == [], "a llama request was sent to the replica serving only qwen"
    assert llama.named() == ["llama", "llama"]
    proxy.assert_idle()


async def test_a_retry_after_the_flip_reseats_in_its_bodys_pool() -> None:
    """Fake clock: r0 lists a, r1's list is unknown (one model: not routed by model).
    A ticket for a and one naming no model are granted in the implicit pool. r1
    then lists b: a retry of the first reseats in pool a (r0 only, not r1's free
    seat); the second, like a new body without a model now, gets 400."""
    clock = FakeClock()
    replicas = [
        Replica(ReplicaConfig(name=n, url="http://127.0.0.1:1", max_concurrency=2))
        for n in ("r0", "r1")
    ]
    limits = {"t": TenantLimits(max_concurrency=None, queue_capacity=8)}
    dispatcher = Dispatcher(ReplicaPool(replicas), FairScheduler({"standard": 1.0}), clock, limits)
    table = ModelTable({"r0": None, "r1": None}, {})
    table.update("r0", frozenset({"a"}))
    dispatcher.seats.models = table
    assert not table.pooled
    deadline = Deadline.start(clock.now(), BudgetsConfig(**LONG))
    named = dispatcher.enqueue("t", "standard", 1.0, deadline, asked="a")
    nameless = dispatcher.enqueue("t", "standard", 1.0, deadline, asked=None)
    assert named.seat is not None and nameless.seat is not None
    assert dispatcher.pool_now(named) is None  # still one implicit pool
    table.update("r1", frozenset({"b"}))
    dispatcher.fleet_changed()
    assert dispatcher.pool_now(named) == "a"
    with pytest.raises(BadRequest):
        dispatcher.pool_now(nameless)
    for ticket in (named, nameless):
        assert ticket.seat is not None
        dispatcher.release(ticket.seat)
    seat = await dispatcher.reseat(frozenset(), 5.0, dispatcher.pool_now(named))
    assert seat.replica.name == "r0"
    dispatcher.finish(named, seat)
    dispatcher.finish(nameless, None)
    assert dispatcher.pool.total_inflight() == 0 and dispatcher.total_inflight() == 0
