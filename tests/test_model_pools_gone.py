"""A model that no replica lists any more: its waiters are answered 404 at once.

Discovery that loses a model (a vLLM LoRA adapter unloaded) or a reload that
removes it from every static list leaves its pool with no replica: a new
request for it is 404 ``model_not_found`` at the entrance, and the tickets and
retries already waiting for a seat there get that same answer now instead of
waiting out their budgets. A pool whose replicas still list the model but are
ejected or drained is another matter (503 ``no_healthy_replica``, its queue
kept). End to end against the small replicas of ``test_model_pools``, and the
dispatcher on a fake clock.
"""

from __future__ import annotations

import asyncio

import pytest

from proxy.admitted import Deadline
from proxy.clock import FakeClock
from proxy.dispatch import Dispatcher, TenantLimits
from proxy.errors import ModelNotFound
from proxy.models import ModelTable
from proxy.pools import PoolQueues
from proxy.reload import apply_config
from proxy.replicas import Replica, ReplicaName, ReplicaPool, ReplicaState
from proxy.scheduler import FairScheduler, Ticket
from proxy.settings import BudgetsConfig, ReplicaConfig
from tests.helpers import wait_for
from tests.test_model_pools import (
    AUTH_A,
    COMPLETIONS,
    ServerFactory,
    Start,
    pooled_config,
    start_replica,
)

#: Queue budgets far longer than any wait below: an answer within ``wait_for``'s
#: bound came from the pool's loss, not from an expiry.
LONG = {"queue_ms": 60_000, "first_byte_ms": 60_000, "total_ms": 120_000}
BUDGETS = BudgetsConfig(**LONG)


async def test_queued_requests_of_an_unloaded_adapter_get_404_at_once(
    aiohttp_server: ServerFactory, start_proxy: Start
) -> None:
    """r0 lists llama and lora-x (discovered), its one seat held by a lora-x request,
    two more queued. r0 stops listing lora-x: the two queued get 404 model_not_found
    with the error body and their X-Request-Id while the seat is still held (60 s of
    queue budget left), the held one still completes, nothing leaks, and the 404s
    count under model="unknown" like the entrance's."""
    url0, first = await start_replica(aiohttp_server, ["llama", "lora-x"])
    url1, _ = await start_replica(aiohttp_server, ["qwen"])
    config = pooled_config([url0, url1], [None, None], health={"interval_ms": 50}, budgets=LONG)
    proxy = await start_proxy(config)
    table, dispatcher = proxy.runtime.models, proxy.runtime.dispatcher
    await wait_for(lambda: table.pool("lora-x") == {"r0"} and table.pool("qwen") == {"r1"})
    first.gate.clear()
    held = asyncio.create_task(
        proxy.client.post(COMPLETIONS, json={"model": "lora-x", "prompt": "x"}, headers=AUTH_A)
    )
    await wait_for(lambda: len(first.bodies) == 1)
    queued = [
        asyncio.create_task(
            proxy.client.post(
                COMPLETIONS,
                json={"model": "lora-x", "prompt": "x"},
                headers={**AUTH_A, "X-Request-Id": f"gone-{i}"},
            )
        )
        for i in range(2)
    ]
    await wait_for(lambda: len(dispatcher.scheduler) == 2)
    first.models = ["llama"]
    await wait_for(lambda: all(task.done() for task in queued))
    assert not held.done() and not first.gate.is_set()
    for i, task in enumerate(queued):
        resp = task.result()
        assert resp.status == 404
        assert resp.headers["X-Admission-Reason"] == "model_not_found"
        assert resp.headers["X-Request-Id"] == f"gone-{i}"
        assert "Retry-After" not in resp.headers
        error = (await resp.json())["error"]
        assert error["code"] == "model_not_found" and "lora-x" not in error["message"]
    assert len(dispatcher.scheduler) == 0
    first.gate.set()
    assert (await held).status == 200
    assert first.named() == ["lora-x"]
    await wait_for(lambda: not proxy.runtime.active)
    metrics = await (await proxy.client.get("/metrics")).text()
    assert 'admission_model_requests_total{model="unknown",outcome="rejected"} 2.0' in metrics
    assert 'admission_model_requests_total{model="lora-x",outcome="completed"} 1.0' in metrics
    proxy.assert_idle()


async def test_a_reload_that_removes_a_model_answers_its_queue_404(
    aiohttp_server: ServerFactory, start_proxy: Start
) -> None:
    """Static lists: r0 serves llama and extra, its seat held by an extra request and
    two more queued. A reload drops extra from r0's models: the two queued get 404
    at once; the held one completes; llama is still served."""
    url0, first = await start_replica(aiohttp_server, ["llama", "extra"])
    url1, _ = await start_replica(aiohttp_server, ["qwen"])
    config = pooled_config([url0, url1], [["llama", "extra"], ["qwen"]], budgets=LONG)
    proxy = await start_proxy(config)
    dispatcher = proxy.runtime.dispatcher
    await wait_for(lambda: all(r.serving for r in proxy.runtime.pool.replicas))
    first.gate.clear()
    body = {"model": "extra", "prompt": "x"}
    held = asyncio.create_task(proxy.client.post(COMPLETIONS, json=body, headers=AUTH_A))
    await wait_for(lambda: len(first.bodies) == 1)
    queued = [
        asyncio.create_task(proxy.client.post(COMPLETIONS, json=body, headers=AUTH_A))
        for _ in range(2)
    ]
    await wait_for(lambda: len(dispatcher.scheduler) == 2)
    apply_config(proxy.runtime, pooled_config([url0, url1], [["llama"], ["qwen"]], budgets=LONG))
    await wait_for(lambda: all(task.done() for task in queued))
    assert not held.done()
    for task in queued:
        resp = task.result()
        assert resp.status == 404 and resp.headers["X-Admission-Reason"] == "model_not_found"
    first.gate.set()
    assert (await held).status == 200
    resp = await proxy.client.post(
        COMPLETIONS, json={"model": "llama", "prompt": "x"}, headers=AUTH_A
    )
    assert resp.status == 200 and first.named() == ["extra", "llama"]
    proxy.assert_idle()


async def test_a_drained_pool_keeps_its_queue_and_refuses_503(
    aiohttp_server: ServerFactory, start_proxy: Start
) -> None:
    """r0 still lists lora-x but is drained, with two lora-x requests queued. A
    discovery change elsewhere (r1 gains a model) runs the same check: the queue is
    kept (the replica keeps its models), a new lora-x request is 503
    no_healthy_replica, and once r0 is back every queued request is served."""
    url0, first = await start_replica(aiohttp_server, ["llama", "lora-x"])
    url1, second = await start_replica(aiohttp_server, ["qwen"])
    config = pooled_config([url0, url1], [None, None], health={"interval_ms": 50}, budgets=LONG)
    proxy = await start_proxy(config)
    table, dispatcher = proxy.runtime.models, proxy.runtime.dispatcher
    await wait_for(lambda: table.pool("lora-x") == {"r0"} and table.pool("qwen") == {"r1"})
    first.gate.clear()
    body = {"model": "lora-x", "prompt": "x"}
    tasks = [
        asyncio.create_task(proxy.client.post(COMPLETIONS, json=body, headers=AUTH_A))
        for _ in range(3)
    ]
    await wait_for(lambda: len(dispatcher.scheduler) == 2 and len(first.bodies) == 1)
    replica = proxy.runtime.pool.get("r0")
    assert replica is not None
    replica.draining = True
    second.models = ["qwen", "new"]
    await wait_for(lambda: table.pool("new") == {"r1"})  # the prober ran the check just now
    assert len(dispatcher.scheduler) == 2 and not any(task.done() for task in tasks)
    resp = await proxy.client.post(COMPLETIONS, json=body, headers=AUTH_A)
    assert resp.status == 503 and resp.headers["X-Admission-Reason"] == "no_healthy_replica"
    replica.draining = False
    dispatcher.pump()
    first.gate.set()
    for task in tasks:
        assert (await task).status == 200
    assert first.named() == ["lora-x"] * 3
    proxy.assert_idle()


async def test_a_replica_turned_to_discovery_by_a_reload_keeps_its_models(
    aiohttp_server: ServerFactory, start_proxy: Start
) -> None:
    """r1 lists qwen and old statically; a reload sets its models to null. Right after
    the reload it still serves qwen and old (no 404 for a model it served a moment
    ago); once its GET /v1/models answers, its pool is what it lists: qwen and extra."""
    url0, _ = await start_replica(aiohttp_server, ["llama"])
    url1, second = await start_replica(aiohttp_server, ["qwen", "extra"])
    health = {"interval_ms": 100}
    config = pooled_config([url0, url1], [["llama"], ["qwen", "old"]], health=health)
    proxy = await start_proxy(config)
    table = proxy.runtime.models
    await wait_for(lambda: all(r.serving for r in proxy.runtime.pool.replicas))
    assert second.listed == 0
    apply_config(proxy.runtime, pooled_config([url0, url1], [["llama"], None], health=health))
    assert table.pool("qwen") == {"r1"} and table.pool("old") == {"r1"}
    resp = await proxy.client.post(
        COMPLETIONS, json={"model": "qwen", "prompt": "x"}, headers=AUTH_A
    )
    assert resp.status == 200 and second.named() == ["qwen"]
    await wait_for(lambda: table.pool("extra") == {"r1"})
    assert table.pool("old") == frozenset() and table.pool("qwen") == {"r1"}
    proxy.assert_idle()


# -- the dispatcher on a fake clock ------------------------------------------------------


def discovered_dispatcher(clock: FakeClock) -> tuple[Dispatcher, ModelTable]:
    """r0 discovered serving a and lora, r1 serving b; one seat each. Tenant t has no
    cap; tenant c may run one request at a time."""
    replicas = [
        Replica(ReplicaConfig(name=n, url="http://127.0.0.1:1", max_concurrency=1))
        for n in ("r0", "r1")
    ]
    limits = {
        "t": TenantLimits(max_concurrency=None, queue_capacity=64),
        "c": TenantLimits(max_concurrency=1, queue_capacity=64),
    }
    dispatcher = Dispatcher(ReplicaPool(replicas), FairScheduler({"standard": 1.0}), clock, limits)
    table = ModelTable({"r0": None, "r1": None}, {})
    table.update("r0", frozenset({"a", "lora"}))
    table.update("r1", frozenset({"b"}))
    dispatcher.seats.models = table
    return dispatcher, table


def expect_gone(ticket: Ticket) -> None:
    assert ticket.future is not None and ticket.future.done()
    assert isinstance(ticket.future.exception(), ModelNotFound)


async def test_dispatcher_answers_a_vanished_pools_tickets_at_once() -> None:
    """Fake clock, never advanced: lora's seat on r0 is held, two lora tickets of t and
    one of c (blocked at its cap by its b request) queue, with one a ticket. r0 stops
    listing lora: every lora ticket fails ModelNotFound now, the a ticket stays and
    gets r0's seat when it frees; a new lora ticket is refused at once."""
    clock = FakeClock()
    dispatcher, table = discovered_dispatcher(clock)
    deadline = Deadline.start(clock.now(), BUDGETS)
    holder = dispatcher.enqueue_in("lora", "t", "standard", 1.0, deadline)
    capped = dispatcher.enqueue_in("b", "c", "standard", 1.0, deadline)
    assert holder.seat is not None and capped.seat is not None
    lora = [dispatcher.enqueue_in("lora", "t", "standard", 1.0, deadline) for _ in range(2)]
    lora.append(dispatcher.enqueue_in("lora", "c", "standard", 1.0, deadline))
    other = dispatcher.enqueue_in("a", "t", "standard", 1.0, deadline)
    assert len(dispatcher.scheduler) == 4
    dispatcher.fleet_changed()  # nothing lost yet: nothing answered
    assert len(dispatcher.scheduler) == 4
    table.update("r0", frozenset({"a"}))
    dispatcher.fleet_changed()
    for ticket in lora:
        expect_gone(ticket)
        assert ticket.expires_at > clock.now()  # its whole queue budget was left
        with pytest.raises(ModelNotFound):
            await dispatcher.wait(ticket)
    assert len(dispatcher.scheduler) == 1 and other.seat is None
    with pytest.raises(ModelNotFound):
        dispatcher.enqueue_in("lora", "t", "standard", 1.0, deadline)
    dispatcher.finish(holder, holder.seat)
    assert other.seat is not None and other.seat.replica.name == "r0"
    dispatcher.finish(other, await dispatcher.wait(other))
    dispatcher.finish(capped, capped.seat)
    assert dispatcher.pool.total_inflight() == 0 and dispatcher.total_inflight() == 0
    assert len(dispatcher.scheduler) == 0
    # The lora request that ran through the loss ended without making its pool again
    # (no empty queue, no metric series for a model nobody serves).
    assert isinstance(dispatcher.scheduler, PoolQueues)
    assert set(dispatcher.scheduler.depth_by_model()) == {"a"}


async def test_dispatcher_keeps_the_queue_of_an_ejected_pool() -> None:
    """Fake clock: r0, the only replica of a, is ejected with two a tickets queued.
    It still lists a, so the check leaves them queued (the entrance answers new ones
    no_healthy_replica); when r0 returns and its seat frees, they are granted."""
    clock = FakeClock()
    dispatcher, table = discovered_dispatcher(clock)
    deadline = Deadline.start(clock.now(), BUDGETS)
    holder = dispatcher.enqueue_in("a", "t", "standard", 1.0, deadline)
    backlog = [dispatcher.enqueue_in("a", "t", "standard", 1.0, deadline) for _ in range(2)]
    replica = dispatcher.pool.get(ReplicaName("r0"))
    assert replica is not None
    replica.move_to(ReplicaState.EJECTED)
    dispatcher.fleet_changed()
    assert not dispatcher.pool.any_usable(table.pool("a"))
    assert dispatcher.seats.unserved("a") is None
    assert len(dispatcher.scheduler) == 2
    assert all(t.future is not None and not t.future.done() for t in backlog)
    replica.move_to(ReplicaState.SERVING)
    dispatcher.finish(holder, holder.seat)
    for ticket in backlog:
        seat = await dispatcher.wait(ticket)
        assert seat.replica.name == "r0"
        dispatcher.finish(ticket, seat)
    assert dispatcher.pool.total_inflight() == 0 and len(dispatcher.scheduler) == 0


async def test_a_retry_waiting_for_a_vanished_pools_seat_gets_404() -> None:
    """A retry waits for lora's one seat (held); r0 stops listing lora: the retry's
    reseat fails ModelNotFound at once, not after its 30 s, and a retry that starts
    waiting after the loss is refused before it waits."""
    clock = FakeClock()
    dispatcher, table = discovered_dispatcher(clock)
    deadline = Deadline.start(clock.now(), BUDGETS)
    holder = dispatcher.enqueue_in("lora", "t", "standard", 1.0, deadline)
    retry = asyncio.create_task(dispatcher.reseat(frozenset({ReplicaName("r0")}), 30.0, "lora"))
    await asyncio.sleep(0)
    assert not retry.done()
    table.update("r0", frozenset({"a"}))
    dispatcher.fleet_changed()
    await asyncio.sleep(0)
    assert retry.done()
    with pytest.raises(ModelNotFound):
        await retry
    with pytest.raises(ModelNotFound):
        await dispatcher.reseat(frozenset(), 30.0, "lora")
    dispatcher.finish(holder, holder.seat)
    assert dispatcher.pool.total_inflight() == 0 and dispatcher.total_inflight() == 0


def test_a_replica_turned_to_discovery_keeps_its_list_until_it_answers() -> None:
    """ModelTable: static ("qwen", "old") reconfigured to null keeps that set; the
    first discovery answer replaces it; a replica new in the config serves nothing yet."""
    table = ModelTable({"r0": ("llama",), "r1": ("qwen", "old")}, {})
    table.reconfigure({"r0": ("llama",), "r1": None, "r2": None}, {}, restricted=False)
    assert table.discovers("r1") and table.models_of("r1") == {"qwen", "old"}
    assert table.models_of("r2") == frozenset()
    assert table.update("r1", frozenset({"qwen", "extra"}))
    assert table.pool("old") == frozenset() and table.pool("extra") == {"r1"}
