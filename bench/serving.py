"""Run one aiohttp app on uvloop until SIGTERM or SIGINT (the bench servers' main).

The servers are children of ``bench.overhead``, which stops them with SIGTERM;
handling it lets the app's cleanup contexts run (client sessions close) instead
of the process dying mid-write. No access log: it would cost CPU the baseline
must not pay.
"""

from __future__ import annotations

import asyncio
import signal

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
