"""Client connections that end every which way are all counted out of the listener.

``server.max_connections`` counts the connections open now; one counted and
never counted out would, over weeks, fill the cap and answer every client 503
``overloaded_connections``. Connections churn here through every way they end:
closed before a byte, reset mid-head, cut mid-body, answered and closed, reset
mid-stream, refused by the parser, over the cap, timed out mid-head; then the
listener counts none open, the proxy holds nothing, and no task or file
descriptor is left over. The listener (``ProxyRunner``) on a loopback port in
front of simulator replicas.
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from aiohttp import web

from proxy.app import build_app
from proxy.lifecycle import bound_port
from proxy.listener import Listener, ProxyRunner
from proxy.runtime import RUNTIME, Runtime
from proxy.sim import SimConfig, SimServer, start_sim
from tests.helpers import KEY_A, make_config, wait_for
from tests.test_bounded_clients import open_fds, stray_tasks

#: Connections of each kind.
EACH = 40
MAX_CONNECTIONS = 16
#: Bound on waiting for every connection to be counted out (2 loaded cores).
SETTLE_S = 10.0


def _request(body: dict[str, object], *, length: int | None = None) -> bytes:
    data = json.dumps(body).encode()
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: proxy\r\n"
        f"Authorization: Bearer {KEY_A}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data) if length is None else length}\r\n\r\n"
    )
    return head.encode() + data


CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
STREAM = {**CHAT, "stream": True, "max_tokens": 4000}


async def status(reader: asyncio.StreamReader) -> int:
    """The status of the answer's status line."""
    return int((await reader.readline()).split()[1])


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with an RST (SO_LINGER 0), as a client that crashed."""
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.close()


@pytest.fixture
async def sim() -> AsyncIterator[SimServer]:
    server = await start_sim(SimConfig(slots=64, decode_base_ms=1.0))
    try:
        yield server
    finally:
        await server.close()


@pytest.fixture
async def listening(sim: SimServer) -> AsyncIterator[tuple[Runtime, Listener, int]]:
    config = make_config(
        [sim.url],
        seats=64,
        server={"header_ms": 300, "keepalive_ms": 300, "max_connections": MAX_CONNECTIONS},
        timeouts={"cancel_grace_ms": 20},
    )
    app = build_app(config, seed=1)
    runner = ProxyRunner(app, config.server, handler_cancellation=True, access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = bound_port(site)
        assert port is not None
        runtime = app[RUNTIME]
        await wait_for(lambda: any(r.serving for r in runtime.pool.replicas))
        assert isinstance(runner.server, Listener)
        yield runtime, runner.server, port
    finally:
        await runner.cleanup()


Kind = Callable[[int], Awaitable[None]]


async def test_connections_ending_every_way_are_all_counted_out(
    listening: tuple[Runtime, Listener, int], sim: SimServer
) -> None:
    runtime, listener, port = listening
    before = set(asyncio.all_tasks())
    fds = open_fds()

    async def connect() -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.open_connection("127.0.0.1", port)

    async def nothing(_: int) -> None:
        writer = (await connect())[1]
        writer.close()

    async def reset_mid_head(_: int) -> None:
        writer = (await connect())[1]
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: pro")
        await writer.drain()
        _reset(writer)

    async def cut_mid_body(_: int) -> None:
        writer = (await connect())[1]
        writer.write(_request(CHAT, length=10_000))  # promises more than it sends
        await writer.drain()
        writer.close()

    async def answered(_: int) -> None:
        reader, writer = await connect()
        writer.write(_request(CHAT))
        await writer.drain()
        assert await status(reader) == 200
        writer.close()

    async def reset_mid_stream(_: int) -> None:
        reader, writer = await connect()
        writer.write(_request(STREAM))
        await writer.drain()
        assert await status(reader) == 200
        await reader.readuntil(b"data:")
        _reset(writer)

    async def refused_by_parser(_: int) -> None:
        reader, writer = await connect()
        writer.write(b"NOT HTTP AT ALL\r\n\r\n")
        await writer.drain()
        assert await status(reader) == 400
        writer.close()

    async def timed_out_mid_head(_: int) -> None:
        reader, writer = await connect()
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\n")
        await writer.drain()
        assert await status(reader) == 408
        writer.close()

    kinds: list[Kind] = [
        nothing, reset_mid_head, cut_mid_body, answered, reset_mid_stream, refused_by_parser,
        timed_out_mid_head,
    ]  # fmt: skip
    for kind in kinds:
        for start in range(0, EACH, 8):
            await asyncio.gather(*(kind(i) for i in range(start, min(EACH, start + 8))))
    # Over the cap: MAX_CONNECTIONS held open, then every further one is answered 503.
    held = [await connect() for _ in range(MAX_CONNECTIONS)]
    await wait_for(lambda: listener.open == MAX_CONNECTIONS)
    for _ in range(EACH):
        reader, writer = await connect()
        writer.write(_request(CHAT))
        await writer.drain()
        assert await status(reader) == 503
        writer.close()
    for _, writer in held:
        writer.close()

    await wait_for(
        lambda: (
            listener.open == 0
            and not runtime.active
            and runtime.pool.total_inflight() == 0
            and sim.state.in_flight == 0
            and not stray_tasks(before)
        ),
        timeout_s=SETTLE_S,
    )
    assert repr(listener) == f"<Listener 0 open, at most {MAX_CONNECTIONS}>"
    # What is left: the proxy's kept-alive upstream connections (both ends here).
    assert open_fds() <= fds + 2 * 64
    # And the listener still serves.
    await answered(0)
