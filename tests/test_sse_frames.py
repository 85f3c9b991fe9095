"""The relay passes SSE on in whole events, so an error event never lands inside one.

A replica that fails (dies, stalls past ``idle_ms``) after sending half an
event used to leave the client holding that half, with the proxy's error
event glued to it: the OpenAI SDK then raised a JSON decoding error, not the
proxy's message. ``SseFramer`` holds back an unfinished event until its blank
line, which costs an SSE client nothing (it dispatches an event only then).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable

import openai
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from proxy.sse_frames import MAX_HELD_BYTES, SseFramer
from tests.conftest import ProxyUnderTest
from tests.helpers import KEY_A, make_config

Start = Callable[..., Awaitable[ProxyUnderTest]]
ServerFactory = Callable[..., Awaitable[TestServer]]

EVENTS = [
    b'data: {"choices":[{"index":0,"delta":{"role":"assistant"}}]}\n\n',
    b": keep-alive\n\n",
    b'data: {"choices":[{"index":0,"delta":{"content":"one"}}]}\n\n',
    b'data: {"choices":[{"index":0,"delta":{"content":"two"}}]}\n\n',
    b"data: [DONE]\n\n",
]
STREAM = b"".join(EVENTS)


@pytest.mark.parametrize("seed", range(20))
def test_any_split_comes_out_as_whole_events_and_the_same_bytes(seed: int) -> None:
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(STREAM)), rng.randint(1, 30)))
    pieces = [STREAM[a:b] for a, b in zip([0, *cuts], [*cuts, len(STREAM)], strict=True)]
    framer = SseFramer()
    out = []
    for piece in pieces:
        passed = framer.feed(piece)
        assert passed == b"" or passed.endswith(b"\n\n")  # never half an event
        out.append(passed)
    out.append(framer.flush())
    assert b"".join(out) == STREAM


def test_whole_events_pass_at_once_as_the_same_object() -> None:
    framer = SseFramer()
    for event in EVENTS:
        assert framer.feed(event) is event


def test_bare_cr_framing_and_an_endless_event_pass_as_they_come() -> None:
    """A stream with bare ``\\r`` line ends is not cut; an event past the bound is not held.
    (``\\r\\n`` streams are cut at ``\\r\\n\\r\\n``: tests/test_stream_failures.py.)"""
    bare = SseFramer()
    assert bare.feed(b"data: {}\r") == b""  # the byte after its first \r decides
    assert bare.feed(b"\rdata: x") == b"data: {}\r\rdata: x"
    assert bare.feed(b"\r") == b"\r"
    endless = SseFramer()
    assert endless.feed(b"data: " + b"x" * 10) == b""
    big = b"x" * MAX_HELD_BYTES
    assert endless.feed(big) == b"data: " + b"x" * 10 + big
    assert endless.feed(b"y") == b"y"


async def _half_then_stall(request: web.Request) -> web.StreamResponse:
    """One content event, then half of the next, then nothing until the proxy gives up."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    await response.write(EVENTS[0] + EVENTS[2])
    await response.write(EVENTS[3][:25])
    await asyncio.Event().wait()  # the proxy's idle timeout closes this connection
    return response


async def _models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": []})


async def test_a_stream_cut_mid_event_ends_in_an_error_the_sdk_reads(
    aiohttp_server: ServerFactory, start_proxy: Start
) -> None:
    """The replica stalls after half an event: the OpenAI SDK gets the whole token before
    it and then the proxy's idle_timeout error (APIError with its message), never a
    decoding error on a glued line."""
    app = web.Application()
    app.router.add_post("/v1/chat/completions", _half_then_stall)
    app.router.add_route("*", "/{tail:.*}", _models)
    server = await aiohttp_server(app)
    url = str(server.make_url("")).rstrip("/")
    proxy = await start_proxy(make_config([url], timeouts={"idle_ms": 300}))
    async with openai.AsyncOpenAI(
        base_url=proxy.url + "/v1", api_key=KEY_A, max_retries=0
    ) as client:
        stream = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "x"}], stream=True
        )
        tokens: list[str | None] = []

        async def read_all() -> None:
            async for chunk in stream:
                tokens.append(chunk.choices[0].delta.content)

        with pytest.raises(openai.APIError) as raised:
            await read_all()
    assert tokens == [None, "one"]
    assert raised.value.body == {
        "message": "no upstream bytes for 300 ms",
        "type": "admission_error",
        "code": "idle_timeout",
    }
    await proxy.wait_idle()
