"""The relay's timeouts while it waits on a slow client, end to end on loopback.

A real proxy before the fake upstream, and a raw client that reads the answer
only when the test says: its socket has a small receive buffer and the
proxy's socket to it a small send buffer, so the proxy's writes to it wait
after a few hundred KiB (kernel autotuning would otherwise buffer megabytes).

The idle timeout counts only the replica's silences: a replica that streams
on while the proxy waits on the client is never declared idle. The total
deadline counts everything: it ends an answer the client takes too slowly
(or stops taking), the connection is cut (an error event could not reach a
client that is not reading), the replica's connection is closed and the seat
goes back.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp.base_protocol import BaseProtocol
from yarl import URL

from tests.conftest import ProxyUnderTest
from tests.helpers import KEY_A, make_config, samples_by_label, sse_tokens, wait_for
from tests.upstreams import Upstream

Start = Callable[..., Awaitable[ProxyUnderTest]]
CHAT = "/v1/chat/completions"
#: The client's receive buffer and the proxy's send buffer to it (the kernel doubles both).
CLIENT_RCVBUF = 4096
PROXY_SNDBUF = 8192
#: Bytes the client takes per read.
STEP = 4096


class SlowClient:
    """A raw HTTP/1.1 client whose reads the test paces."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.raw = bytearray()
        #: The proxy cut the connection (a reset rather than an orderly end).
        self.reset = False
        #: The proxy's end of the connection.
        self.proxy_side: asyncio.WriteTransport | None = None

    @classmethod
    async def connect(cls, proxy: ProxyUnderTest, body: dict[str, Any]) -> SlowClient:
        """Connect, shrink the proxy's send buffer to this connection, send one chat request."""
        url = URL(proxy.url)
        assert url.host is not None and url.port is not None
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, CLIENT_RCVBUF)
        sock.setblocking(False)
        try:
            await asyncio.get_running_loop().sock_connect(sock, (url.host, url.port))
        except OSError:
            sock.close()
            raise
        reader, writer = await asyncio.open_connection(sock=sock, limit=STEP)
        client = cls(reader, writer)
        # The proxy's end of this connection, found by its peer (this socket).
        assert proxy.client.server.runner is not None
        server = proxy.client.server.runner.server
        assert server is not None
        mine = sock.getsockname()

        def proxy_side() -> asyncio.BaseTransport | None:
            for handler in server.connections:
                transport = handler.transport
                if transport is not None and transport.get_extra_info("peername") == mine:
                    return transport
            return None

        await wait_for(lambda: proxy_side() is not None)
        transport = proxy_side()
        assert isinstance(transport, asyncio.WriteTransport)
        transport.get_extra_info("socket").setsockopt(
            socket.SOL_SOCKET, socket.SO_SNDBUF, PROXY_SNDBUF
        )
        client.proxy_side = transport
        payload = json.dumps(body).encode()
        writer.write(
            f"POST {CHAT} HTTP/1.1\r\nHost: proxy\r\nAuthorization: Bearer {KEY_A}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n"
            "Connection: close\r\n\r\n".encode()
            + payload
        )
        await writer.drain()
        return client

    async def read(self) -> bool:
        """Take up to ``STEP`` bytes; False once the connection has ended."""
        try:
            data = await asyncio.wait_for(self.reader.read(STEP), timeout=10)
        except ConnectionResetError:
            self.reset = True
            return False
        self.raw += data
        return bool(data)

    async def read_bytes(self, count: int) -> None:
        """Take about ``count`` bytes, as fast as they come."""
        for _ in range(count // STEP):
            assert await self.read(), "the answer ended early"

    async def read_to_end(self, max_reads: int, pause_s: float = 0.0) -> None:
        """Read until the connection ends, pausing ``pause_s`` after each read."""
        for _ in range(max_reads):
            if not await self.read():
                return
            if pause_s:
                await asyncio.sleep(pause_s)
        raise AssertionError(f"the answer did not end within {max_reads} reads")

    def answer(self) -> tuple[int, bytes, bool]:
        """Status, the de-chunked body so far, and whether the chunked body was complete."""
        head, _, rest = bytes(self.raw).partition(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        body = bytearray()
        while True:
            size_line, found, rest = rest.partition(b"\r\n")
            if not found:
                return status, bytes(body), False
            size = int(size_line.split(b";")[0], 16)
            if size == 0:
                return status, bytes(body), True
            body += rest[:size]
            if len(rest) < size + 2:
                return status, bytes(body), False
            rest = rest[size + 2 :]

    def close(self) -> None:
        self.writer.close()


def _waits_on_client(client: SlowClient) -> bool:
    """The proxy's writes to the client wait: its socket's send buffer is full and the
    transport has paused the protocol's writing (aiohttp's writes then block in drain).

    Paused, not "more than the high-water mark buffered": writing pauses when the
    buffer passes the high-water mark and resumes only below the low-water mark, so
    after the client took some bytes the proxy can wait with the buffer between the
    two. Waiting for it to pass the high-water mark again then waited for ever (the
    proxy writes nothing until the client reads, the client read nothing until then)."""
    transport = client.proxy_side
    assert transport is not None
    protocol = transport.get_protocol()
    assert isinstance(protocol, BaseProtocol)
    return protocol.writing_paused


def _events(body: bytes) -> list[dict[str, Any]]:
    """The complete ``data:`` events of an SSE body, [DONE] left out."""
    events = []
    for block in body.split(b"\n\n")[:-1]:
        if block.startswith(b"data: ") and block != b"data: [DONE]":
            events.append(json.loads(block[6:]))
    return events


async def _counted(proxy: ProxyUnderTest) -> tuple[dict[str, float], dict[str, float]]:
    """The proxy's requests by reason and timeouts by layer."""
    text = await (await proxy.client.get("/metrics")).text()
    return (
        samples_by_label(text, "admission_requests_total", "reason"),
        samples_by_label(text, "admission_timeouts_total", "layer"),
    )


async def test_replica_streaming_while_the_proxy_waits_on_the_client_is_not_idle(
    start_proxy: Start, upstream_url: str
) -> None:
    """A replica streaming for at least 3 s (600 tokens 5 ms apart); three times the client
    stops reading until the proxy's writes to it wait, and stays away for 3x idle_ms: every
    token arrives, no error event, the request is completed and the seat is back."""
    idle_s = 0.25
    proxy = await start_proxy(make_config([upstream_url], timeouts={"idle_ms": idle_s * 1000}))
    pad = 2000
    body = {"stream": True, "max_tokens": 600, "gap_ms": 5, "pad_bytes": pad}
    client = await SlowClient.connect(proxy, body)
    try:
        for _ in range(3):
            await wait_for(lambda: _waits_on_client(client), timeout_s=20)
            await asyncio.sleep(3 * idle_s)  # the slow client: the proxy waits on it
            # Enough for the proxy's buffer to drop below its low-water mark and refill.
            await client.read_bytes(128 * 1024)
        await client.read_to_end(max_reads=2000)
    finally:
        client.close()
    status, answer, complete = client.answer()
    assert status == 200 and complete and not client.reset
    events = _events(answer)
    assert sse_tokens(events) == [f"tok{i} {'.' * pad}" for i in range(600)]
    assert not any("error" in e for e in events)
    await wait_for(lambda: not proxy.runtime.active)
    reasons, layers = await _counted(proxy)
    assert reasons.get("none") == 1.0 and "idle" not in layers
    proxy.assert_idle()


async def _total_deadline_case(
    start_proxy: Start, upstream_url: str, upstream_state: Upstream, *, pause_s: float | None
) -> None:
    """A replica that would stream for at least 5 s (1000 tokens 5 ms apart), total_ms 2 s,
    idle_ms far longer; the client reads every ``pause_s`` (None: not at all until the proxy
    has ended the request). The total deadline ends it while the proxy waits on the client."""
    config = make_config(
        [upstream_url],
        budgets={"queue_ms": 1000, "first_byte_ms": 1000, "total_ms": 2000},
        timeouts={"idle_ms": 60_000},
    )
    proxy = await start_proxy(config)
    body = {"stream": True, "max_tokens": 1000, "gap_ms": 5, "pad_bytes": 4000}
    client = await SlowClient.connect(proxy, body)
    try:
        await wait_for(lambda: _waits_on_client(client), timeout_s=20)
        if pause_s is None:
            await wait_for(lambda: not proxy.runtime.active, timeout_s=20)
        await client.read_to_end(max_reads=5000, pause_s=pause_s or 0.0)
    finally:
        client.close()
    await wait_for(lambda: not proxy.runtime.active)
    status, answer, complete = client.answer()
    assert status == 200 and not complete
    assert b"data: [DONE]" not in answer
    reasons, layers = await _counted(proxy)
    assert reasons.get("total_timeout") == 1.0 and layers.get("total") == 1.0
    assert "none" not in reasons and "idle" not in layers
    # The replica saw its connection closed mid-answer: nothing runs upstream any more.
    await wait_for(lambda: upstream_state.active == 0)
    assert upstream_state.aborted == 1 and upstream_state.completed == 0
    await proxy.wait_idle()


async def test_total_deadline_ends_an_answer_the_client_stopped_reading(
    start_proxy: Start, upstream_url: str, upstream_state: Upstream
) -> None:
    """The client takes nothing after the proxy's writes to it wait: the total deadline
    still ends the request (timed out, total_timeout), the connection is cut."""
    await _total_deadline_case(start_proxy, upstream_url, upstream_state, pause_s=None)


async def test_total_deadline_ends_an_answer_the_client_reads_slowly(
    start_proxy: Start, upstream_url: str, upstream_state: Upstream
) -> None:
    """The client takes 4 KiB every 10 ms, slower than the replica streams, so the proxy's
    reads of the replica never wait: the total deadline still ends the request."""
    await _total_deadline_case(start_proxy, upstream_url, upstream_state, pause_s=0.01)


async def test_an_error_event_the_client_does_not_take_is_cut_after_the_idle_time(
    start_proxy: Start, upstream_url: str, upstream_state: Upstream
) -> None:
    """The client stops reading; the replica sends about 50 KB (more than the sockets
    between them hold, less than aiohttp writes before it waits on the client) and then
    stays silent. The proxy's read times out (idle_timeout) and its error event cannot
    reach the client, whose data is still waiting in the proxy's buffer: after idle_ms
    more the connection is cut, the request ends, the replica's connection is closed
    and the seat is back (before, the event waited on the client forever)."""
    idle_s = 0.3
    config = make_config(
        [upstream_url],
        budgets={"queue_ms": 1000, "first_byte_ms": 1000, "total_ms": 60_000},
        timeouts={"idle_ms": idle_s * 1000},
    )
    proxy = await start_proxy(config)
    body = {"stream": True, "max_tokens": 40, "pad_bytes": 2000, "pause_after": 25,
            "pause_ms": 30_000}  # fmt: skip
    client = await SlowClient.connect(proxy, body)
    try:
        transport = client.proxy_side
        assert transport is not None
        # aiohttp waits on a paused transport only at write_eof (or past 64 KiB written):
        # a low high-water mark pauses it as soon as the client's sockets are full.
        transport.set_write_buffer_limits(high=1024)
        await wait_for(lambda: _waits_on_client(client), timeout_s=20)
        await wait_for(lambda: not proxy.runtime.active, timeout_s=20)
        await client.read_to_end(max_reads=1000)
    finally:
        client.close()
    status, answer, complete = client.answer()
    assert status == 200 and not complete
    assert b'"error"' not in answer and b"data: [DONE]" not in answer
    reasons, layers = await _counted(proxy)
    assert reasons.get("idle_timeout") == 1.0 and layers.get("idle") == 1.0
    await wait_for(lambda: upstream_state.active == 0, timeout_s=40)
    assert upstream_state.aborted == 1 and upstream_state.completed == 0
    await proxy.wait_idle()
