"""A real ``llama-server`` killed mid-stream, as its client and the operator see it.

The proxy asked the engine for the stream's usage on the client's behalf (the
tenant has a token quota); the engine dies before it can send it. The client
gets the tokens relayed and then one SSE error event, never the usage chunk;
the request is not retried; the access log names the failure; the quota is
settled by the tokens relayed (not the estimate, not zero); the seat goes back
and the replica's health counts the break.
"""

from __future__ import annotations

import asyncio
import io
import json
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import pytest

from bench.real_engine import Engine
from proxy.clock import FakeClock
from tests.conftest import ProxyUnderTest
from tests.engine import MODEL, llama_servers
from tests.helpers import KEY_A, make_config, wait_for

pytestmark = [pytest.mark.engine, pytest.mark.timeout(180)]

Start = Callable[..., Awaitable[ProxyUnderTest]]
CHAT = "/v1/chat/completions"
#: Content events the client takes before the engine is killed.
BEFORE_KILL = 8


def _events(raw: bytes) -> list[dict[str, Any]]:
    return [
        json.loads(line[6:])
        for line in raw.split(b"\n")
        if line.startswith(b"data: ") and line != b"data: [DONE]"
    ]


def _content(event: dict[str, Any]) -> str:
    choices = event.get("choices") or [{}]
    return str((choices[0].get("delta") or {}).get("content") or "")


async def test_llama_server_killed_mid_stream(
    start_proxy: Start, real_engine: Engine, tmp_path: Any
) -> None:
    log = io.StringIO()
    with llama_servers(real_engine, tmp_path, 1, parallel=1) as (server,):
        replicas = [{"name": "r0", "url": server.url, "max_concurrency": 1}]
        tenants = {"a": {"api_keys": [KEY_A], "token_quota": {"per_day": 100_000}}}
        retry = {"max_attempts": 3, "base_backoff_ms": 5,
                 "retry_on": ["connect_error", "reset_before_first_byte", "http_502"]}  # fmt: skip
        # Probes a minute apart: the replica's failure count is the relay's alone.
        config = make_config([], replicas=replicas, tenants=tenants, retry=retry,
                             health={"interval_ms": 60_000})  # fmt: skip
        clock = FakeClock(start=1_796_126_400.0)
        proxy = await start_proxy(config, quota_clock=clock, access_log=log)
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell a story."}],
                "max_tokens": 3000, "ignore_eos": True, "stream": True}  # fmt: skip
        async with (
            aiohttp.ClientSession() as session,
            session.post(
                proxy.url + CHAT, json=body, headers={"Authorization": f"Bearer {KEY_A}"}
            ) as resp,
        ):
            assert resp.status == 200
            raw = b""
            async with asyncio.timeout(60):
                while sum(1 for e in _events(raw) if _content(e)) < BEFORE_KILL:
                    data = await resp.content.readany()
                    assert data, raw
                    raw += data
                server.kill()
                raw += await resp.read()
    *events, error = _events(raw)
    assert error["error"]["code"] == "upstream_protocol_error"
    assert all(e.get("choices") for e in events), "no usage chunk reached the client"
    assert b'"usage"' not in raw
    await wait_for(lambda: bool(log.getvalue()), timeout_s=10)
    (line,) = [json.loads(x) for x in log.getvalue().splitlines()]
    assert (line["outcome"], line["reason"], line["attempts"]) == (
        "failed", "upstream_protocol_error", 1)  # fmt: skip
    # Charged the prompt's estimate and the events relayed from the first token on.
    first = next(i for i, e in enumerate(events) if _content(e))
    relayed = line["output_tokens"]
    assert sum(1 for e in events if _content(e)) <= relayed <= len(events) - first
    assert line["input_tokens"] is None
    assert line["quota_actual_tokens"] == len(json.dumps(body).encode()) // 4 + relayed
    assert line["quota_actual_tokens"] < line["quota_charged_tokens"]
    r0 = proxy.runtime.pool.get("r0")
    assert r0 is not None and r0.failures == 1
    await wait_for(lambda: proxy.runtime.pool.total_inflight() == 0, timeout_s=10)
    proxy.assert_idle()
