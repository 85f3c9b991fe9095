"""A small fake upstream with path-routed behaviours, for end-to-end tests.

Real sockets, real HTTP: the proxy under test cannot tell it from an engine.
Behaviour is chosen by the request path and the JSON body:

- ``/v1/chat/completions``: OpenAI answer; ``"stream": true`` gives SSE with a
  role-only first chunk, ``n`` content chunks ``gap_ms`` apart, usage, [DONE].
  ``"hang_ms"`` delays everything before the first byte; ``"tail_ms"`` delays
  the end of the stream after ``[DONE]``; ``"cut_after"`` drops
  the connection after that many content chunks; ``"pause_after"`` waits
  ``"pause_ms"`` before that content chunk; ``"pad_bytes"`` adds that many
  bytes to each content chunk's text (a big answer from few tokens); ``"stale_after": true``
  keeps the connection open after the stream but drops, unanswered, the next
  request that arrives on it (llama.cpp's server does this).
- ``/status/{code}``: answers that status with a JSON body.
- anything else: echoes method, path, headers and body length as JSON.

``Upstream.seen`` keeps every client request's headers (not the proxy's own
probes and warm-up); ``Upstream.active`` counts
handlers running now, ``Upstream.aborted`` those whose client went away.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Handler
from multidict import CIMultiDictProxy


@dataclass
class Upstream:
    seen: list[CIMultiDictProxy[str]] = field(default_factory=list)
    active: int = 0
    aborted: int = 0
    completed: int = 0
    #: Connections doomed by ``stale_after``, and requests dropped on them.
    doomed: set[object] = field(default_factory=set)
    stale_hits: int = 0


UPSTREAM: web.AppKey[Upstream] = web.AppKey("upstream", Upstream)


def _chunk(content: str | None, *, role: bool = False) -> bytes:
    delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {"content": content}
    event = {
        "id": "x",
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": delta}],
    }
    return b"data: " + json.dumps(event).encode() + b"\n\n"


async def chat(request: web.Request) -> web.StreamResponse:
    state = request.app[UPSTREAM]
    state.seen.append(request.headers)
    state.active += 1
    try:
        body = await request.json()
        hang_ms = body.get("hang_ms", 0)
        if hang_ms:
            await asyncio.sleep(hang_ms / 1000.0)
        n = int(body.get("max_tokens") or 3)
        if not body.get("stream"):
            answer = {
                "id": "x",
                "object": "chat.completion",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok " * n},
                             "finish_reason": "length"}],
                "usage": {"prompt_tokens": 5, "completion_tokens": n, "total_tokens": 5 + n},
            }  # fmt: skip
            state.completed += 1
            return web.json_response(answer, headers={"Server": ENGINE_SERVER})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b": keep-alive\n\n")
        await response.write(_chunk(None, role=True))
        gap = body.get("gap_ms", 0) / 1000.0
        cut_after = body.get("cut_after")
        pause_after = body.get("pause_after")
        pad = "." * int(body.get("pad_bytes", 0))
        for i in range(n):
            if cut_after is not None and i == cut_after:
                assert request.transport is not None
                request.transport.abort()
                return response
            if gap:
                await asyncio.sleep(gap)
            if pause_after is not None and i == pause_after:
                await asyncio.sleep(body.get("pause_ms", 0) / 1000.0)
            await response.write(_chunk(f"tok{i} {pad}"))
        usage = {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": n}}
        await response.write(b"data: " + json.dumps(usage).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        if body.get("tail_ms"):  # the HTTP terminator comes late (a slow last packet)
            await asyncio.sleep(body["tail_ms"] / 1000.0)
        await response.write_eof()
        if body.get("stale_after"):
            state.doomed.add(request.transport)
        state.completed += 1
        return response
    except (asyncio.CancelledError, ConnectionResetError):
        state.aborted += 1
        raise
    finally:
        state.active -= 1


async def status(request: web.Request) -> web.Response:
    request.app[UPSTREAM].seen.append(request.headers)
    code = int(request.match_info["code"])
    return web.json_response({"error": {"message": f"status {code}"}}, status=code)


#: The ``Server`` header of a non-streamed chat answer: an engine's own.
ENGINE_SERVER = "test-engine/1.0"
#: The proxy's own traffic (probes, warm-up) is not what the tests look for.
PROXY_OWN = frozenset({"/health", "/v1/models"})


async def echo(request: web.Request) -> web.Response:
    own = request.path in PROXY_OWN or request.headers.get("X-Request-Id") == "admission-warmup"
    if not own:
        request.app[UPSTREAM].seen.append(request.headers)
    body = await request.read()
    return web.json_response(
        {"method": request.method, "path": request.path_qs, "body_bytes": len(body)}
    )


@web.middleware
async def drop_doomed(request: web.Request, handler: Handler) -> web.StreamResponse:
    """A request on a connection doomed by ``stale_after`` gets no answer at all."""
    state = request.app[UPSTREAM]
    if request.transport is not None and request.transport in state.doomed:
        state.stale_hits += 1
        request.transport.abort()  # at once: nothing written after this leaves
        return web.Response()
    return await handler(request)


def build_upstream() -> web.Application:
    app = web.Application(middlewares=[drop_doomed])
    app[UPSTREAM] = Upstream()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_route("*", "/status/{code}", status)
    app.router.add_route("*", "/{tail:.*}", echo)
    return app
