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

from proxy.health import EngineReading
from proxy.sim import SimConfig, SimServer, start_sim
from proxy.worker_admin import set_draining
from tests.conftest import ProxyUnderTest
from tests.helpers import KEY_A, make_config, wait_for
from tests.redis_server import RedisServer
from tests.upstreams import Upstream

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


@pytest.fixture
async def pools() -> AsyncIterator[list[SimServer]]:
    """r0 and r1 serve model ``m1``, r2 serves ``m2``; each lists its model itself."""
    servers = await start_sims("m1", "m1", "m2")
    try:
        yield servers
    finally:
        for server in servers:
            await server.close()


async def test_a_retry_stays_in_its_model_pool_with_aliases_and_discovered_models(
    start_proxy: Start, pools: list[SimServer]
) -> None:
    """Models discovered from each replica's /v1/models and an alias: a request for the
    alias whose replica fails is retried on the other replica of its pool, never on the
    replica of another model, even when its own pool has no other replica left (drained):
    then it goes back to the failing one and its answer is passed through."""
    retry = {**QUICK_RETRY, "max_attempts": 3, "min_retries_per_s": 100}
    proxy = await start_proxy(
        make_config(
            [s.url for s in pools],
            seats=8,
            retry=retry,
            health=NO_EJECTION,
            model_aliases={"fast": "m1"},
        )
    )
    runtime = proxy.runtime
    await wait_for(lambda: runtime.models.pooled and len(runtime.models.served_models()) == 2)
    await pools[0].set_faults(error_rate=1.0, error_status=503)
    other_model = received(pools[2])
    for _ in range(10):
        resp = await proxy.client.post(CHAT, json=chat("fast"), headers=AUTH)
        assert resp.status == 200
        assert (await resp.json())["model"] == "m1"
    set_draining(runtime, "r1", True)
    for _ in range(3):
        resp = await proxy.client.post(CHAT, json=chat("fast"), headers=AUTH)
        assert resp.status == 503
        assert resp.headers["X-Admission-Reason"] == "upstream_status"
    assert received(pools[2]) == other_model
    proxy.assert_idle()


async def test_a_retry_leaves_the_affinity_home_that_failed_it(
    start_proxy: Start, three: list[SimServer]
) -> None:
    """prefix_affinity: every request of one session key goes to its home replica; when
    that replica fails, each request's retry is served by another replica."""
    retry = {**QUICK_RETRY, "min_retries_per_s": 100}
    proxy = await start_proxy(
        make_config(
            [s.url for s in three],
            seats=8,
            retry=retry,
            health=NO_EJECTION,
            routing={"policy": "prefix_affinity"},
        )
    )
    await wait_for(lambda: all(r.serving for r in proxy.runtime.pool.replicas))
    session = {**AUTH, "X-Session-Id": "conversation-7"}
    counts = [received(s) for s in three]
    assert (await proxy.client.post(CHAT, json=chat(), headers=session)).status == 200
    home = next(i for i, s in enumerate(three) if received(s) > counts[i])
    await three[home].set_faults(error_rate=1.0, error_status=503)
    for _ in range(10):
        resp = await proxy.client.post(CHAT, json=chat(), headers=session)
        assert resp.status == 200
    assert three[home].state.dice.errors_injected == 10  # each went home first
    proxy.assert_idle()


async def test_a_retried_request_is_charged_and_settled_once(
    start_proxy: Start, three: list[SimServer]
) -> None:
    """A tenant with a token quota: a request whose first attempt failed is charged its
    estimate once and settled once, at the usage of the attempt that answered; the
    access log says how many attempts it took."""
    log = io.StringIO()
    tenants = {"a": {"api_keys": [KEY_A], "token_quota": {"per_day": 100_000}}}
    retry = {**QUICK_RETRY, "min_retries_per_s": 100}
    proxy = await start_proxy(
        make_config(
            [s.url for s in three[:2]],
            seats=8,
            tenants=tenants,
            retry=retry,
            health=NO_EJECTION,
        ),
        access_log=log,
    )
    await wait_for(lambda: all(r.serving for r in proxy.runtime.pool.replicas))
    remaining = 100_000
    await three[0].set_faults(error_rate=1.0, error_status=503)
    for _ in range(6):
        resp = await proxy.client.post(CHAT, json=chat(), headers=AUTH)
        assert resp.status == 200
        used = (await resp.json())["usage"]["total_tokens"]
        remaining -= used
        assert int(resp.headers["x-ratelimit-remaining-tokens"]) == remaining
    lines = [json.loads(line) for line in log.getvalue().splitlines()]
    attempts = [line["attempts"] for line in lines]
    assert set(attempts) <= {1, 2} and 2 in attempts
    for line in lines:
        assert line["replica"] == "r1" and line["quota_actual_tokens"] == 5
    assert three[0].state.dice.errors_injected == sum(attempts) - len(attempts)
    proxy.assert_idle()


async def test_a_seatless_request_is_retried_on_a_connection_failure(
    start_proxy: Start, three: list[SimServer]
) -> None:
    """GET /v1/models (proxied, no seat): a replica that refuses connections before its
    health probe notices is skipped by a retry, as connect_error is on every route."""
    proxy = await start_proxy(
        make_config([s.url for s in three[:2]], retry=QUICK_RETRY, health=NO_EJECTION)
    )
    await wait_for(lambda: all(r.serving for r in proxy.runtime.pool.replicas))
    await three[0].refuse_for(None)
    statuses = []
    for _ in range(10):
        resp = await proxy.client.get("/v1/models", headers=AUTH)
        await resp.read()
        statuses.append(resp.status)
    assert statuses == [200] * 10


@pytest.mark.redis
async def test_the_retry_budget_is_the_fleets_and_a_local_share_while_redis_is_down(
    start_proxy: Start, three: list[SimServer], redis_server: RedisServer
) -> None:
    """Two proxies on one Redis, a replica failing everything, a budget of 3 retries per
    10 s (floor 0.3/s, no ratio): 3 retries in all, whichever proxy spends them; the
    next request of either is answered 503 retry_budget_exhausted with a Retry-After.
    Redis down: each proxy retries from its own share (the floor over the 2 instances
    seen: 1 retry), then refuses again."""
    retry = {**QUICK_RETRY, "budget_ratio": 0.0, "min_retries_per_s": 0.3}
    state = {"backend": "redis", "redis_url": redis_server.url, "timeout_ms": 500}
    config = make_config([three[0].url], retry=retry, health=NO_EJECTION, state=state)
    proxies = [await start_proxy(config), await start_proxy(config)]
    for proxy in proxies:
        shared = proxy.runtime.state
        assert shared is not None
        client = shared.client
        await wait_for(lambda: client.instances == 2)  # noqa: B023 (awaited here)
    await three[0].set_faults(error_rate=1.0, error_status=503)

    async def reason(proxy: ProxyUnderTest) -> str:
        resp = await proxy.client.post(CHAT, json=chat(), headers=AUTH)
        await resp.read()
        assert resp.status == 503
        if resp.headers["X-Admission-Reason"] == "retry_budget_exhausted":
            assert 1 <= int(resp.headers["Retry-After"]) <= 60
        return resp.headers["X-Admission-Reason"]

    spent = [await reason(proxies[i % 2]) for i in range(3)]
    assert spent == ["upstream_status"] * 3  # each retried once, and failed again
    assert [await reason(p) for p in proxies] == ["retry_budget_exhausted"] * 2

    redis_server.stop()
    for proxy in proxies:
        assert await reason(proxy) == "upstream_status"  # its own share: one retry
        assert await reason(proxy) == "retry_budget_exhausted"
    for proxy in proxies:
        proxy.assert_idle()


@pytest.mark.parametrize("status", [400, 404, 408, 409, 422])
async def test_an_upstream_4xx_is_never_retried(
    start_proxy: Start, three: list[SimServer], status: int
) -> None:
    """Every retry class switched on: an upstream 4xx (other than 429) is the replica's
    own answer, passed through after one attempt."""
    log = io.StringIO()
    every = ["connect_error", "connect_timeout", "first_byte_timeout",
             "reset_before_first_byte", "http_429", "http_500", "http_502", "http_503",
             "http_504"]  # fmt: skip
    retry = {**QUICK_RETRY, "retry_on": every, "max_attempts": 3, "min_retries_per_s": 100}
    proxy = await start_proxy(
        make_config([s.url for s in three[:2]], retry=retry, health=NO_EJECTION), access_log=log
    )
    await wait_for(lambda: all(r.serving for r in proxy.runtime.pool.replicas))
    for sim in three[:2]:
        await sim.set_faults(error_rate=1.0, error_status=status)
    resp = await proxy.client.post(CHAT, json=chat(), headers=AUTH)
    await resp.read()
    assert resp.status == status
    assert resp.headers["X-Admission-Reason"] == "upstream_status"
    (line,) = [json.loads(line) for line in log.getvalue().splitlines()]
    assert line["attempts"] == 1
    assert sum(s.state.dice.errors_injected for s in three[:2]) == 1


async def test_a_retry_waiting_for_a_seat_ends_at_the_clients_timeout(
    start_proxy: Start, three: list[SimServer]
) -> None:
    """One replica with one seat: the first attempt fails 503, and during its backoff
    another request takes the seat and hangs. The retry waits for a seat no longer than
    the client's X-Request-Timeout-Ms: 504 total_timeout, its tenant place and every
    seat back once the other request leaves."""
    retry = {"base_backoff_ms": 300, "max_backoff_ms": 300, "jitter": "none"}
    proxy = await start_proxy(make_config([three[0].url], seats=1, retry=retry, health=NO_EJECTION))
    await wait_for(lambda: all(r.serving for r in proxy.runtime.pool.replicas))
    sim, runtime = three[0], proxy.runtime
    await sim.set_faults(error_rate=1.0, error_status=503)
    short = {**AUTH, "X-Request-Timeout-Ms": "1500"}
    retried = asyncio.ensure_future(proxy.client.post(CHAT, json=chat(), headers=short))
    await wait_for(lambda: sim.state.dice.errors_injected == 1)
    await sim.set_faults(error_rate=0.0, hang_before_first_byte_ms=-1)
    hanging = asyncio.ensure_future(proxy.client.post(CHAT, json=chat(), headers=AUTH))
    resp = await asyncio.wait_for(retried, timeout=30)
    assert resp.status == 504
    assert resp.headers["X-Admission-Reason"] == "total_timeout"
    hanging.cancel()
    await asyncio.gather(hanging, return_exceptions=True)
    await wait_for(lambda: runtime.pool.total_inflight() == 0 and not runtime.active)
    proxy.assert_idle()


async def test_a_replica_that_timed_out_keeps_the_seat_for_the_cancel_grace(
    start_proxy: Start, three: list[SimServer]
) -> None:
    """A stream whose first byte did not come within first_byte_ms is retried; the
    replica may still be working on the attempt it abandoned (engines notice a closed
    connection late), so that seat stays taken for cancel_grace_ms, as a cancelled
    request's does, while the retry takes another: the replica's seats never count
    less than the engine may run."""
    retry = {**QUICK_RETRY, "retry_on": ["first_byte_timeout"]}
    budgets = {"first_byte_ms": 300, "total_ms": 120_000, "queue_ms": 2000}
    config = make_config(
        [three[0].url], seats=2, retry=retry, budgets=budgets, health=NO_EJECTION,
        timeouts={"cancel_grace_ms": 2000},
    )  # fmt: skip
    proxy = await start_proxy(config)
    runtime, sim = proxy.runtime, three[0]
    await wait_for(lambda: all(r.serving for r in runtime.pool.replicas))
    await sim.set_faults(hang_before_first_byte_ms=-1)
    before = received(sim)
    stream = asyncio.ensure_future(proxy.client.post(CHAT, json=chat(stream=True), headers=AUTH))
    await wait_for(lambda: received(sim) - before == 2)  # the retry reached the replica
    assert runtime.pool.replicas[0].inflight == 2
    stream.cancel()
    await asyncio.gather(stream, return_exceptions=True)
    await wait_for(lambda: runtime.pool.total_inflight() == 0 and not runtime.active, 10.0)
    proxy.assert_idle()


async def test_a_retry_skips_draining_and_saturated_replicas(
    start_proxy: Start, three: list[SimServer]
) -> None:
    """r0 fails every request, r1 is draining: each retry goes to r2. Once r2's engine
    also says it is saturated, retries go back to r0 (its answer is passed through)
    and neither r1 nor r2 is sent anything."""
    retry = {**QUICK_RETRY, "min_retries_per_s": 100}
    config = make_config(
        [s.url for s in three], seats=8, retry=retry,
        health=NO_EJECTION, saturation={"max_waiting": 0, "stale_ms": 600_000},
    )  # fmt: skip
    proxy = await start_proxy(config)
    runtime = proxy.runtime
    await wait_for(lambda: all(r.serving for r in runtime.pool.replicas))
    await three[0].set_faults(error_rate=1.0, error_status=503)
    set_draining(runtime, "r1", True)
    counts = [received(s) for s in three]
    for _ in range(6):
        assert (await proxy.client.post(CHAT, json=chat(), headers=AUTH)).status == 200
    assert received(three[1]) == counts[1]
    assert received(three[2]) - counts[2] == 6
    health = runtime.health
    health._readings["r2"] = EngineReading(runtime.clock.now(), 5, None)
    health.refresh_saturation()
    assert runtime.pool.replicas[2].saturated
    counts = [received(s) for s in three]
    for _ in range(4):
        resp = await proxy.client.post(CHAT, json=chat(), headers=AUTH)
        assert resp.status == 503 and resp.headers["X-Admission-Reason"] == "upstream_status"
    assert [received(s) - c for s, c in zip(three, counts, strict=True)] == [8, 0, 0]
    proxy.assert_idle()


async def test_a_retry_the_budget_refuses_gives_the_token_charge_back(
    start_proxy: Start, three: list[SimServer]
) -> None:
    """No retry budget at all: a failed first attempt is answered 503
    retry_budget_exhausted with a Retry-After, the retry never reaches a replica, and
    the tenant's token charge is settled at 0 (its quota headers count nothing)."""
    tenants = {"a": {"api_keys": [KEY_A], "token_quota": {"per_day": 100_000}}}
    retry = {**QUICK_RETRY, "budget_ratio": 0.0, "min_retries_per_s": 0.0}
    proxy = await start_proxy(
        make_config([s.url for s in three[:2]], tenants=tenants, retry=retry, health=NO_EJECTION)
    )
    await wait_for(lambda: all(r.serving for r in proxy.runtime.pool.replicas))
    for sim in three[:2]:
        await sim.set_faults(error_rate=1.0, error_status=503)
    counts = [received(s) for s in three[:2]]
    resp = await proxy.client.post(CHAT, json=chat(), headers=AUTH)
    assert resp.status == 503
    assert resp.headers["X-Admission-Reason"] == "retry_budget_exhausted"
    assert 1 <= int(resp.headers["Retry-After"]) <= 60
    assert (await resp.json())["error"]["code"] == "retry_budget_exhausted"
    assert resp.headers["x-ratelimit-remaining-tokens"] == "100000"
    assert sum(received(s) - c for s, c in zip(three, counts, strict=False)) == 1
    proxy.assert_idle()


async def test_requests_without_a_seat_count_toward_the_retry_budget(
    start_proxy: Start, three: list[SimServer]
) -> None:
    """No floor, a ratio of 1: the budget is what was dispatched. GETs (no seat) count,
    so once some went through, those meeting a replica that refuses connections are
    retried on the other, within the budget their own traffic earns."""
    retry = {**QUICK_RETRY, "budget_ratio": 1.0, "min_retries_per_s": 0.0}
    proxy = await start_proxy(
        make_config([s.url for s in three[:2]], retry=retry, health=NO_EJECTION)
    )
    await wait_for(lambda: all(r.serving for r in proxy.runtime.pool.replicas))
    statuses = []
    for _ in range(4):
        resp = await proxy.client.get("/v1/models", headers=AUTH)
        await resp.read()
        statuses.append(resp.status)
    await three[0].refuse_for(None)
    for _ in range(8):
        resp = await proxy.client.get("/v1/models", headers=AUTH)
        await resp.read()
        statuses.append(resp.status)
    assert statuses == [200] * 12


async def test_a_non_inference_route_retries_no_upstream_status(
    start_proxy: Start, upstream_url: str, upstream_state: Upstream
) -> None:
    """A POST to a route that is not an inference route may have side effects: its
    upstream 503 is passed through after one attempt, http_503 in retry_on or not."""
    retry = {**QUICK_RETRY, "retry_on": ["connect_error", "http_503"], "max_attempts": 3}
    routes = ["/v1/chat/completions", "/status"]
    proxy = await start_proxy(make_config([upstream_url], retry=retry, routes=routes))
    resp = await proxy.client.post("/status/503", json={"x": 1}, headers=AUTH)
    assert resp.status == 503
    assert resp.headers["X-Admission-Reason"] == "upstream_status"
    assert len(upstream_state.seen) == 1
    proxy.assert_idle()


async def test_a_stream_broken_after_its_first_byte_is_never_retried(
    start_proxy: Start, three: list[SimServer]
) -> None:
    """Every retry class on: a stream whose connection is reset after its first tokens
    reached the client ends with an SSE error event, and the replica saw one attempt."""
    log = io.StringIO()
    every = ["connect_error", "connect_timeout", "first_byte_timeout",
             "reset_before_first_byte", "http_500", "http_502", "http_503"]  # fmt: skip
    retry = {**QUICK_RETRY, "retry_on": every, "max_attempts": 3, "min_retries_per_s": 100}
    proxy = await start_proxy(
        make_config([s.url for s in three[:2]], retry=retry, health=NO_EJECTION), access_log=log
    )
    await wait_for(lambda: all(r.serving for r in proxy.runtime.pool.replicas))
    for sim in three[:2]:
        await sim.set_faults(reset_mid_stream_after_tokens=2)
    counts = [received(s) for s in three[:2]]
    resp = await proxy.client.post(CHAT, json=chat(stream=True, max_tokens=50), headers=AUTH)
    assert resp.status == 200
    text = await resp.text()
    assert "admission_error" in text  # the SSE error event that ends it
    assert sum(received(s) - c for s, c in zip(three, counts, strict=False)) == 1
    (line,) = [json.loads(line) for line in log.getvalue().splitlines()]
    assert line["attempts"] == 1
    proxy.assert_idle()


async def test_a_retry_with_no_replica_left_to_take_it_ends_at_once(
    start_proxy: Start, upstream_url: str, upstream_state: Upstream
) -> None:
    """The only replica is drained while it still runs the attempt, which then times out
    (``first_byte_timeout``, retried here): no replica of the pool can take the retry, so
    the failure is answered at once (504 ``first_byte_timeout``), not after the request's
    whole total budget spent waiting for a seat (504 ``total_timeout``)."""
    retry = {**QUICK_RETRY, "retry_on": ["first_byte_timeout"], "min_retries_per_s": 100}
    config = make_config(
        [upstream_url],
        budgets={"first_byte_ms": 300, "queue_ms": 1000, "total_ms": 30_000},
        retry=retry, health=NO_EJECTION,
    )  # fmt: skip
    proxy = await start_proxy(config)
    runtime = proxy.runtime
    sent = asyncio.ensure_future(
        proxy.client.post(CHAT, json={"stream": True, "hang_ms": 5000}, headers=AUTH)
    )
    await wait_for(lambda: upstream_state.active == 1)  # the attempt runs on r0
    set_draining(runtime, "r0", True)
    resp = await asyncio.wait_for(sent, 20)  # bounded: before, it waited out total_ms
    assert resp.status == 504
    assert resp.headers["X-Admission-Reason"] == "first_byte_timeout"
    assert len(upstream_state.seen) == 1  # no second attempt anywhere
    await proxy.wait_idle()
