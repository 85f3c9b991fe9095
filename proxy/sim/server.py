"""The simulated replica as an aiohttp application.

Owns the wiring: routes, the middleware, and the lifecycle. The engine (and
the metrics registry that reads it) is created, started and closed by one
`cleanup_ctx`. Shutdown runs in two steps because aiohttp waits for in-flight
handlers between them: `on_shutdown` aborts every sequence and wakes hanging
requests, so the wait is short; `cleanup_ctx` then stops the step loop.

It never opens sockets itself: `runner.start_sim` or pytest's `aiohttp_server`
serves it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from aiohttp import web

from proxy.sim import control
from proxy.sim.config import SimConfig
from proxy.sim.engine import SimEngine
from proxy.sim.handlers import busy_connections_middleware, generate, slow_accept_middleware
from proxy.sim.metrics import build_registry
from proxy.sim.protocol import DIALECTS
from proxy.sim.state import ENGINE_KEY, REGISTRY_KEY, STATE_KEY, SimState

__all__ = ["build_sim_app"]


def build_sim_app(config: SimConfig) -> web.Application:
    app = web.Application(middlewares=[busy_connections_middleware, slow_accept_middleware])
    app[STATE_KEY] = SimState(config)
    app.cleanup_ctx.append(_engine_ctx)
    app.on_shutdown.append(_stop_serving)
    for path in DIALECTS:
        app.router.add_post(path, generate)
    app.router.add_get("/v1/models", control.models)
    app.router.add_get("/health", control.health)
    app.router.add_get("/metrics", control.metrics)
    app.router.add_get("/sim/faults", control.get_faults)
    app.router.add_post("/sim/faults", control.post_faults)
    app.router.add_delete("/sim/faults", control.delete_faults)
    app.router.add_get("/sim/stats", control.get_stats)
    return app


async def _engine_ctx(app: web.Application) -> AsyncIterator[None]:
    engine = SimEngine(app[STATE_KEY].config)
    await engine.start()
    app[ENGINE_KEY] = engine
    app[REGISTRY_KEY] = build_registry(engine)
    try:
        yield
    finally:
        await engine.close()


async def _stop_serving(app: web.Application) -> None:
    await app[STATE_KEY].close()
    app[ENGINE_KEY].abort_all()
