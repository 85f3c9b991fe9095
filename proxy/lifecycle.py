"""Running the proxy as a process: listen, serve, and shut down gracefully.

SIGTERM (DESIGN section 8): ``/readyz`` turns 503 at once; queued requests and
new arrivals are answered 503 ``shutting_down`` with ``Connection: close``
while the listener stays open so load balancers notice; in-flight requests
get up to ``server.shutdown_grace_ms``; then the upstream session and
telemetry are closed and the process exits. A second SIGTERM or SIGINT exits
at once.
"""

from __future__ import annotations

import asyncio
import signal

import structlog
from aiohttp import web

from proxy.app import build_app
from proxy.keys import RUNTIME
from proxy.runtime import Runtime
from proxy.settings import Config

log = structlog.get_logger(__name__)


def bound_port(site: web.TCPSite) -> int | None:
    """The port the OS gave the listener (``--port 0`` picks a free one)."""
    server = site._server
    sockets = getattr(server, "sockets", None)
    return int(sockets[0].getsockname()[1]) if sockets else None


def begin_shutdown(runtime: Runtime) -> None:
    """Stop admitting: readiness fails, the queue is answered, arrivals are refused."""
    if runtime.shutting_down:
        return
    runtime.shutting_down = True
    runtime.dispatcher.close()


async def serve(config: Config, host: str, port: int, config_path: str | None = None) -> int:
    app = build_app(config, config_path=config_path)
    runtime = app[RUNTIME]
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_address=True)
    await site.start()
    log.info(
        "listening",
        host=host,
        port=bound_port(site) or port,
        replicas=[r.name for r in config.replicas],
    )

    stop = asyncio.Event()
    signals = 0

    def on_signal(signum: int) -> None:
        nonlocal signals
        signals += 1
        if signals > 1 or (signum == signal.SIGINT and runtime.shutting_down):
            log.warning("second signal: exiting now")
            raise SystemExit(1)
        log.info("shutdown requested", signal=signal.Signals(signum).name)
        begin_shutdown(runtime)
        stop.set()

    reloads: set[asyncio.Task[object]] = set()

    def on_hangup() -> None:
        if runtime.reloader is None:
            return
        task: asyncio.Task[object] = asyncio.ensure_future(runtime.reloader.reload("sighup"))
        reloads.add(task)
        task.add_done_callback(reloads.discard)

    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)
    loop.add_signal_handler(signal.SIGHUP, on_hangup)
    try:
        await stop.wait()
        grace_s = runtime.rules.config.server.shutdown_grace_ms / 1000.0
        finished = await runtime.wait_idle(grace_s)
        log.info("drained" if finished else "grace period over", inflight=len(runtime.active))
    finally:
        await runner.cleanup()
    return 0
