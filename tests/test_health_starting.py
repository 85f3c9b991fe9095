"""Replicas that have not been healthy yet: ``starting``, not ejected.

An engine loading a model may take minutes. Until a replica has been healthy
once (since start-up, or since a reload added it) it is probed every
``health.interval_ms`` with no ejection backoff, takes no traffic and counts
no ejections; ``/readyz`` lists it. After its first success the normal
ejection rules apply.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from proxy.app import build_runtime
from proxy.clock import FakeClock
from proxy.reload import apply_config
from proxy.replicas import ReplicaState
from proxy.sim import SimConfig, SimServer, start_sim
from tests.conftest import ProxyUnderTest
from tests.helpers import KEY_A, make_config, wait_for

Start = Callable[..., Awaitable[ProxyUnderTest]]
ServerFactory = Callable[..., Awaitable[TestServer]]
CHAT = "/v1/chat/completions"
AUTH = {"Authorization": f"Bearer {KEY_A}"}
#: Long enough that one ejection would outlast every test: a replica pushed
#: into backoff would never be probed again within the test's waits.
LONG_EJECTION = {"interval_ms": 50, "eject_after_failures": 1, "eject_ms": 60_000}


@dataclass
class Engine:
    """A fake engine that answers 503 "Loading model" (as llama-server does) until loaded."""

    loaded: bool = False
    probes: int = 0
    served: int = 0


ENGINE = web.AppKey("engine", Engine)


async def _health(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    engine.probes += 1
    if not engine.loaded:
        return web.json_response({"error": {"message": "Loading model"}}, status=503)
    return web.json_response({"status": "ok"})


async def _work(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    await request.read()
    if not engine.loaded:
        return web.json_response({"error": {"message": "Loading model"}}, status=503)
    engine.served += 1
    return web.json_response({"choices": [{"text": "ok"}]})


@pytest.fixture
async def loading(aiohttp_server: ServerFactory) -> tuple[Engine, str]:
    app = web.Application()
    app[ENGINE] = Engine()
    app.router.add_get("/health", _health)
    app.router.add_route("*", "/{tail:.*}", _work)
    server = await aiohttp_server(app)
    return app[ENGINE], str(server.make_url("")).rstrip("/")


async def test_loading_engine_is_starting_then_serves_then_follows_ejection_rules(
    start_proxy: Start, loading: tuple[Engine, str]
) -> None:
    """An engine still loading: probed again and again with no ejection, /readyz lists it
    as starting, requests get no_healthy_replica. Once loaded it warms and serves;
    from then on a failed probe ejects it as usual."""
    engine, url = loading
    proxy = await start_proxy(make_config([url], health=LONG_EJECTION), ready=False)
    r0 = proxy.runtime.pool.replicas[0]
    await wait_for(lambda: engine.probes >= 5, timeout_s=10)
    assert r0.starting and not r0.ejected and r0.ejections == 0 and not r0.serving

    ready = await proxy.client.get("/readyz")
    assert ready.status == 503
    assert (await ready.json())["starting"] == ["r0"]
    state = (await (await proxy.client.get("/admin/state")).json())["replicas"]["r0"]
    assert state["starting"] is True and state["probe_error"] == "GET /health answered 503"
    refused = await proxy.client.post(CHAT, json={}, headers=AUTH)
    assert refused.status == 503
    assert refused.headers["X-Admission-Reason"] == "no_healthy_replica"
    assert engine.served == 0

    engine.loaded = True
    await wait_for(lambda: r0.serving, timeout_s=10)
    assert engine.served >= 1  # the warm-up ran first
    assert (await proxy.client.post(CHAT, json={}, headers=AUTH)).status == 200
    ready = await proxy.client.get("/readyz")
    assert ready.status == 200
    assert (await ready.json())["starting"] == []

    engine.loaded = False  # now healthy once: a failed probe ejects it
    await wait_for(lambda: r0.ejected, timeout_s=10)
    assert r0.ejections == 1 and not r0.starting
    proxy.assert_idle()


@pytest.fixture
async def refusing_sim() -> AsyncIterator[SimServer]:
    server = await start_sim(SimConfig(slots=4, decode_base_ms=1.0))
    await server.refuse_for(None)
    try:
        yield server
    finally:
        await server.close()


async def test_replica_refusing_connections_comes_up_on_its_port(
    start_proxy: Start, refusing_sim: SimServer
) -> None:
    """A replica whose port refuses connections at start-up stays starting (no ejection);
    once its server listens on that port it is warmed and serves within a few probes."""
    proxy = await start_proxy(make_config([refusing_sim.url], health=LONG_EJECTION), ready=False)
    r0 = proxy.runtime.pool.replicas[0]
    # The start-up warm-up failed, then an interval probe did ("warm-up: ..." before).
    await wait_for(lambda: (r0.probe_error or "").startswith("replica r0: cannot connect"))
    assert r0.starting and not r0.ejected and r0.ejections == 0

    await refusing_sim.accept()
    await wait_for(lambda: r0.serving, timeout_s=10)
    assert r0.ejections == 0 and r0.probe_error is None
    chat = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
    assert (await proxy.client.post(CHAT, json=chat, headers=AUTH)).status == 200
    assert refusing_sim.engine.stats().completed >= 2  # warm-up, then the request
    proxy.assert_idle()


async def test_starting_replica_is_held_without_backoff_on_a_fake_clock() -> None:
    """Fake clock, no sockets: failures of a never-healthy replica only keep it starting
    (no ejection, no growing duration); Retry-After is one probe interval. After one
    success, the next failure ejects it for eject_ms."""
    clock = FakeClock()
    config = make_config(["http://127.0.0.1:9", "http://127.0.0.1:10"], health=LONG_EJECTION)
    runtime = build_runtime(config, clock=clock, access_log=False)
    health, pool = runtime.health, runtime.pool
    r0, r1 = pool.replicas
    health._came_up(r1)
    for _ in range(6):
        health._count_failure(r0, passive=False)
        clock.advance(1.0)
    assert r0.starting and not r0.ejected and r0.ejections == 0
    health._count_failure(r1, passive=False)
    assert r1.ejected and r1.ejected_until == clock.now() + 60.0
    assert health.earliest_return_s() == 0.05  # r0 may answer its next probe
    assert not pool.any_usable()
    r0.move_to(ReplicaState.WARMING)  # its first warm-up: requests wait for it
    assert pool.any_usable()
    r0.move_to(ReplicaState.STARTING)

    health._came_up(r0)
    assert not r0.starting and r0.serving
    health._count_failure(r0, passive=False)
    assert r0.ejected and r0.ejections == 1 and r0.ejected_until == clock.now() + 60.0


async def test_replica_added_by_reload_is_starting_not_ejected() -> None:
    """A reload that adds a replica: it is starting (no ejection counted) until it is
    probed and warmed."""
    config = make_config(["http://127.0.0.1:9"])
    runtime = build_runtime(config, clock=FakeClock(), access_log=False)
    apply_config(runtime, make_config(["http://127.0.0.1:9", "http://127.0.0.1:10"]))
    r1 = runtime.pool.get("r1")
    assert r1 is not None
    assert r1.starting and not r1.ejected and r1.ejections == 0 and not r1.serving


async def test_retry_after_of_a_pool_counts_only_its_own_replicas() -> None:
    """Fake clock: r0 ejected until t=60, r1 (another model's pool) until t=110. At t=50
    a request for r1's pool is told 60 s (r1's return), not r0's 10 s: r0 coming back
    serves none of that pool's requests. The fleet-wide answer stays the earliest."""
    clock = FakeClock()
    config = make_config(["http://127.0.0.1:9", "http://127.0.0.1:10"], health=LONG_EJECTION)
    runtime = build_runtime(config, clock=clock, access_log=False)
    health = runtime.health
    r0, r1 = runtime.pool.replicas
    health._came_up(r0)
    health._came_up(r1)
    health._count_failure(r0, passive=False)
    clock.advance(50.0)
    health._count_failure(r1, passive=False)
    assert health.earliest_return_s() == 10.0
    assert health.earliest_return_s(frozenset({r1.name})) == 60.0
    assert health.earliest_return_s(frozenset({r0.name})) == 10.0
