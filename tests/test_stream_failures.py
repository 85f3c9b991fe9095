"""Streamed answers under failure, as a client and an operator see them.

A real proxy before a scripted replica: each request's body says what the
replica writes, byte for byte, and how its answer ends (a reset, a stall, a
broken chunk, a clean end), so the stream's framing is the test's to choose
(``\\n`` as vLLM and TGI write it, ``\\r\\n`` as sse-starlette does). The
simulator (``admission-proxy sim``) resets real streams for the health
checks. The client reads what the proxy sends; the operator reads the access
log line, ``/metrics``, the replica's health and the seats.
"""

from __future__ import annotations

import asyncio
import io
import json
import random
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from proxy.clock import FakeClock
from proxy.sim import SimServer
from proxy.sse_frames import MAX_HELD_BYTES, SseFramer
from proxy.sse_usage import UsageStripper
from proxy.usage_request import request_usage
from tests.conftest import ProxyUnderTest
from tests.helpers import KEY_A, KEY_B, make_config, running_sims, samples_by_label, wait_for

Start = Callable[..., Awaitable[ProxyUnderTest]]
ServerFactory = Callable[..., Awaitable[TestServer]]
CHAT = "/v1/chat/completions"
TGI = "/generate_stream"
AUTH = {"Authorization": f"Bearer {KEY_A}"}
#: 2026-12-01 12:00 UTC: no day ends while a test runs on the quota's clock.
NOON = 1_796_126_400.0
LF, CRLF = b"\n\n", b"\r\n\r\n"


@dataclass
class Script:
    """What the scripted replica saw; ``gate`` holds a ``{"gate": true}`` step."""

    bodies: list[dict[str, Any]] = field(default_factory=list)
    gate: asyncio.Event = field(default_factory=asyncio.Event)


SCRIPT: web.AppKey[Script] = web.AppKey("script", Script)


async def _scripted(request: web.Request) -> web.StreamResponse:
    """``steps``: strings written as they are (latin-1), or ``{"gate": true}`` (wait for
    the test); ``end``: ``eof`` (default), ``abort`` (RST), ``truncated_chunk``,
    ``no_terminator`` (FIN without the last chunk), ``stall`` (nothing more until the
    proxy leaves) or ``bad_chunk`` (a chunk header that is not hex)."""
    state = request.app[SCRIPT]
    body = await request.json()
    state.bodies.append(body)
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    for step in body["steps"]:
        if isinstance(step, dict):
            await state.gate.wait()
        else:
            await response.write(step.encode("latin-1"))
    end = body.get("end", "eof")
    transport = request.transport
    assert transport is not None
    if end == "abort":
        transport.abort()
    elif end == "truncated_chunk":  # 100 bytes announced, 20 sent, then FIN
        transport.write(b"64\r\n" + b"x" * 20)
        transport.close()
    elif end == "no_terminator":  # FIN without the last (zero-length) chunk
        transport.close()
    elif end == "bad_chunk":
        transport.write(b"zz\r\nxx\r\n")
        await asyncio.Event().wait()  # until the proxy closes the connection
    elif end == "stall":
        await asyncio.Event().wait()
    else:
        await response.write_eof()
    return response


async def _other(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": []})  # probes, warm-up


@pytest.fixture
async def scripted(aiohttp_server: ServerFactory) -> TestServer:
    app = web.Application()
    app[SCRIPT] = Script()
    app.router.add_post(CHAT, _scripted)
    app.router.add_post(TGI, _scripted)
    app.router.add_route("*", "/{tail:.*}", _other)
    return await aiohttp_server(app)


def _url(server: TestServer) -> str:
    return str(server.make_url("")).rstrip("/")


def chunk(content: str, end: bytes = LF) -> bytes:
    doc = {"id": "c", "object": "chat.completion.chunk",
           "choices": [{"index": 0, "delta": {"content": content}}]}  # fmt: skip
    return b"data: " + json.dumps(doc, separators=(",", ":")).encode() + end


def usage_chunk(end: bytes = LF) -> bytes:
    doc = {"id": "c", "object": "chat.completion.chunk", "choices": [],
           "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}}  # fmt: skip
    return b"data: " + json.dumps(doc, separators=(",", ":")).encode() + end


def tgi_token(text: str) -> bytes:
    event = {"index": 1, "token": {"id": 1, "text": text, "logprob": 0.0, "special": False},
             "generated_text": None, "details": None}  # fmt: skip
    return b"data:" + json.dumps(event).encode() + LF


def steps(*parts: bytes | dict[str, bool]) -> list[Any]:
    return [p.decode("latin-1") if isinstance(p, bytes) else p for p in parts]


def sse_payloads(raw: bytes) -> list[str]:
    """The ``data`` of each event an SSE client dispatches (any line end, comments skipped)."""
    events: list[str] = []
    data: list[str] = []
    for line in raw.replace(b"\r\n", b"\n").split(b"\n"):
        if not line:
            if data:
                events.append("\n".join(data))
            data = []
        elif line.startswith(b"data:"):
            data.append(line[5:].removeprefix(b" ").decode())
    return events


def quota_tenants() -> dict[str, Any]:
    return {
        "a": {"api_keys": [KEY_A], "token_quota": {"per_day": 100_000}},
        "b": {"api_keys": [KEY_B]},
    }


async def start(start_proxy: Start, urls: list[str], quota: bool, **sections: Any) -> Proxy:
    log = io.StringIO()
    tenants = quota_tenants() if quota else None
    config = make_config(urls, tenants=tenants, **sections)
    proxy = await start_proxy(config, access_log=log, quota_clock=FakeClock(start=NOON))
    return Proxy(proxy, log)


@dataclass
class Proxy:
    under_test: ProxyUnderTest
    log: io.StringIO

    async def stream(self, body: dict[str, Any], path: str = CHAT) -> tuple[int, bytes]:
        """Send ``body``; the whole answer as the client received it."""
        client = self.under_test.client
        async with client.post(path, json=body, headers=AUTH) as resp:
            raw = await asyncio.wait_for(resp.read(), timeout=20)
            return resp.status, raw

    async def lines(self, count: int) -> list[dict[str, Any]]:
        """The first ``count`` access log lines (waits until they are written)."""
        await wait_for(lambda: len(self.log.getvalue().splitlines()) >= count, timeout_s=10)
        return [json.loads(line) for line in self.log.getvalue().splitlines()[:count]]


def estimate(body: dict[str, Any]) -> int:
    """The prompt's estimate the quota keeps when the engine reports none: bytes / 4."""
    return len(json.dumps(body).encode()) // 4


# -- \r\n framing (sse-starlette: llama-cpp-python and many FastAPI servers) -----------------


async def test_a_crlf_stream_loses_the_usage_chunk_the_proxy_asked_for(
    start_proxy: Start, scripted: TestServer
) -> None:
    """The proxy asks for usage the client did not ask for: in a stream framed with
    ``\\r\\n`` the usage-only chunk is removed too (it used to reach the client, whose
    ``chunk.choices[0]`` then fails), and the quota is settled by that usage."""
    proxy = await start(start_proxy, [_url(scripted)], quota=True)
    parts = (b": ping - 2026-12-01\r\n\r\n", chunk("a", CRLF), chunk("b", CRLF), chunk("c", CRLF))
    body = {"messages": [], "max_tokens": 50, "stream": True,
            "steps": steps(*parts, usage_chunk(CRLF), b"data: [DONE]\r\n\r\n")}  # fmt: skip
    status, raw = await proxy.stream(body)
    assert scripted.app[SCRIPT].bodies[0]["stream_options"] == {"include_usage": True}
    assert status == 200
    assert raw == b"".join(parts) + b"data: [DONE]\r\n\r\n"
    (line,) = await proxy.lines(1)
    assert (line["outcome"], line["input_tokens"], line["output_tokens"]) == ("completed", 7, 3)
    assert line["quota_actual_tokens"] == 10
    proxy.under_test.assert_idle()


@pytest.mark.parametrize("quota", [False, True], ids=["framer", "usage_stripper"])
async def test_a_crlf_stream_cut_mid_event_ends_in_an_error_event_of_its_own(
    start_proxy: Start, scripted: TestServer, quota: bool
) -> None:
    """A ``\\r\\n`` stream whose replica resets inside an event: the client gets the
    whole events before it and then the error event on its own, never glued to the
    half event (which an SSE client would read as one broken event)."""
    proxy = await start(start_proxy, [_url(scripted)], quota=quota)
    body = {"messages": [], "max_tokens": 50, "stream": True, "end": "abort",
            "steps": steps(chunk("a", CRLF), chunk("b", CRLF) + chunk("c", CRLF)[:25])}  # fmt: skip
    status, raw = await proxy.stream(body)
    assert status == 200
    *tokens, error = [json.loads(p) for p in sse_payloads(raw)]
    assert [t["choices"][0]["delta"]["content"] for t in tokens] == ["a", "b"]
    assert error["error"]["code"] == "upstream_protocol_error"
    (line,) = await proxy.lines(1)
    assert (line["outcome"], line["reason"], line["output_tokens"]) == (
        "failed", "upstream_protocol_error", 2)  # fmt: skip
    proxy.under_test.assert_idle()


@pytest.mark.parametrize("seed", range(10))
def test_crlf_streams_split_anywhere_come_out_whole_and_stripped(seed: int) -> None:
    """Cut at any byte (its first line end too), a ``\\r\\n`` stream passes the framer as
    whole events, byte for byte, and the stripper as the stream without its usage."""
    events = [b": ping\r\n\r\n", chunk("a", CRLF), chunk("b", CRLF), usage_chunk(CRLF)]
    stream = b"".join([*events, b"data: [DONE]\r\n\r\n"])
    rng = random.Random(seed)
    first_cr = stream.index(b"\r")
    cuts = sorted({first_cr + 1, *rng.sample(range(1, len(stream)), rng.randint(1, 30))})
    pieces = [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True)]
    framer, stripper = SseFramer(), UsageStripper()
    framed, stripped = [], []
    for piece in pieces:
        out = framer.feed(piece)
        assert out == b"" or out.endswith(CRLF)  # never half an event
        framed.append(out)
        stripped.append(stripper.feed(piece))
    assert b"".join([*framed, framer.flush()]) == stream
    assert b"".join([*stripped, stripper.flush()]) == stream.replace(usage_chunk(CRLF), b"")
    assert stripper.stripped == 1


def test_the_stripper_holds_an_endless_event_no_longer_than_the_framer_does() -> None:
    """An event that never ends is held up to ``MAX_HELD_BYTES``, then passed on as it
    comes, as ``SseFramer`` does (it used to be held whole, however large)."""
    stripper = UsageStripper()
    assert stripper.feed(b"data: " + b"x" * 10) == b""
    big = b"x" * MAX_HELD_BYTES
    assert stripper.feed(big) == b"data: " + b"x" * 10 + big
    assert stripper.feed(b"y") == b"y"


@pytest.mark.parametrize("end", [LF, CRLF], ids=["lf", "crlf"])
def test_after_an_event_longer_than_the_bound_events_are_whole_and_stripped_again(
    end: bytes,
) -> None:
    """An event past ``MAX_HELD_BYTES`` is passed on as it comes; the events after it
    come out whole again and the usage chunk is still removed (the framer used to pass
    the rest of the stream as it came, and the stripper to hold the event whole)."""
    long_event = b"data: " + b"x" * (2 * MAX_HELD_BYTES) + end
    after = [chunk("b", end), usage_chunk(end), b"data: [DONE]" + end]
    stream = b"".join([chunk("a", end), long_event, *after])
    tail_start = len(stream) - len(b"".join(after))
    step = 65_536
    cuts = sorted({*range(step, len(stream), step), tail_start - 1, tail_start + 5})
    pieces = [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True)]
    framer, stripper = SseFramer(), UsageStripper()
    framed, stripped, passed = [], [], 0
    for piece in pieces:
        out = framer.feed(piece)
        if passed + len(out) > tail_start:  # reaches past the long event: ends whole
            assert out.endswith(end)
        passed += len(out)
        framed.append(out)
        stripped.append(stripper.feed(piece))
    assert b"".join([*framed, framer.flush()]) == stream
    assert b"".join([*stripped, stripper.flush()]) == stream.replace(usage_chunk(end), b"")


# -- an answer that is whole at [DONE] ------------------------------------------------------


@pytest.mark.parametrize("end", ["abort", "stall"])
async def test_a_connection_lost_after_done_ends_a_completed_answer(
    start_proxy: Start, scripted: TestServer, end: str
) -> None:
    """The engine sent ``[DONE]``, then its connection reset or stalled before the HTTP
    terminator: the client has the whole answer, so it gets no error event after
    ``[DONE]``, and the operator sees a completed request (not a failure or an idle
    timeout), charged its usage, and a replica whose health holds no failure."""
    proxy = await start(start_proxy, [_url(scripted)], quota=True, timeouts={"idle_ms": 300})
    parts = (chunk("a"), chunk("b"), usage_chunk(), b"data: [DONE]\n\n")
    body = {"messages": [], "max_tokens": 50, "stream": True, "end": end, "steps": steps(*parts)}
    status, raw = await proxy.stream(body)
    assert status == 200
    assert raw == chunk("a") + chunk("b") + b"data: [DONE]\n\n"
    (line,) = await proxy.lines(1)
    assert (line["status"], line["outcome"], line["reason"]) == (200, "completed", "none")
    assert line["quota_actual_tokens"] == 10
    assert proxy.under_test.runtime.pool.replicas[0].failures == 0
    proxy.under_test.assert_idle()


async def test_the_seat_goes_back_at_done_not_at_the_http_terminator(
    start_proxy: Start, scripted: TestServer
) -> None:
    """The engine is finished at ``[DONE]``: its seat is free then, while the replica's
    HTTP terminator is still missing (it used to wait for it, up to ``idle_ms``)."""
    proxy = await start(start_proxy, [_url(scripted)], quota=False, timeouts={"idle_ms": 60_000})
    parts = (chunk("a"), b"data: [DONE]\n\n")
    body = {"messages": [], "stream": True, "end": "stall", "steps": steps(*parts)}
    pool = proxy.under_test.runtime.pool
    async with proxy.under_test.client.post(CHAT, json=body, headers=AUTH) as resp:
        raw = b""
        async with asyncio.timeout(20):
            while not raw.endswith(b"data: [DONE]\n\n"):
                data = await resp.content.readany()
                assert data, raw
                raw += data
        await wait_for(lambda: pool.total_inflight() == 0, timeout_s=10)
        assert not resp.content.at_eof()  # the answer itself has not ended
    (line,) = await proxy.lines(1)  # the client left after [DONE]: served
    assert (line["outcome"], line["reason"]) == ("completed", "none")
    proxy.under_test.assert_idle()


# -- the replica breaks off mid-stream ------------------------------------------------------


#: How a replica's stream ends after its first tokens, and what the operator sees.
BREAKS = {
    "abort": ("failed", "upstream_protocol_error"),
    "truncated_chunk": ("failed", "upstream_protocol_error"),
    "no_terminator": ("failed", "upstream_protocol_error"),
    "stall": ("timed_out", "idle_timeout"),
}


@pytest.mark.parametrize("end", sorted(BREAKS))
@pytest.mark.parametrize("path", [CHAT, TGI])
async def test_a_stream_broken_after_the_first_byte_is_reported_not_retried(
    start_proxy: Start, scripted: TestServer, path: str, end: str
) -> None:
    """A reset, a chunk cut short, a connection closed without the last chunk or a
    stall past ``idle_ms``, after the first tokens reached the client: an SSE error
    event ends the stream (OpenAI-style and TGI's ``/generate_stream``), no second
    attempt is made whatever ``retry_on`` says, the access log and ``/metrics`` name the
    failure, and the quota is charged the tokens relayed."""
    outcome, reason = BREAKS[end]
    retry = {"max_attempts": 3, "base_backoff_ms": 1, "retry_on": [
        "connect_error", "connect_timeout", "first_byte_timeout", "reset_before_first_byte",
        "http_500", "http_502", "http_503", "http_504"]}  # fmt: skip
    timeouts = {"idle_ms": 300}
    proxy = await start(start_proxy, [_url(scripted)], quota=True, retry=retry, timeouts=timeouts)
    token = tgi_token if path == TGI else chunk
    body = {"inputs": "x", "parameters": {"max_new_tokens": 50}} if path == TGI else {
        "messages": [], "max_tokens": 50}  # fmt: skip
    body |= {"stream": True, "end": end,
             "steps": steps(token("a"), token("b"), {"gate": True}, token("c")[:20])}  # fmt: skip
    async with proxy.under_test.client.post(path, json=body, headers=AUTH) as resp:
        assert resp.status == 200
        raw = b""
        async with asyncio.timeout(20):
            while raw.count(b"\n\n") < 2:  # the first two events reached the client
                data = await resp.content.readany()
                assert data, raw
                raw += data
            scripted.app[SCRIPT].gate.set()  # and only then does the replica break
            raw += await resp.read()
    *tokens, error = [json.loads(p) for p in sse_payloads(raw)]
    assert len(tokens) == 2
    assert error["error"]["code"] == reason
    assert len(scripted.app[SCRIPT].bodies) == 1, "never retried after the first byte"
    (line,) = await proxy.lines(1)
    assert (line["outcome"], line["reason"], line["attempts"]) == (outcome, reason, 1)
    assert line["quota_actual_tokens"] == estimate(body) + 2  # the two tokens relayed
    metrics = await (await proxy.under_test.client.get("/metrics")).text()
    assert samples_by_label(metrics, "admission_requests_total", "reason") == {reason: 1.0}
    # A break counts toward the replica's ejection; a stall is for the probes to judge.
    assert proxy.under_test.runtime.pool.replicas[0].failures == (end != "stall")
    await proxy.under_test.wait_idle()


async def test_a_broken_answer_before_the_first_byte_names_no_replica_address(
    start_proxy: Start, scripted: TestServer
) -> None:
    """A replica whose answer aiohttp cannot parse before any body byte: 502
    ``upstream_protocol_error`` naming the replica, never its URL (it used to carry
    ``url='http://host:port/...'`` from aiohttp's message)."""
    proxy = await start(start_proxy, [_url(scripted)], quota=False)
    body = {"messages": [], "stream": True, "end": "bad_chunk", "steps": []}
    status, raw = await proxy.stream(body)
    assert status == 502
    error = json.loads(raw)["error"]
    assert error["code"] == "upstream_protocol_error"
    assert "replica r0" in error["message"]
    assert str(scripted.port) not in error["message"]
    assert "127.0.0.1" not in error["message"]


async def test_a_chunk_header_broken_mid_stream_ends_at_the_idle_timeout(
    start_proxy: Start, scripted: TestServer
) -> None:
    """A chunk header that is not hex after the first tokens: aiohttp's client drops
    the connection but never fails the body it was reading, so the proxy hears of it
    only as silence; ``idle_ms`` bounds it, the client gets the error event, and the
    seat goes back. (Before the first byte the same answer is a 502 at once.)"""
    proxy = await start(start_proxy, [_url(scripted)], quota=False, timeouts={"idle_ms": 300})
    body = {"messages": [], "stream": True, "end": "bad_chunk",
            "steps": steps(chunk("a"), {"gate": True})}  # fmt: skip
    async with proxy.under_test.client.post(CHAT, json=body, headers=AUTH) as resp:
        raw = b""
        async with asyncio.timeout(20):
            while not raw.endswith(LF):
                data = await resp.content.readany()
                assert data, raw
                raw += data
            scripted.app[SCRIPT].gate.set()
            raw += await resp.read()
    assert [json.loads(p).get("error", {}).get("code") for p in sse_payloads(raw)] == [
        None, "idle_timeout"]  # fmt: skip
    (line,) = await proxy.lines(1)
    assert (line["outcome"], line["reason"]) == ("timed_out", "idle_timeout")
    await proxy.under_test.wait_idle()


@pytest.fixture
async def sims() -> AsyncIterator[list[SimServer]]:
    async with running_sims() as servers:
        yield servers


async def test_a_replica_that_breaks_every_stream_it_starts_is_ejected(
    start_proxy: Start, sims: list[SimServer]
) -> None:
    """A simulator that resets every stream after two tokens (a sick engine that
    answers its probes): each break counts toward its ejection like a reset before the
    first byte, so after ``eject_after_failures`` of them in a row it is ejected and the
    other replica takes the streams. It used to count none: the commit point counted as
    a success and cleared the count, and the replica kept breaking streams forever."""
    sick, well = sims
    await sick.set_faults(reset_mid_stream_after_tokens=2)
    health = {"interval_ms": 100, "eject_after_failures": 2, "eject_ms": 60_000}
    proxy = await start(start_proxy, [well.url, sick.url], quota=True, health=health)
    r1 = proxy.under_test.runtime.pool.get("r1")
    assert r1 is not None
    body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 6, "stream": True}
    answers: list[bytes] = []
    for _ in range(40):
        if r1.ejected:
            break
        status, raw = await proxy.stream(body)
        assert status == 200
        answers.append(raw)
    assert r1.ejected, f"{sick.state.resets_injected} broken streams did not eject r1"
    resets = sick.state.resets_injected
    # A reset whose bytes the kernel dropped unread is a reset before the first byte:
    # retried on r0 and counted too. Every other one reached its client as an error.
    lines = await proxy.lines(len(answers))
    failed = [line for line in lines if line["outcome"] == "failed"]
    assert 1 <= len(failed) <= resets
    assert [(line["replica"], line["attempts"], line["output_tokens"]) for line in failed] == [
        ("r1", 1, 2)] * len(failed)  # fmt: skip
    for raw in answers:
        last = sse_payloads(raw)[-1]
        assert last == "[DONE]" or json.loads(last)["error"]["code"] == "upstream_protocol_error"
    # After the ejection every stream goes to the other replica and completes.
    for _ in range(3):
        status, raw = await proxy.stream(body)
        assert status == 200 and sse_payloads(raw)[-1] == "[DONE]"
    assert sick.state.resets_injected == resets
    proxy.under_test.assert_idle()


def test_usage_asked_for_the_client_leaves_vllm_continuous_usage_off() -> None:
    """A client that sent vLLM's ``continuous_usage_stats`` without ``include_usage``
    got no usage at all (vLLM needs both); asked with ``include_usage`` on its behalf it
    would get a usage object in every chunk, which the stripper leaves (it is inside
    chunks with choices). The proxy's request leaves the flag out."""
    doc = {"stream": True, "stream_options": {"continuous_usage_stats": True}}
    assert request_usage(doc) == {"stream": True, "stream_options": {"include_usage": True}}


@pytest.mark.parametrize("stream", [False, True])
async def test_the_first_byte_budget_bounds_streams_only(
    start_proxy: Start, upstream_url: str, stream: bool
) -> None:
    """A replica 3x ``first_byte_ms`` late with its first byte: a stream is answered 504
    ``first_byte_timeout`` (never relayed), a non-streaming request, whose first byte
    comes only with its whole answer, is bounded by the total alone and completes."""
    budgets = {"first_byte_ms": 200, "total_ms": 20_000}
    proxy = await start(start_proxy, [upstream_url], quota=False, budgets=budgets)
    body = {"messages": [], "max_tokens": 3, "stream": stream, "hang_ms": 600}
    status, raw = await proxy.stream(body)
    if stream:
        assert status == 504 and json.loads(raw)["error"]["code"] == "first_byte_timeout"
    else:
        assert status == 200 and json.loads(raw)["usage"]["completion_tokens"] == 3
    await proxy.under_test.wait_idle()
