"""Answers the listener gives before any handler runs are traced like every request.

``overloaded_connections`` (a connection over ``server.max_connections``), a head
that never completes (408 within ``header_ms``) and a head the parser refuses
(400) are counted and logged already; an operator following the access line's
``trace_id`` finds its ``proxy.request`` span too, from the request's arrival.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web

from proxy.app import build_app
from proxy.lifecycle import bound_port
from proxy.listener import Listener, ProxyRunner
from proxy.runtime import RUNTIME, Runtime
from proxy.sim import SimConfig, SimServer, start_sim
from tests.helpers import KEY_A, make_config, wait_for
from tests.telemetry_watch import Watch

HEAD = (
    f"POST /v1/chat/completions HTTP/1.1\r\nHost: proxy\r\nAuthorization: Bearer {KEY_A}\r\n"
    "traceparent: 00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01\r\n"
)


@pytest.fixture
async def sim() -> AsyncIterator[SimServer]:
    server = await start_sim(SimConfig(slots=4, decode_base_ms=1.0))
    try:
        yield server
    finally:
        await server.close()


@pytest.fixture
async def listening(sim: SimServer) -> AsyncIterator[tuple[Runtime, Watch, int, Listener]]:
    watch = Watch()
    config = make_config([sim.url], server={"header_ms": 300, "max_connections": 1})
    app = build_app(config, seed=1, **watch.kwargs())
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
        yield runtime, watch, port, runner.server
    finally:
        await runner.cleanup()


async def _exchange(port: int, data: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        async with asyncio.timeout(5):
            return await reader.readuntil(b"\r\n\r\n")
    finally:
        writer.close()


async def _lines(runtime: Runtime, watch: Watch, count: int) -> list[dict[str, Any]]:
    await wait_for(lambda: len(watch.log.getvalue().splitlines()) >= count and not runtime.active)
    return [json.loads(line) for line in watch.log.getvalue().splitlines()]


@pytest.mark.parametrize(
    ("data", "status", "reason"),
    [
        ((HEAD + "Content-Len").encode(), 408, "entrance_timeout"),
        (b"POST /v1/chat/completions HTTP/1.1\r\nHost: proxy\r\nBad Header\r\n\r\n", 400,
         "bad_request"),
    ],
)  # fmt: skip
async def test_listener_answers_are_traced(
    listening: tuple[Runtime, Watch, int, Listener], data: bytes, status: int, reason: str
) -> None:
    runtime, watch, port, _ = listening
    head = await _exchange(port, data)
    assert head.split()[1] == str(status).encode()
    (line,) = await _lines(runtime, watch, 1)
    assert (line["status"], line["reason"]) == (status, reason)
    (root,) = [s for s in watch.exporter.get_finished_spans() if s.name == "proxy.request"]
    assert format(root.context.trace_id, "032x") == line["trace_id"]
    assert dict(root.attributes or {})["admission.reason"] == reason
    assert root.start_time is not None and root.end_time is not None
    if status == 408:  # from the head's first byte, not from the answer
        assert (root.end_time - root.start_time) / 1e6 >= 300
        assert line["entrance_ms"] >= 300
        timing = next(h for h in head.split(b"\r\n") if h.lower().startswith(b"server-timing:"))
        assert float(timing.split(b"entrance;dur=")[1].split(b",")[0]) >= 300


async def test_a_connection_over_the_cap_is_traced(
    listening: tuple[Runtime, Watch, int, Listener],
) -> None:
    runtime, watch, port, listener = listening
    holder = await asyncio.open_connection("127.0.0.1", port)
    try:
        await wait_for(lambda: listener.open == 1)
        head = await _exchange(port, (HEAD + "Content-Length: 2\r\n\r\n{}").encode())
    finally:
        holder[1].close()
    assert head.split()[1] == b"503"
    (line,) = await _lines(runtime, watch, 1)
    assert line["reason"] == "overloaded_connections"
    (root,) = [s for s in watch.exporter.get_finished_spans() if s.name == "proxy.request"]
    assert format(root.context.trace_id, "032x") == line["trace_id"]
    assert line["trace_id"] == "0af7651916cd43dd8448eb211c80319c"  # the client's trace
