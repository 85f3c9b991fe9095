"""Running the proxy as a process: listen, serve, and shut down gracefully.

SIGTERM (docs/REFERENCE.md): ``/readyz`` turns 503 at once; queued requests and
new arrivals are answered 503 ``shutting_down`` with ``Connection: close``
while the listener stays open so load balancers notice; in-flight requests
get up to ``server.shutdown_grace_ms``; streams still open then are cut
(their handlers cancelled, ``CLOSE_TIMEOUT_S`` each to unwind); then the
upstream session and telemetry are closed and the process exits. A second
SIGTERM or SIGINT exits at once.

The process's garbage collector is tuned once the app is up (``tune_gc``):
the request path makes no reference cycles, yet at CPython's default
thresholds a busy proxy ran a young-generation collection every few dozen
requests (live in-flight objects alone cross 700) and full collections
over the whole start-up heap, for nothing collected (docs/BENCHMARKS.md,
overhead, says what that cost).
"""

from __future__ import annotations

import asyncio
import gc
import os
import signal

import structlog
from aiohttp import web

from proxy.app import build_app
from proxy.listener import ProxyRunner
from proxy.reload import RELOADER
from proxy.runtime import RUNTIME
from proxy.settings import Config
from proxy.workers import WORKER_GROUP_ENV

log = structlog.get_logger(__name__)


def bound_port(site: web.TCPSite) -> int | None:
    """The port the OS gave the listener (``--port 0`` picks a free one)."""
    server = site._server
    sockets = getattr(server, "sockets", None)
    return int(sockets[0].getsockname()[1]) if sockets else None


#: After the grace period, how long the server waits for a handler still
#: running, and again for it to unwind once cancelled. aiohttp's own default
#: (60 s) would keep a process whose client holds a stream open for a minute
#: past the grace; the grace itself is waited for in ``serve``.
CLOSE_TIMEOUT_S = 0.25

#: Young-generation threshold (container objects allocated net of those freed).
#: An in-flight request holds a few dozen, so CPython's 700 is crossed by
#: about twenty concurrent requests; this many covers a thousand or more.
GC_GEN0_THRESHOLD = 50_000


def tune_gc() -> None:
    """Freeze the start-up heap out of collections and raise the young threshold.

    Call once the app is set up: what exists then (config, app, sessions,
    imported modules) lives as long as the process, so full collections
    need not traverse it again. Cycles are still collected, only later.
    """
    gc.freeze()
    gen0, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(max(gen0, GC_GEN0_THRESHOLD), gen1, gen2)


async def serve(
    config: Config,
    host: str,
    port: int,
    config_path: str | None = None,
    *,
    reuse_port: bool = False,
) -> int:
    """Serve until SIGTERM; ``reuse_port``: one of ``serve --workers N`` (``workers.py``)."""
    group = os.environ.get(WORKER_GROUP_ENV) if reuse_port else None
    app = build_app(config, config_path=config_path, worker_group=group)
    runtime = app[RUNTIME]
    # The listener answers parser errors itself and bounds connections (listener.py).
    runner = ProxyRunner(
        app, config.server, handler_cancellation=True, access_log=None,
        shutdown_timeout=CLOSE_TIMEOUT_S,
    )  # fmt: skip
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_address=True, reuse_port=reuse_port or None)
    await site.start()
    tune_gc()

    stop = asyncio.Event()
    signals = 0

    def on_signal(signum: int) -> None:
        nonlocal signals
        signals += 1
        if signals > 1 or (signum == signal.SIGINT and runtime.shutting_down):
            log.warning("second signal: exiting now")
            raise SystemExit(1)
        log.info("shutdown requested", signal=signal.Signals(signum).name)
        runtime.begin_shutdown()
        stop.set()

    reloads: set[asyncio.Task[object]] = set()

    def on_hangup() -> None:
        reloader = app[RELOADER]
        if reloader is None:
            return
        task: asyncio.Task[object] = asyncio.ensure_future(reloader.reload("sighup"))
        reloads.add(task)
        task.add_done_callback(reloads.discard)

    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)
    loop.add_signal_handler(signal.SIGHUP, on_hangup)
    # Logged once the signals are handled: whoever waits for this line may signal at once.
    log.info(
        "listening",
        host=host,
        port=bound_port(site) or port,
        pid=os.getpid(),
        replicas=[r.name for r in config.replicas],
    )
    try:
        await stop.wait()
        grace_s = runtime.rules.config.server.shutdown_grace_ms / 1000.0
        finished = await runtime.wait_idle(grace_s)
        runtime.end_grace(finished)
        log.info("drained" if finished else "grace period over", inflight=len(runtime.active))
    finally:
        await runner.cleanup()
    return 0
