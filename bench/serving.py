"""Run one aiohttp app on uvloop until SIGTERM or SIGINT (the bench servers' main).

The servers are children of ``bench.overhead``, which stops them with SIGTERM;
handling it lets the app's cleanup contexts run (client sessions close) instead
of the process dying mid-write. No access log: it would cost CPU the baseline
must not pay.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
from collections.abc import Callable

import uvloop
from aiohttp import web


async def serve_until_signal(app: web.Application, host: str, port: int) -> None:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port, reuse_address=True).start()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
        await stop.wait()
    finally:
        await runner.cleanup()


def run(app: web.Application, host: str, port: int) -> None:
    uvloop.run(serve_until_signal(app, host, port))


async def health(request: web.Request) -> web.Response:
    """``GET /health`` of every bench server: up is all it says."""
    return web.Response(text="ok")


def main(
    doc: str, build: Callable[[argparse.Namespace], web.Application],
    *, upstream: bool = False,
) -> None:  # fmt: skip
    """A bench server's command line: ``--host``, ``--port`` (and ``--upstream``), then run."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    if upstream:
        parser.add_argument(
            "--upstream", required=True, help="base URL, e.g. http://127.0.0.1:9001"
        )
    args = parser.parse_args()
    run(build(args), args.host, args.port)
