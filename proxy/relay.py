"""The response relay: from the commit point to the last byte.

The client's status and headers are held until the first upstream body byte
(``upstream.attempt`` returns at that point); from here on the answer belongs
to the client. Bytes are forwarded as they arrive, never buffered whole; SSE
streams are watched (``sse.SseMeter``) for the first token and token counts.

After the commit point a failure can no longer become an error response: an
SSE stream gets one ``data: {"error": ...}`` event and ends, any other body is
cut (the connection is dropped so the client cannot mistake it for complete).
That outcome is recorded but never raised, so no caller can turn it into a
second response (starlette's guard, made structural).
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy

from proxy.clock import Clock
from proxy.deadline import Deadline
from proxy.errors import IdleTimeout, ProxyError, TotalTimeout, UpstreamProtocolError
from proxy.record import RequestRecord
from proxy.sse import SseMeter, usage_from_body
from proxy.upstream import Committed

#: Headers that describe one connection, not the message (RFC 9110 section 7.6.1).
HOP_BY_HOP = frozenset(
    h.lower()
    for h in (
        "Connection", "Keep-Alive", "Proxy-Authenticate", "Proxy-Authorization", "TE",
        "Trailer", "Transfer-Encoding", "Upgrade", "Proxy-Connection",
    )
)  # fmt: skip
#: Non-streaming bodies up to this size are also kept to read their ``usage``.
USAGE_SCAN_LIMIT = 256 * 1024


def end_to_end_headers(
    headers: CIMultiDictProxy[str] | CIMultiDict[str], drop: frozenset[str] = HOP_BY_HOP
) -> CIMultiDict[str]:
    """Copy without hop-by-hop headers, those the Connection header names, and ``drop``."""
    connection = headers.get("Connection")
    if connection is not None:
        drop = drop | {token.strip().lower() for token in connection.split(",")}
    return CIMultiDict([(k, v) for k, v in headers.items() if k.lower() not in drop])


def _engine_ms(headers: CIMultiDictProxy[str], name: str) -> float | None:
    value = headers.get(name)
    if value is None:
        return None
    try:
        return float(value)
    except ValueError:
        return None


def _engine_int(headers: CIMultiDictProxy[str], name: str) -> int | None:
    value = headers.get(name)
    return int(value) if value is not None and value.isdigit() else None


async def relay(
    request: web.Request,
    committed: Committed,
    record: RequestRecord,
    deadline: Deadline,
    clock: Clock,
    *,
    idle_s: float,
    extra_headers: dict[str, str],
) -> web.StreamResponse:
    """Stream the committed upstream answer to the client.

    Never raises ``ProxyError``: a failure after the commit point is recorded
    on ``record`` and ends the answer; a client that left is recorded as
    cancelled.
    """
    upstream = committed.response
    headers = end_to_end_headers(upstream.headers)
    headers.update(extra_headers)
    record.engine_queue_ms = _engine_ms(upstream.headers, "x-queue-time")
    record.engine_inference_ms = _engine_ms(upstream.headers, "x-inference-time")
    record.input_tokens = _engine_int(upstream.headers, "x-prompt-tokens")
    record.output_tokens = _engine_int(upstream.headers, "x-generated-tokens")
    is_sse = upstream.content_type == "text/event-stream"
    if not is_sse and upstream.content.is_eof():
        return _whole(committed, headers, record)
    meter = SseMeter() if is_sse else None
    kept = bytearray() if not is_sse else None

    response = web.StreamResponse(status=upstream.status, reason=upstream.reason, headers=headers)
    chunk = committed.first_chunk
    try:
        await response.prepare(request)
        while chunk:
            now = clock.now()
            if meter is not None:
                meter.feed(chunk, now)
            elif kept is not None and len(kept) + len(chunk) <= USAGE_SCAN_LIMIT:
                kept += chunk
            await response.write(chunk)
            chunk = await _next_chunk(upstream, deadline, clock, idle_s)
        await response.write_eof()
    except ConnectionResetError:  # aiohttp's ClientConnectionResetError included
        record.cancel()  # the client left mid-answer; its handler may not be cancelled
    except ProxyError as err:
        record.fail(err)
        await _end_broken(request, response, err, is_sse)
    finally:
        committed.close()
        if meter is not None:
            record.first_token_at = meter.first_token_at
            record.input_tokens = meter.input_tokens or record.input_tokens
            record.output_tokens = meter.output_tokens or meter.content_events or None
        elif kept:
            prompt, completion = usage_from_body(bytes(kept))
            record.input_tokens = prompt or record.input_tokens
            record.output_tokens = completion or record.output_tokens
    return response


def _whole(committed: Committed, headers: CIMultiDict[str], record: RequestRecord) -> web.Response:
    """The whole answer is already here (a small non-streaming body): one plain response.

    Cheaper than prepare/write/write_eof, and aiohttp sends it in one write.
    """
    upstream = committed.response
    body = committed.first_chunk + upstream.content.read_nowait()
    committed.close()
    headers.popall("Content-Length", None)
    if len(body) <= USAGE_SCAN_LIMIT:
        prompt, completion = usage_from_body(body)
        record.input_tokens = prompt or record.input_tokens
        record.output_tokens = completion or record.output_tokens
    return web.Response(status=upstream.status, reason=upstream.reason, body=body, headers=headers)


async def _next_chunk(
    upstream: aiohttp.ClientResponse, deadline: Deadline, clock: Clock, idle_s: float
) -> bytes:
    content = upstream.content
    if content.is_eof():  # the rest of a small answer is already here
        return content.read_nowait()
    remaining = deadline.remaining(clock.now())
    try:
        async with asyncio.timeout(min(idle_s, remaining)):
            return await content.readany()
    except aiohttp.ClientError as exc:  # first: some of aiohttp's are TimeoutErrors too
        raise UpstreamProtocolError(f"upstream answer broke off: {type(exc).__name__}") from exc
    except TimeoutError as exc:
        if remaining <= idle_s:
            raise TotalTimeout("the request's total budget ran out mid-answer") from exc
        raise IdleTimeout(f"no upstream bytes for {idle_s * 1000:.0f} ms") from exc


async def _end_broken(
    request: web.Request, response: web.StreamResponse, err: ProxyError, is_sse: bool
) -> None:
    """After the commit point: one SSE error event, or a cut connection."""
    if is_sse:
        event = {"error": {"message": err.message, "type": "admission_error", "code": err.reason}}
        try:
            await response.write(b"data: " + json.dumps(event).encode() + b"\n\n")
            await response.write_eof()
        except ConnectionResetError:
            pass
        return
    if request.transport is not None:
        request.transport.abort()
