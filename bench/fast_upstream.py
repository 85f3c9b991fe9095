"""An upstream that answers at once: the engine stand-in for overhead benchmarks.

``POST /v1/chat/completions`` returns one small, fixed OpenAI-style completion
(with ``usage``), so everything a benchmark measures beyond this server is the
cost of what sits in front of it. A request with ``"stream": true`` gets an SSE
stream instead: a role delta, ``max_tokens`` one-token content deltas, each
written on its own ``TOKEN_INTERVAL_S`` after the last (so that what sits in
front reads one token per chunk, as from an engine), a final event with
``usage``, then ``[DONE]`` (``bench.stream_overhead``). ``/health``, ``/v1/models`` and
``POST /v1/completions`` (the proxy's warm-up request) answer too, so the
proxy's probes and warm-up find a healthy engine.

    python -m bench.fast_upstream --port 9001
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from aiohttp import web

from bench import serving
from bench.serving import health

MODEL = "bench-model"
COMPLETION = json.dumps(
    {
        "id": "chatcmpl-bench",
        "object": "chat.completion",
        "created": 0,
        "model": MODEL,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "ok"},
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 8, "completion_tokens": 1, "total_tokens": 9},
    }
).encode()
#: Between two streamed tokens: an engine's pace, not a benchmark's (tokens
#: written back to back would reach the front coalesced into fewer chunks).
TOKEN_INTERVAL_S = 0.002
STREAMED_TOKENS = 16
MODELS = json.dumps({"object": "list", "data": [{"id": MODEL, "object": "model"}]}).encode()


async def chat(request: web.Request) -> web.StreamResponse:
    body = await request.read()  # a real engine reads the whole prompt before answering
    if b'"stream"' in body:  # only then decoded: the non-streaming path stays as cheap
        doc = json.loads(body)
        if doc.get("stream") is True:
            return await stream(request, int(doc.get("max_tokens") or STREAMED_TOKENS))
    return web.Response(body=COMPLETION, content_type="application/json")


def _event(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> bytes:
    chunk = {
        "id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": 0, "model": MODEL,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}], **extra,
    }  # fmt: skip
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


ROLE_EVENT = _event({"role": "assistant", "content": ""})
TOKEN_EVENT = _event({"content": "ok"})


async def stream(request: web.Request, tokens: int) -> web.StreamResponse:
    """``tokens`` content events, one per write, ``TOKEN_INTERVAL_S`` apart."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    await response.write(ROLE_EVENT)
    for _ in range(tokens):
        await asyncio.sleep(TOKEN_INTERVAL_S)
        await response.write(TOKEN_EVENT)
    usage = {"prompt_tokens": 8, "completion_tokens": tokens, "total_tokens": 8 + tokens}
    await response.write(_event({}, "length", usage=usage) + b"data: [DONE]\n\n")
    await response.write_eof()
    return response


async def models(request: web.Request) -> web.Response:
    return web.Response(body=MODELS, content_type="application/json")


def build_app() -> web.Application:
    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/v1/completions", chat)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    return app


def main() -> None:
    serving.main(__doc__, lambda _: build_app())


if __name__ == "__main__":
    main()
