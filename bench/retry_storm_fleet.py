"""The retry-storm benchmark's servers: simulated replicas as child processes, the proxy in-process.

Each replica is its own ``admission-proxy sim`` process (bound to port 0 on
loopback; the URL is read back from the line it logs on stderr), so that on a
small machine the "GPUs" are scheduled apart from the proxy and the load
generator. The proxy runs in the benchmark's own event loop (``build_app``
behind an ``AppRunner``), which gives the benchmark its ``Runtime`` for the
readiness check; its access log goes to an in-memory stream that the benchmark
reads per request (attempts, outcome). Nothing here measures anything.

Every child is started inside ``Sims`` and stopped (SIGTERM, then SIGKILL)
when it closes, also on Ctrl-C; a child's own session keeps the terminal's
SIGINT for the benchmark to handle.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp
from aiohttp import web

from bench.processes import (
    POLL_S,
    START_TIMEOUT_S,
    Sims,
    wait_ready,
)
from proxy.app import build_app
from proxy.lifecycle import bound_port
from proxy.runtime import RUNTIME, Runtime
from proxy.settings import Config

#: The proxy's listen backlog: open-loop arrivals open connections in bursts, and
#: a dropped SYN costs its request a 1 s retransmit (docs/BENCHMARKS.md, overhead).
LISTEN_BACKLOG = 2048


async def set_faults(session: aiohttp.ClientSession, url: str, **faults: object) -> None:
    async with session.post(url + "/sim/faults", json=faults) as response:
        if response.status != 200:
            raise RuntimeError(f"POST {url}/sim/faults: {response.status} {await response.text()}")


async def wait_healthy(session: aiohttp.ClientSession, sims: Sims) -> None:
    """Until every sim answers ``GET /health`` with 200."""
    for sim in sims.sims:
        await wait_ready(session, sim, START_TIMEOUT_S, "/health")


@dataclass(slots=True)
class RunningProxy:
    url: str
    runtime: Runtime
    access_log: io.StringIO


@contextlib.asynccontextmanager
async def running_proxy(config: Config, seed: int) -> AsyncIterator[RunningProxy]:
    """The proxy in this process, on a loopback port, once every replica is serving."""
    access_log = io.StringIO()
    app = build_app(config, seed=seed, access_log=access_log)
    runtime = app[RUNTIME]
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0, backlog=LISTEN_BACKLOG)
        await site.start()
        port = bound_port(site)
        if port is None:
            raise RuntimeError("the proxy's listener has no port")
        deadline = time.monotonic() + START_TIMEOUT_S
        while not all(replica.serving for replica in runtime.pool.replicas):
            if time.monotonic() > deadline:
                raise RuntimeError(f"replicas not serving after {START_TIMEOUT_S:.0f} s: "
                                   f"{runtime.pool!r}")  # fmt: skip
            await asyncio.sleep(POLL_S)
        yield RunningProxy(f"http://127.0.0.1:{port}", runtime, access_log)
    finally:
        await runner.cleanup()
