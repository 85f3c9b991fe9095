"""Bad input the entrance fuzz found, one case each: content codings, ``Expect``, bad JSON.

Against the real proxy and the fake upstream (an aiohttp app, so it decodes a
``Content-Encoding`` body and honours ``Expect`` as aiohttp's server does), or
the simulator where a real answer and a token quota matter.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from proxy.engine_routes import MAX_OUTPUT_LIMIT
from proxy.sim import SimConfig, SimServer, start_sim
from tests.conftest import ProxyUnderTest
from tests.helpers import KEY_A, make_config, wait_for
from tests.upstreams import Upstream

Start = Callable[..., Awaitable[ProxyUnderTest]]
CHAT = "/v1/chat/completions"
AUTH = {"Authorization": f"Bearer {KEY_A}"}
DOC = {"model": "sim-model", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}
CODINGS: dict[str, Callable[[bytes], bytes]] = {"gzip": gzip.compress, "deflate": zlib.compress}


@pytest.fixture
async def sim() -> AsyncIterator[SimServer]:
    server = await start_sim(SimConfig(slots=4, decode_base_ms=1.0, decode_per_seq_ms=0.0))
    try:
        yield server
    finally:
        await server.close()


@pytest.mark.parametrize("coding", sorted(CODINGS))
async def test_a_compressed_body_reaches_the_replica_decoded_and_unlabelled(
    start_proxy: Start, upstream_url: str, upstream_state: Upstream, coding: str
) -> None:
    """A gzip or deflate body: aiohttp decodes it before the entrance reads it, so the
    replica gets the decoded JSON without ``Content-Encoding`` and answers 200 (it used
    to get the label too, fail to decode the JSON again, and answer 500, which retried
    the request and counted towards ejecting the replica)."""
    proxy = await start_proxy(make_config([upstream_url]))
    body = CODINGS[coding](json.dumps(DOC).encode())
    headers = {**AUTH, "Content-Type": "application/json", "Content-Encoding": coding}
    resp = await proxy.client.post(CHAT, data=body, headers=headers)
    assert resp.status == 200, await resp.text()
    assert (await resp.json())["usage"]["completion_tokens"] == 3
    assert [h.get("Content-Encoding") for h in upstream_state.seen] == [None]
    assert proxy.runtime.pool.replicas[0].serving
    proxy.assert_idle()


async def test_a_coding_the_proxy_does_not_decode_keeps_its_label(
    start_proxy: Start, upstream_url: str, upstream_state: Upstream
) -> None:
    """A coding aiohttp leaves alone reaches the replica as sent, label included: the
    replica judges that body (the proxy forwards it on a route it does not parse)."""
    proxy = await start_proxy(make_config([upstream_url]))
    resp = await proxy.client.post(
        "/tokenize", data=b"\x01\x02", headers={**AUTH, "Content-Encoding": "x-custom"}
    )
    assert resp.status == 200
    assert upstream_state.seen[-1]["Content-Encoding"] == "x-custom"
    proxy.assert_idle()


async def test_a_compressed_stream_request_streams(start_proxy: Start, sim: SimServer) -> None:
    """``stream: true`` in a gzip body: the simulator streams every token back."""
    proxy = await start_proxy(make_config([sim.url]))
    body = gzip.compress(json.dumps({**DOC, "stream": True}).encode())
    resp = await proxy.client.post(CHAT, data=body, headers={**AUTH, "Content-Encoding": "gzip"})
    assert resp.status == 200, await resp.text()
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    events = [line for line in (await resp.text()).splitlines() if line.startswith("data: {")]
    assert len(events) >= 3
    proxy.assert_idle()


@pytest.mark.parametrize("expect", ["200-maybe", "100-continue, later", "\u00e9"])
@pytest.mark.parametrize("path", [CHAT, "/healthz", "/admin/state"])
async def test_an_unknown_expectation_is_ignored_not_answered_417(
    start_proxy: Start, upstream_url: str, upstream_state: Upstream, expect: str, path: str
) -> None:
    """An ``Expect`` other than ``100-continue`` is ignored (RFC 9110 allows it): the
    request gets its usual answer with ``X-Request-Id``, not aiohttp's plain-text 417
    that quoted the value; the replica never sees the header."""
    proxy = await start_proxy(make_config([upstream_url]))
    resp = await proxy.client.post(path, json=DOC, headers={**AUTH, "Expect": expect})
    assert resp.status != 417
    assert "X-Request-Id" in resp.headers
    assert expect not in await resp.text()
    if path == CHAT:
        assert resp.status == 200
        assert "Expect" not in upstream_state.seen[-1]
    else:
        assert resp.headers.get("Content-Type", "").startswith("application/json")
    proxy.assert_idle()


async def test_100_continue_is_answered_and_not_forwarded(
    start_proxy: Start, upstream_url: str, upstream_state: Upstream
) -> None:
    """``Expect: 100-continue``: the client gets its ``100 Continue`` and its answer; the
    replica gets the whole body without the expectation (the proxy has the body)."""
    proxy = await start_proxy(make_config([upstream_url]))
    host, port = proxy.client.host, proxy.client.port
    reader, writer = await asyncio.open_connection(host, port)
    body = json.dumps(DOC).encode()
    head = (
        f"POST {CHAT} HTTP/1.1\r\nHost: p\r\nAuthorization: Bearer {KEY_A}\r\n"
        f"Expect: 100-continue\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    try:
        async with asyncio.timeout(10):
            writer.write(head.encode())
            assert await reader.readuntil(b"\r\n\r\n") == b"HTTP/1.1 100 Continue\r\n\r\n"
            writer.write(body)
            answer = await reader.read()
    finally:
        writer.close()
    assert answer.startswith(b"HTTP/1.1 200 ")
    assert "Expect" not in upstream_state.seen[-1]
    proxy.assert_idle()


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b'\xff{"model": "x"}', "request body is not valid JSON: the body is not UTF-8 text"),
        (
            b'{"max_tokens": 1' + b"0" * 5000 + b"}",
            "request body is not valid JSON: a number holds more than 4300 digits",
        ),
        (
            b'{"model": ',
            "request body is not valid JSON: Expecting value: line 1 column 11 (char 10)",
        ),
    ],
    ids=["not-utf8", "huge-number", "cut-short"],
)
async def test_an_invalid_json_body_is_described_without_quoting_it(
    start_proxy: Start, upstream_url: str, upstream_state: Upstream, body: bytes, message: str
) -> None:
    """400 bad_request says what is wrong and where, never a byte of the body (the
    decoder's own message quoted one) or Python's settings (``set_int_max_str_digits``)."""
    proxy = await start_proxy(make_config([upstream_url]))
    resp = await proxy.client.post(CHAT, data=body, headers=AUTH)
    assert resp.status == 400
    assert resp.headers["X-Admission-Reason"] == "bad_request"
    assert (await resp.json())["error"]["message"] == message
    assert upstream_state.seen == []
    proxy.assert_idle()


#: Streamed requests that go wrong before the first byte: (body fields, status, reason).
BAD_STREAMS = [
    ({"stream_options": "yes"}, 400, "upstream_status"),
    ({"stream_options": {"include_usage": "yes"}, "max_tokens": -1}, 400, "upstream_status"),
    ({"max_tokens": 10**30}, 429, "token_quota_exceeded"),
    ({"n": 10**6, "max_tokens": 5}, 429, "token_quota_exceeded"),
    ({"model": ["sim-model"]}, 400, "bad_request"),
    ({"model": "other"}, 404, "model_not_found"),
    ({"messages": [[{"role": "user"}]]}, 400, "upstream_status"),
]


@pytest.mark.parametrize(("fields", "status", "reason"), BAD_STREAMS)
async def test_a_bad_stream_request_is_a_json_error_and_charges_nothing(
    start_proxy: Start,
    sim: SimServer,
    fields: dict[str, object],
    status: int,
    reason: str,
) -> None:
    """``stream: true`` with a bad field, from a tenant with a token quota: the refusal
    (the proxy's, or the replica's own passed through) is a JSON answer with its status
    and reason, not an SSE stream; the charge is corrected to 0; nothing is held."""
    tenants = {"a": {"api_keys": [KEY_A], "token_quota": {"per_minute": 100_000}}}
    config = make_config([sim.url], tenants=tenants, model_aliases={"alias": "sim-model"})
    proxy = await start_proxy(config)
    await wait_for(lambda: bool(proxy.runtime.models.served_models()))
    resp = await proxy.client.post(CHAT, json={**DOC, "stream": True, **fields}, headers=AUTH)
    assert (resp.status, resp.headers["X-Admission-Reason"]) == (status, reason)
    assert resp.headers["Content-Type"].startswith("application/json")
    assert "X-Request-Id" in resp.headers and "x-ratelimit-limit-tokens" in resp.headers
    error = (await resp.json())["error"]
    if reason != "upstream_status":
        assert error["code"] == reason and error["type"] == "admission_error"
    proxy.assert_idle()
    state = await (await proxy.client.get("/admin/state")).json()
    assert state["tenants"]["a"]["quota"]["minute"]["used"] == 0


HUGE = "1" + "0" * 4000  # as long as a JSON number may be; a product of two is longer


@pytest.mark.parametrize("mode", ["enforce", "observe"])
@pytest.mark.parametrize(
    "fields",
    [
        f'"max_tokens": {HUGE}, "n": {HUGE}',
        f'"max_completion_tokens": {HUGE}, "best_of": {HUGE}, "stream": true',
        f'"sampling_params": [{{"max_new_tokens": {HUGE}, "n": {HUGE}}}]',
    ],
    ids=["max_tokens-n", "stream-best_of", "sglang-batch"],
)
async def test_huge_output_limits_are_refused_by_the_quota_not_a_500(
    start_proxy: Start, sim: SimServer, mode: str, fields: str
) -> None:
    """An output limit times its sequences, each as long as JSON allows, from a tenant with
    a token quota: 429 token_quota_exceeded, saying it can never be admitted (in observe
    mode, forwarded to the replica, whose answer is passed through). Its estimate had more
    digits than Python writes as text: the refusal's message raised, a 500."""
    tenants = {"a": {"api_keys": [KEY_A], "token_quota": {"per_minute": 100_000}}}
    proxy = await start_proxy(make_config([sim.url], tenants=tenants, mode=mode))
    body = f'{{"model": "sim-model", "messages": [{{"role": "user", "content": "hi"}}], {fields}}}'
    resp = await proxy.client.post(CHAT, data=body.encode(), headers=AUTH)
    if mode == "enforce":
        assert (resp.status, resp.headers["X-Admission-Reason"]) == (429, "token_quota_exceeded")
        message = (await resp.json())["error"]["message"]
        prompt = len(body) // 4
        assert f"estimated at {MAX_OUTPUT_LIMIT + prompt} tokens" in message
        assert "can never be admitted" in message
    else:  # the simulator refuses such a max_tokens, and ignores SGLang's sampling_params
        assert resp.status in (200, 400), await resp.text()
        assert resp.headers.get("X-Admission-Reason", "upstream_status") == "upstream_status"
    proxy.assert_idle()
