"""A fault switch for a real engine process: ``{"pause": true}`` stops it with SIGSTOP.

Owns ``pause_app`` and ``python -m proxy.loadtest.pause``. A phase's
``fault`` is switched through ``GET``/``POST /sim/faults``, which only the
simulator answers; real engines (llama-server, vLLM) have no fault switch.
This tiny controller speaks the same shape for one engine process on the
same machine, so a phases run can hang a real replica for one phase: the
process is frozen (SIGSTOP: its sockets stay open, nothing is answered),
which is the fault the proxy's first-byte timeout, retries and health
ejection exist for, and is let go (SIGCONT) when the phase ends. The
phases runner restores a fault in a ``finally``, and the controller lets the
process go when it stops, so an engine is never left frozen.

    python -m proxy.loadtest.pause --pid PID --port PORT [--host 127.0.0.1]

A phase then names the controller as its fault target:
``fault: {target: "http://127.0.0.1:PORT", pause: true}``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
from collections.abc import Sequence
from pathlib import Path

from aiohttp import web

__all__ = ["PAUSE_FIELD", "is_stopped", "pause_app", "set_paused"]

PAUSE_FIELD = "pause"
#: Longest the controller waits to see the process change state after a signal.
SETTLE_TIMEOUT_S = 5.0
SETTLE_POLL_S = 0.01


def is_stopped(pid: int) -> bool:
    """Whether the kernel reports ``pid`` stopped (state ``T`` in ``/proc/PID/stat``)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    # The command name, in parentheses, may hold spaces: the state follows the last ')'.
    return stat.rsplit(")", 1)[1].split()[0] in ("T", "t")


async def set_paused(pid: int, paused: bool) -> None:
    """Signal ``pid`` and return once the kernel shows the new state (bounded wait).

    Waiting makes the switch exact: when ``POST /sim/faults`` answers, the
    engine is already frozen (or already running again).
    """
    os.kill(pid, signal.SIGSTOP if paused else signal.SIGCONT)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + SETTLE_TIMEOUT_S
    while is_stopped(pid) != paused:
        if loop.time() > deadline:
            raise TimeoutError(f"process {pid} did not become {'stopped' if paused else 'running'}")
        await asyncio.sleep(SETTLE_POLL_S)


def pause_app(pid: int) -> web.Application:
    """The controller for one process; on shutdown the process is always let go."""

    async def get_faults(request: web.Request) -> web.Response:
        return web.json_response({PAUSE_FIELD: is_stopped(pid)})

    async def post_faults(request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except ValueError:
            return web.json_response({"error": "body must be JSON"}, status=400)
        if not isinstance(body, dict):
            return web.json_response({"error": "body must be a JSON object"}, status=400)
        unknown = sorted(set(body) - {PAUSE_FIELD})
        if unknown:
            return web.json_response(
                {"error": f"unknown fault field(s): {', '.join(unknown)}; known: ['pause']"},
                status=400,
            )
        value = body.get(PAUSE_FIELD)
        if value is None:  # a restore of a field that was never read: nothing to change
            return web.json_response({PAUSE_FIELD: is_stopped(pid)})
        if not isinstance(value, bool):
            return web.json_response({"error": "pause must be true or false"}, status=400)
        await set_paused(pid, value)
        return web.json_response({PAUSE_FIELD: value})

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"pid": pid})

    async def let_go(app: web.Application) -> None:
        if is_stopped(pid):
            os.kill(pid, signal.SIGCONT)

    app = web.Application()
    app.router.add_get("/sim/faults", get_faults)
    app.router.add_post("/sim/faults", post_faults)
    app.router.add_get("/health", health)
    app.on_cleanup.append(let_go)
    return app


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pid", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    args = parser.parse_args(argv)
    is_stopped(args.pid)  # fail now, not at the first switch, if there is no such process
    web.run_app(pause_app(args.pid), host=args.host, port=args.port, print=None)


if __name__ == "__main__":
    main()
