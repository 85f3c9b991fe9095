"""An upstream that answers at once: the engine stand-in for overhead benchmarks.

``POST /v1/chat/completions`` returns one small, fixed OpenAI-style completion
(with ``usage``), so everything a benchmark measures beyond this server is the
cost of what sits in front of it. ``/health``, ``/v1/models`` and
``POST /v1/completions`` (the proxy's warm-up request) answer too, so the
proxy's probes and warm-up find a healthy engine.

    python -m bench.fast_upstream --port 9001
"""

from __future__ import annotations

import json

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
MODELS = json.dumps({"object": "list", "data": [{"id": MODEL, "object": "model"}]}).encode()


async def chat(request: web.Request) -> web.Response:
    await request.read()  # a real engine reads the whole prompt before answering
    return web.Response(body=COMPLETION, content_type="application/json")


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
