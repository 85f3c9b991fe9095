"""The official ``openai`` client through the proxy to the simulated replica."""

from __future__ import annotations

import io
import json
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import openai
import pytest

from proxy.sim import SimConfig, SimServer, start_sim
from tests.conftest import ProxyUnderTest
from tests.helpers import KEY_A, make_config, wait_for

Start = Callable[..., Awaitable[ProxyUnderTest]]


@pytest.fixture
async def sim() -> AsyncIterator[SimServer]:
    server = await start_sim(SimConfig(slots=4, decode_base_ms=2.0, decode_per_seq_ms=0.5))
    try:
        yield server
    finally:
        await server.close()


def _client(proxy: ProxyUnderTest) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key=KEY_A, max_retries=0)


async def test_openai_client_non_streaming(start_proxy: Start, sim: SimServer) -> None:
    """A plain chat completion through the proxy: the simulator's answer and usage."""
    proxy = await start_proxy(make_config([sim.url]))
    async with _client(proxy) as client:
        reply = await client.chat.completions.create(
            model="sim-model", messages=[{"role": "user", "content": "hello there"}], max_tokens=7
        )
    assert reply.usage is not None and reply.usage.completion_tokens == 7
    assert reply.choices[0].message.content
    proxy.assert_idle()


async def test_openai_client_streaming(start_proxy: Start, sim: SimServer) -> None:
    """A streamed chat completion: every token arrives, with usage at the end."""
    proxy = await start_proxy(make_config([sim.url]))
    async with _client(proxy) as client:
        stream = await client.chat.completions.create(
            model="sim-model",
            messages=[{"role": "user", "content": "stream please"}],
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
            extra_headers={"X-Priority": "interactive"},
        )
        pieces, usage = [], None
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                pieces.append(chunk.choices[0].delta.content)
            if chunk.usage is not None:
                usage = chunk.usage
    assert len(pieces) == 12
    assert usage is not None and usage.completion_tokens == 12
    proxy.assert_idle()


async def test_openai_client_sees_the_proxy_error(start_proxy: Start, sim: SimServer) -> None:
    """A refusal reaches the SDK as its typed error with the reason code."""
    proxy = await start_proxy(make_config([sim.url]))
    async with openai.AsyncOpenAI(
        base_url=proxy.url + "/v1", api_key="wrong", max_retries=0
    ) as client:
        with pytest.raises(openai.AuthenticationError) as info:
            await client.chat.completions.create(
                model="sim-model", messages=[{"role": "user", "content": "x"}]
            )
    assert info.value.code == "unauthenticated"


async def test_disconnect_mid_stream_aborts_decoding_in_the_simulator(
    start_proxy: Start, sim: SimServer
) -> None:
    """The client leaves mid-stream: the simulator sees the abort and stops decoding."""
    proxy = await start_proxy(make_config([sim.url], timeouts={"cancel_grace_ms": 50}))
    completed_before = sim.engine.stats().completed  # the proxy's warm-up request
    async with aiohttp.ClientSession() as session:
        resp = await session.post(
            proxy.url + "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 5000,
                  "stream": True},
            headers={"Authorization": f"Bearer {KEY_A}"},
        )  # fmt: skip
        assert resp.status == 200
        for _ in range(4):
            await resp.content.readline()
        resp.close()
    await wait_for(lambda: sim.engine.stats().aborted == 1)
    await wait_for(lambda: sim.engine.running == 0)
    assert sim.engine.stats().completed == completed_before
    await wait_for(lambda: proxy.runtime.pool.total_inflight() == 0)
    proxy.assert_idle()


async def test_streaming_access_line_has_ttft_and_tokens(
    start_proxy: Start, sim: SimServer
) -> None:
    """One access line per request, with the first token and usage the relay saw."""
    log = io.StringIO()
    proxy = await start_proxy(make_config([sim.url]), access_log=log)
    async with _client(proxy) as client:
        stream = await client.chat.completions.create(
            model="sim-model", messages=[{"role": "user", "content": "hi"}], max_tokens=5,
            stream=True, stream_options={"include_usage": True},
            extra_headers={"X-Request-Id": "trace-me"},
        )  # fmt: skip
        async for _ in stream:
            pass
    await wait_for(lambda: not proxy.runtime.active)
    lines = [json.loads(text) for text in log.getvalue().splitlines()]
    assert [line["request_id"] for line in lines] == ["trace-me"]
    line = lines[0]
    assert (line["event"], line["level"]) == ("request", "info")
    assert line["timestamp"].endswith("Z")
    assert (line["tenant"], line["priority"], line["status"]) == ("a", "standard", 200)
    assert (line["outcome"], line["reason"], line["attempts"]) == ("completed", "none", 1)
    assert line["output_tokens"] == 5 and line["input_tokens"] >= 1
    assert line["ttft_ms"] >= line["upstream_ms"] > 0
    assert line["total_ms"] >= line["ttft_ms"]
    assert line["replica"] == "r0"
    assert KEY_A not in log.getvalue()
