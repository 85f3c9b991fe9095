"""The response relay: from the commit point to the last byte.

The client's status and headers are held until the first upstream body byte
(``upstream.attempt`` returns at that point); from here on the answer belongs
to the client. Bytes are forwarded as they arrive, never buffered whole; SSE
streams are watched (``sse.SseMeter``) for the first token and token counts.

After the commit point a failure can no longer become an error response: an
SSE stream gets one ``data: {"error": ...}`` event and ends, any other body is
cut (the connection is dropped so the client cannot mistake it for complete).
An answer the client takes too slowly to have it by the total deadline is
cut too, SSE or not: the event would wait on the same client.
That outcome is recorded but never raised, so no caller can turn it into a
second response (starlette's guard, made structural). What the exchange
needs to know (how the answer ended, whether the replica finished, the
tokens it used) it reads from its ``Relayed``, never from the telemetry
record.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy

from proxy.admitted import Deadline
from proxy.batch_usage import BatchUsage, is_batch
from proxy.clock import Clock
from proxy.errors import ProxyError, TotalTimeout
from proxy.record import RequestRecord
from proxy.sse import SseMeter, usage_from_body
from proxy.sse_frames import SseFramer
from proxy.sse_usage import UsageStripper
from proxy.upstream import AnswerReader, Committed

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
#: Of a longer one, its first ``USAGE_SCAN_LIMIT`` bytes and its last this many are
#: read: OpenAI and vLLM put ``usage`` at the end, after ``logprobs``, ``n`` choices
#: or a batch of embeddings that pass the limit (a quota was charged nearly nothing).
USAGE_TAIL = 16 * 1024

Ending = Literal["relaying", "completed", "cancelled", "broken"]


@dataclass(slots=True)
class Relayed:
    """How the relay went, for the exchange that owns it.

    Filled in as the answer passes, so an exchange whose task is cancelled
    mid-answer still reads how far it got: ``ending`` is "completed" (the
    client got the whole answer), "cancelled" (the client left first) or
    "broken" (the answer failed after the commit point).
    """

    ending: Ending = "relaying"
    #: The status of the replica's answer being relayed (0: none yet).
    status: int = 0
    #: The replica's answer was read to its end: its seat needs no cancel grace.
    upstream_done: bool = False
    input_tokens: int | None = None
    output_tokens: int | None = None
    #: What broke the answer after the commit point ("broken"): the replica's
    #: health hears of it (``Exchange``), as it hears of a failed attempt.
    failure: ProxyError | None = None


def end_to_end_headers(
    headers: CIMultiDictProxy[str] | CIMultiDict[str], drop: frozenset[str] = HOP_BY_HOP
) -> CIMultiDict[str]:
    """Copy without hop-by-hop headers, those the Connection header names, and ``drop``.

    ``drop`` holds lower-case names. A copy, then a case-insensitive delete
    of each dropped name present: cheaper than a filtered rebuild on every
    request for the usual handful of headers.
    """
    connection = headers.get("Connection")
    if connection is not None:
        drop = drop | {token.strip().lower() for token in connection.split(",")}
    kept = CIMultiDict(headers)
    for name in drop:
        if name in kept:
            del kept[name]
    return kept


def _engine_headers(headers: CIMultiDictProxy[str], record: RequestRecord) -> None:
    """The engine's TGI-style timing (ms) and token headers, where it sends them."""
    queue, inference = headers.get("x-queue-time"), headers.get("x-inference-time")
    prompt, generated = headers.get("x-prompt-tokens"), headers.get("x-generated-tokens")
    record.engine_queue_ms = _float(queue) if queue is not None else None
    record.engine_inference_ms = _float(inference) if inference is not None else None
    record.input_tokens = int(prompt) if prompt is not None and prompt.isdigit() else None
    record.output_tokens = int(generated) if generated is not None and generated.isdigit() else None


def _usage(head: bytes, tail: bytes) -> tuple[int | None, int | None]:
    """A non-streaming answer's token counts: from its last bytes when it was longer
    than its kept head (``usage`` ends the document), else from the head."""
    if tail:
        prompt, completion = usage_from_body(tail)
        if prompt is not None or completion is not None:
            return prompt, completion
    return usage_from_body(head)


def _float(value: str) -> float | None:
    try:
        return float(value)
    except ValueError:
        return None


def relay_whole(
    committed: Committed, record: RequestRecord, extra_headers: dict[str, str], relayed: Relayed
) -> web.Response | None:
    """The whole answer is already here (a small non-streaming body): one plain response.

    Cheaper than prepare/write/write_eof, and aiohttp sends it in one write;
    nothing is awaited, so nothing can fail after the commit point here.
    None when the answer is a stream or still arriving: ``relay`` takes it.
    """
    upstream = committed.response
    content = upstream.content
    if not content.is_eof() or upstream.content_type == "text/event-stream":
        return None
    upstream_headers = upstream.headers
    _engine_headers(upstream_headers, record)
    headers = end_to_end_headers(upstream_headers)
    headers.update(extra_headers)
    headers.popall("Content-Length", None)
    body = committed.first_chunk + content.read_nowait()
    committed.close()
    relayed.upstream_done = True
    if len(body) <= USAGE_SCAN_LIMIT or is_batch(body):  # nearly always: no copy
        prompt, completion = usage_from_body(body, record.samples_per_prompt)
    else:
        prompt, completion = _usage(body[:USAGE_SCAN_LIMIT], body[-USAGE_TAIL:])
    record.input_tokens = prompt or record.input_tokens
    record.output_tokens = completion or record.output_tokens
    relayed.ending = "completed"
    relayed.input_tokens, relayed.output_tokens = record.input_tokens, record.output_tokens
    return web.Response(status=upstream.status, reason=upstream.reason, body=body, headers=headers)


async def relay(
    request: web.Request,
    committed: Committed,
    record: RequestRecord,
    deadline: Deadline,
    clock: Clock,
    *,
    idle_s: float,
    extra_headers: dict[str, str],
    relayed: Relayed,
    on_upstream_done: Callable[[], None] | None = None,
    strip_usage: bool = False,
) -> web.StreamResponse:
    """Stream the committed upstream answer to the client (``relay_whole`` first, when whole).

    Never raises ``ProxyError``: a failure after the commit point is recorded
    on ``record`` and ``relayed`` and ends the answer; a client that left is
    recorded as cancelled. ``on_upstream_done`` runs once, when the replica's answer
    has ended (at an SSE ``[DONE]``, or its last byte), before the last bytes are
    flushed to the client: the replica's seat is free from then on, however
    slowly the client reads. ``strip_usage``: the
    proxy asked for this stream's usage (``usage_request.py``); what that added
    is removed from what the client gets (``sse_usage.UsageStripper``).
    """
    upstream = committed.response
    _engine_headers(upstream.headers, record)
    headers = end_to_end_headers(upstream.headers)
    headers.update(extra_headers)
    is_sse = upstream.content_type == "text/event-stream"
    samples = record.samples_per_prompt
    meter = SseMeter(samples) if is_sse else None
    kept = bytearray() if not is_sse else None
    tail = bytearray()  # a non-SSE answer's last bytes, once it outgrew ``kept``
    # A batch answer's counts are spread over all of it: summed as it passes.
    batch = BatchUsage(samples) if kept is not None and is_batch(committed.first_chunk) else None
    strip = UsageStripper() if strip_usage and is_sse else None
    if strip is not None:
        headers.popall("Content-Length", None)  # the client gets fewer bytes
    # Whole events only (the stripper passes whole events too): an error event
    # after a failure is then never glued to half an event.
    framer = SseFramer() if is_sse and strip is None else None

    response = web.StreamResponse(status=upstream.status, reason=upstream.reason, headers=headers)
    reader = AnswerReader(upstream, deadline, clock, idle_s)
    chunk = committed.first_chunk
    try:
        await response.prepare(request)
        while chunk:
            if meter is not None:
                # The clock matters only until the first token (TTFT).
                meter.feed(chunk, clock.now() if meter.first_token_at is None else 0.0)
                if meter.done and not relayed.upstream_done:
                    # The engine finished at ``[DONE]``: its seat is free from now
                    # on, whenever (or whether) the HTTP terminator follows.
                    relayed.upstream_done = True
                    if on_upstream_done is not None:
                        on_upstream_done()
            elif batch is not None:
                batch.feed(chunk)
            elif kept is not None:
                if not tail and len(kept) + len(chunk) <= USAGE_SCAN_LIMIT:
                    kept += chunk  # the head, contiguous
                else:
                    tail += chunk
                    del tail[:-USAGE_TAIL]
            if framer is not None:
                if out := framer.feed(chunk):
                    await response.write(out)
            elif strip is None:
                await response.write(chunk)
            elif out := strip.feed(chunk):
                await response.write(out)
            try:
                chunk = await reader.read()
            except ProxyError:
                if not relayed.upstream_done:
                    raise
                # The engine said ``[DONE]``: the answer is whole, and a connection
                # lost (or stalled) before the HTTP terminator lost none of it.
                chunk = b""
        if not relayed.upstream_done:
            relayed.upstream_done = True
            if on_upstream_done is not None:
                on_upstream_done()
        rest = strip.flush() if strip is not None else framer.flush() if framer else b""
        if rest:
            await response.write(rest)
        await response.write_eof()
        relayed.ending = "completed"
    except ConnectionResetError:  # aiohttp's ClientConnectionResetError included
        # The client left mid-answer (its handler may not be cancelled yet).
        # One that closed after the last byte of the answer (clients often stop
        # reading at ``data: [DONE]``, before the chunked terminator) got it all.
        if relayed.upstream_done:
            relayed.ending = "completed"
        else:
            relayed.ending = "cancelled"
            record.cancel()
    except ProxyError as err:
        relayed.ending, relayed.failure = "broken", err
        record.broke(err)
        reader.close()  # the error event has its own bound (_end_broken)
        await _end_broken(request, response, err, is_sse, grace_s=idle_s)
    except asyncio.CancelledError:
        if not reader.ran_out():
            raise
        # The total deadline came while the client was still taking the answer:
        # an error event would wait on the same client, so the connection is cut.
        relayed.ending = "broken"
        relayed.failure = TotalTimeout("the request's total budget ran out while the client read")
        record.broke(relayed.failure)
        if request.transport is not None:
            request.transport.abort()
    finally:
        reader.close()
        committed.close()
        if meter is not None:
            meter.finish()
            record.first_token_at = meter.first_token_at
            record.input_tokens = meter.input_tokens or record.input_tokens
            record.output_tokens = meter.output_tokens or meter.content_events or None
        elif batch is not None or kept or tail:
            prompt, completion = (
                batch.finish() if batch is not None else _usage(bytes(kept or b""), bytes(tail))
            )
            record.input_tokens = prompt or record.input_tokens
            record.output_tokens = completion or record.output_tokens
        relayed.input_tokens, relayed.output_tokens = record.input_tokens, record.output_tokens
    return response


async def _end_broken(
    request: web.Request,
    response: web.StreamResponse,
    err: ProxyError,
    is_sse: bool,
    *,
    grace_s: float,
) -> None:
    """After the commit point: one SSE error event, or a cut connection.

    A client that is not taking what it was sent would hold the event (and
    the request, its seat and replica connection with it) forever: it gets
    ``grace_s`` (the idle timeout, what the replica gets to send a byte) to
    take the event, after which the connection is cut.
    """
    if is_sse:
        event = {"error": {"message": err.message, "type": "admission_error", "code": err.reason}}
        try:
            async with asyncio.timeout(grace_s):
                await response.write(b"data: " + json.dumps(event).encode() + b"\n\n")
                await response.write_eof()
            return
        except ConnectionResetError:
            return
        except TimeoutError:
            pass  # the client is not reading: cut below
    if request.transport is not None:
        request.transport.abort()
