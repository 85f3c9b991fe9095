"""Inference routes of the simulated replica, and the slow-accept middleware.

Owns the path of one generation request: read and parse the body, apply the
request-level faults (injected error, hang), submit to the engine, then either
collect the whole answer or stream it. The sequence is aborted in `finally`,
so a client that leaves, a cancelled handler or a reset fault all free the
engine's slot and KV at once (`abort` is a no-op for a finished sequence).

aiohttp does not cancel a handler when its client disconnects, so a request
that is not writing (waiting in the engine's queue, or non-streaming) is
watched by the engine itself through the `client_gone` probe; a hang is
watched here by polling the same probe.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Mapping

from aiohttp import web
from aiohttp.typedefs import Handler

from proxy.sim.engine import EngineClosed, EngineFull, PromptTooLong, SimEngine
from proxy.sim.faults import FOREVER, Faults
from proxy.sim.protocol import (
    DIALECTS,
    BadRequest,
    Dialect,
    GenerationRequest,
    Renderer,
    Usage,
    error_body,
)
from proxy.sim.sequence import Sequence, SequenceAborted
from proxy.sim.state import ENGINE_KEY, STATE_KEY, SimState

__all__ = [
    "DISCONNECT_POLL_S",
    "busy_connections_middleware",
    "error_response",
    "generate",
    "slow_accept_middleware",
]

DISCONNECT_POLL_S = 0.02
"""How often a hanging request checks whether its client is still there."""

SSE_HEADERS: Mapping[str, str] = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
}


def error_response(
    status: int,
    message: str,
    error_type: str,
    *,
    headers: Mapping[str, str] | None = None,
) -> web.Response:
    return web.json_response(
        error_body(message, error_type, status), status=status, headers=headers
    )


def client_gone(request: web.BaseRequest) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


async def wait_unless_gone(
    request: web.BaseRequest, seconds: float | None, closing: asyncio.Event
) -> bool:
    """Sleep `seconds` (None: forever); False as soon as the client left or the sim closes."""
    loop = asyncio.get_running_loop()
    deadline = None if seconds is None else loop.time() + seconds
    while not client_gone(request) and not closing.is_set():
        step = DISCONNECT_POLL_S
        if deadline is not None:
            remaining = deadline - loop.time()
            if remaining <= 0:
                return True
            step = min(step, remaining)
        await asyncio.sleep(step)
    return False


@web.middleware
async def busy_connections_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Record which connections are serving a request, so a refusal closes only idle ones."""
    busy = request.app[STATE_KEY].busy_connections
    protocol = request.protocol
    busy.add(protocol)
    try:
        return await handler(request)
    finally:
        busy.discard(protocol)


@web.middleware
async def slow_accept_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Delay every route but `/sim/*` before the body is read (`slow_accept_ms`)."""
    state = request.app[STATE_KEY]
    delay_ms = state.faults.slow_accept_ms
    if (
        delay_ms > 0
        and not request.path.startswith("/sim/")
        and not await wait_unless_gone(request, delay_ms / 1000.0, state.closing)
    ):
        return error_response(503, "client left during slow accept", "server_error")
    return await handler(request)


async def generate(request: web.Request) -> web.StreamResponse:
    """Handler of every generation route; the path picks the wire format."""
    state = request.app[STATE_KEY]
    state.requests_total += 1
    state.in_flight += 1
    try:
        return await _generate(request, DIALECTS[request.path], state, request.app[ENGINE_KEY])
    except BadRequest as exc:
        return error_response(400, str(exc), "invalid_request_error")
    finally:
        state.in_flight -= 1


async def _generate(
    request: web.Request, dialect: Dialect, state: SimState, engine: SimEngine
) -> web.StreamResponse:
    received_at = time.monotonic()
    # The faults in force when the request arrived (counted in ``in_flight``), not
    # when its body has been read: a change made meanwhile applies to later ones.
    faults = state.faults
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from exc
    gen = dialect.parse(body, state.config.default_max_tokens)
    if state.dice.roll_error(faults):
        return _injected_error(faults)
    hang_ms = faults.hang_before_first_byte_ms
    if hang_ms:
        seconds = None if hang_ms == FOREVER else hang_ms / 1000.0
        if not await wait_unless_gone(request, seconds, state.closing):
            return error_response(503, "request abandoned while hanging", "server_error")
    try:
        seq = engine.submit(
            gen.prompt_tokens, gen.max_tokens, client_gone=lambda: client_gone(request)
        )
    except (EngineFull, EngineClosed) as exc:
        return error_response(503, str(exc), "server_error")
    except PromptTooLong as exc:
        return error_response(400, str(exc), "invalid_request_error")
    renderer = dialect.renderer(gen, seq.seq_id, state.config.model_name)
    try:
        await seq.admitted()
        if gen.stream:
            return await _stream(request, seq, gen, renderer, faults, state)
        return await _complete(seq, gen, renderer, received_at)
    except SequenceAborted:
        return error_response(503, "request aborted by the engine", "server_error")
    finally:
        engine.abort(seq)


def _injected_error(faults: Faults) -> web.Response:
    retry_after = faults.retry_after_header
    return error_response(
        faults.error_status,
        f"injected fault: status {faults.error_status}",
        "sim_injected_error",
        headers=None if retry_after is None else {"Retry-After": retry_after},
    )


async def _complete(
    seq: Sequence, gen: GenerationRequest, renderer: Renderer, received_at: float
) -> web.Response:
    token_ids: list[int] = []
    while chunk := await seq.next_tokens():
        token_ids.extend(chunk)
    usage = Usage(gen.prompt_tokens, len(token_ids))
    inference_ms = seq.inference_s * 1000.0
    headers = {
        "x-queue-time": _ms(seq.queue_s * 1000.0),
        "x-inference-time": _ms(inference_ms),
        "x-total-time": _ms((time.monotonic() - received_at) * 1000.0),
        "x-time-per-token": _ms(inference_ms / max(1, len(token_ids))),
        "x-prompt-tokens": str(gen.prompt_tokens),
        "x-generated-tokens": str(len(token_ids)),
    }
    return web.json_response(renderer.full_body(token_ids, usage), headers=headers)


async def _stream(
    request: web.Request,
    seq: Sequence,
    gen: GenerationRequest,
    renderer: Renderer,
    faults: Faults,
    state: SimState,
) -> web.StreamResponse:
    """Send headers now that the queue time is known, then one event per token."""
    response = web.StreamResponse(
        headers={
            **SSE_HEADERS,
            "x-queue-time": _ms(seq.queue_s * 1000.0),
            "x-prompt-tokens": str(gen.prompt_tokens),
        }
    )
    reset_after = faults.reset_mid_stream_after_tokens
    sent = 0
    try:
        await response.prepare(request)
        for event in renderer.opening_events():
            await response.write(event)
        if reset_after == 0:
            return _reset(request, response, state)
        while token_ids := await seq.next_tokens():
            for token_id in token_ids:
                await response.write(renderer.token_event(token_id))
                sent += 1
                if sent == reset_after:
                    return _reset(request, response, state)
        for event in renderer.closing_events(Usage(gen.prompt_tokens, sent)):
            await response.write(event)
    except ConnectionError:
        pass  # the client left mid-stream: the caller's `finally` aborts the sequence
    except SequenceAborted:
        pass  # engine shut down: end the stream without [DONE]
    return response


def _reset(
    request: web.Request, response: web.StreamResponse, state: SimState
) -> web.StreamResponse:
    """Abort the TCP connection (RST): the client sees a broken stream, not a clean end."""
    state.resets_injected += 1
    transport = request.transport
    if transport is not None:
        transport.abort()
    return response


def _ms(value: float) -> str:
    """Whole milliseconds, as TGI writes its timing headers."""
    return str(round(value))
