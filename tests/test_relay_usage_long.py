"""A long non-streaming answer's usage, as the token quota settles it.

The engine here answers a non-streaming chat in two writes, the second held
until the test opens a gate, so the proxy's reads of the answer are known
exactly (no timing): what the proxy had read when it relayed the first part
is all the first write, nothing of the second.
"""

from __future__ import annotations

import asyncio
import io
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from proxy.clock import FakeClock
from proxy.relay import USAGE_SCAN_LIMIT
from tests.conftest import ProxyUnderTest
from tests.helpers import KEY_A, make_config, wait_for

Start = Callable[..., Awaitable[ProxyUnderTest]]
ServerFactory = Callable[..., Awaitable[TestServer]]
CHAT = "/v1/chat/completions"
#: 2026-12-01 12:00:00 UTC: nowhere near a day's end.
NOON = 1_796_126_400.0
#: The answer's first write: an OpenAI chat completion up to its content string.
HEAD = (
    b'{"id":"c1","object":"chat.completion","created":1,"model":"m",'
    b'"choices":[{"index":0,"message":{"role":"assistant","content":"'
)
PROMPT_TOKENS = 10


@dataclass
class Engine:
    gate: asyncio.Event = field(default_factory=asyncio.Event)


ENGINE: web.AppKey[Engine] = web.AppKey("engine", Engine)


def _tail(completion: int) -> bytes:
    usage = {
        "prompt_tokens": PROMPT_TOKENS,
        "completion_tokens": completion,
        "total_tokens": PROMPT_TOKENS + completion,
    }
    return b'"},"finish_reason":"length"}],"usage":' + json.dumps(usage).encode() + b"}"


async def _chat(request: web.Request) -> web.StreamResponse:
    """``head_bytes`` of the answer, then (once the gate opens) its end with ``usage``
    (``completion`` tokens). Without ``head_bytes`` (warm-up): one plain answer."""
    body = await request.json()
    completion = int(body.get("completion", 1))
    if "head_bytes" not in body:
        return web.json_response(json.loads(HEAD + b"x" + _tail(completion)))
    response = web.StreamResponse(headers={"Content-Type": "application/json"})
    await response.prepare(request)
    await response.write(HEAD + b"x" * (int(body["head_bytes"]) - len(HEAD)))
    await request.app[ENGINE].gate.wait()
    await response.write(_tail(completion))
    await response.write_eof()
    return response


async def _other(request: web.Request) -> web.Response:
    return web.json_response({"data": []})  # probes, /v1/models


@pytest.fixture
async def engine_server(aiohttp_server: ServerFactory) -> TestServer:
    app = web.Application()
    app[ENGINE] = Engine()
    app.router.add_post(CHAT, _chat)
    app.router.add_route("*", "/{tail:.*}", _other)
    return await aiohttp_server(app)


def _config(server: TestServer, quota: dict[str, Any]) -> Any:
    url = str(server.make_url("")).rstrip("/")
    tenants = {"a": {"api_keys": [KEY_A], "token_quota": quota}}
    return make_config([url], seats=4, tenants=tenants, warmup={"requests": 0})


async def test_a_long_answers_usage_is_settled(
    start_proxy: Start, engine_server: TestServer
) -> None:
    """A non-streaming answer longer than the kept head (256 KiB: long logprobs, many
    choices) ends with its ``usage`` like any other. The quota (``count: completion``)
    charged 1000 at admission settles to the 1000 the engine reports, read from the
    answer's last bytes (with the head alone it found no usage and settled to 0:
    such answers were free)."""
    log = io.StringIO()
    proxy = await start_proxy(
        _config(engine_server, {"per_day": 100_000, "count": "completion"}),
        quota_clock=FakeClock(start=NOON),
        access_log=log,
    )
    gate = engine_server.app[ENGINE].gate
    body = {"messages": [], "max_tokens": 1000, "completion": 1000}
    body["head_bytes"] = USAGE_SCAN_LIMIT
    try:
        async with proxy.client.post(
            CHAT, json=body, headers={"Authorization": f"Bearer {KEY_A}"}
        ) as response:
            assert response.status == 200
            head = await asyncio.wait_for(response.content.readexactly(USAGE_SCAN_LIMIT), 20)
            gate.set()  # the proxy has read (and relayed) the whole first write
            answer = json.loads(head + await asyncio.wait_for(response.read(), 20))
        assert answer["usage"]["completion_tokens"] == 1000
    finally:
        gate.set()
    await wait_for(lambda: bool(log.getvalue()), timeout_s=10)
    line = json.loads(log.getvalue())
    assert line["quota_charged_tokens"] == 1000
    assert line["quota_actual_tokens"] == 1000
    assert line["output_tokens"] == 1000
