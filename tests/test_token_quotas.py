"""Token quotas end to end: the real proxy, a deterministic OpenAI-style upstream, a fake clock.

The quotas' clock (seconds since the epoch, for the minute bucket and the UTC
day) is a ``FakeClock`` the tests move by hand; nothing sleeps. The upstream
answers like OpenAI: with ``stream_options.include_usage`` every chunk carries
``"usage":null`` and one last chunk with empty ``choices`` carries the usage;
its bytes depend only on the request, so two answers can be compared byte for
byte.
"""

from __future__ import annotations

import asyncio
import io
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from multidict import CIMultiDict

from proxy.clock import FakeClock
from proxy.reload import apply_config
from proxy.state.quota import DAY_S
from tests.conftest import ProxyUnderTest
from tests.helpers import KEY_A, KEY_B, make_config, wait_for

Start = Callable[..., Awaitable[ProxyUnderTest]]
ServerFactory = Callable[..., Awaitable[TestServer]]
CHAT = "/v1/chat/completions"
#: 2026-12-01 23:58:30 UTC: 90 s before a UTC day ends.
BEFORE_MIDNIGHT = 1_796_169_510.0


@dataclass
class Engine:
    """What the upstream saw, and a gate that holds answers until the test opens it."""

    bodies: list[dict[str, Any]] = field(default_factory=list)
    gate: asyncio.Event = field(default_factory=asyncio.Event)
    waiting: int = 0


ENGINE: web.AppKey[Engine] = web.AppKey("engine", Engine)


def _chunk(choices: list[dict[str, Any]], usage_field: bool, **extra: Any) -> bytes:
    doc: dict[str, Any] = {"id": "c1", "object": "chat.completion.chunk", "created": 1}
    doc["choices"] = choices
    if usage_field:
        doc["usage"] = None
    doc.update(extra)
    return b"data: " + json.dumps(doc, separators=(",", ":")).encode() + b"\n\n"


async def _chat(request: web.Request) -> web.StreamResponse:
    """``generate`` tokens (else ``max_tokens``, else 4); ``prompt_tokens`` reported (10);
    ``no_usage``: never reports usage; ``hold``: waits for the gate before answering;
    ``stall_after``: stops after that many tokens until the client leaves."""
    engine = request.app[ENGINE]
    body = await request.json()
    engine.bodies.append(body)
    n = int(body["generate"]) if "generate" in body else int(body.get("max_tokens") or 4)
    prompt = int(body.get("prompt_tokens", 10))
    usage = {"prompt_tokens": prompt, "completion_tokens": n, "total_tokens": prompt + n}
    if body.get("no_usage"):
        usage = {}
    if body.get("hold"):
        engine.waiting += 1
        await engine.gate.wait()
    if not body.get("stream"):
        answer: dict[str, Any] = {"id": "c1", "object": "chat.completion", "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "t " * n}}]}  # fmt: skip
        if usage:
            answer["usage"] = usage
        return web.json_response(answer)
    options = body.get("stream_options") or {}
    with_usage = options.get("include_usage") is True and bool(usage)
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    await response.write(_chunk([{"index": 0, "delta": {"role": "assistant"}}], with_usage))
    for i in range(n):
        if i == body.get("stall_after"):
            await asyncio.Event().wait()  # until the proxy closes the connection
        await response.write(_chunk([{"index": 0, "delta": {"content": f"t{i}"}}], with_usage))
    await response.write(_chunk([{"index": 0, "delta": {}, "finish_reason": "length"}], with_usage))
    if with_usage:
        await response.write(_chunk([], False, usage=usage))
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


async def _sglang_generate(request: web.Request) -> web.StreamResponse:
    """SGLang's ``/generate``: a list of texts is a batch, answered with a JSON array (or a
    stream interleaving the answers by ``index``), each with its ``meta_info`` counts:
    5 prompt tokens per text, ``sampling_params.max_new_tokens`` generated; with
    ``sampling_params.n`` each text is answered ``n`` times (index text * n + sample),
    every answer repeating its text's prompt count, as SGLang does."""
    body = await request.json()
    samples = int(body["sampling_params"].get("n", 1))
    texts = body["text"] if isinstance(body["text"], list) else [body["text"]]
    answered = len(texts) * samples
    n = int(body["sampling_params"]["max_new_tokens"])

    def answer(index: int, done: int) -> dict[str, Any]:
        meta = {"id": f"r{index}", "prompt_tokens": 5, "completion_tokens": done,
                "finish_reason": {"type": "length"} if done == n else None}  # fmt: skip
        return {"text": "t" * done, "meta_info": meta, "index": index}

    if not body.get("stream"):
        answers = [answer(index, n) for index in range(answered)]
        batch = isinstance(body["text"], list) or samples > 1
        return web.json_response(answers if batch else answers[0])
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    for done in range(1, n + 1):
        for index in reversed(range(answered)):
            await response.write(b"data: " + json.dumps(answer(index, done)).encode() + b"\n\n")
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


async def _other(request: web.Request) -> web.Response:
    return web.json_response({"data": []})  # probes, warm-up, /v1/models


@pytest.fixture
async def engine_server(aiohttp_server: ServerFactory) -> TestServer:
    app = web.Application()
    app[ENGINE] = Engine()
    app.router.add_post(CHAT, _chat)
    app.router.add_post("/generate", _sglang_generate)
    app.router.add_route("*", "/{tail:.*}", _other)
    return await aiohttp_server(app)


@pytest.fixture
def engine(engine_server: TestServer) -> Engine:
    return engine_server.app[ENGINE]


@pytest.fixture
def engine_url(engine_server: TestServer) -> str:
    return str(engine_server.make_url("")).rstrip("/")


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(start=BEFORE_MIDNIGHT)


def quota_config(url: str, quota: dict[str, Any], **tenant_a: Any) -> Any:
    tenants = {
        "a": {"api_keys": [KEY_A], "token_quota": quota, **tenant_a},
        "b": {"api_keys": [KEY_B]},
    }
    return make_config([url], seats=16, tenants=tenants)


async def chat(
    proxy: ProxyUnderTest, body: dict[str, Any], key: str = KEY_A
) -> tuple[int, CIMultiDict[str], bytes]:
    async with proxy.client.post(CHAT, json=body, headers={"Authorization": f"Bearer {key}"}) as r:
        return r.status, CIMultiDict(r.headers), await r.read()


def estimate_of(body: dict[str, Any], output: int) -> int:
    """What the proxy charges at admission: aiohttp's JSON bytes / 4 plus the output."""
    return len(json.dumps(body).encode()) // 4 + output


async def test_refused_once_usage_leaves_no_room_then_refilled(
    start_proxy: Start, engine_url: str, engine: Engine, clock: FakeClock
) -> None:
    """per_minute 100: a request estimated at 8 + 50 is charged its real 10 + 50, leaving 40;
    the next (58 estimated) is refused 429 with the error body, reason, Retry-After until 58
    fit (10.8 s, sent as 11) and the headers, and reaches no replica; then it fits."""
    proxy = await start_proxy(quota_config(engine_url, {"per_minute": 100}), quota_clock=clock)
    body = {"messages": [], "max_tokens": 50}
    estimate = estimate_of(body, 50)
    status, headers, _ = await chat(proxy, body)
    assert status == 200
    # A whole answer is settled before it is sent: the headers count its real usage.
    assert headers["x-ratelimit-limit-tokens"] == "100"
    assert headers["x-ratelimit-remaining-tokens"] == "40"
    assert headers["x-ratelimit-reset-tokens"] == "36s"  # 60 missing at 100 a minute
    assert "x-ratelimit-limit-requests" not in headers  # no rate_per_s

    status, headers, raw = await chat(proxy, body)
    assert status == 429
    error = json.loads(raw)["error"]
    assert error["code"] == "token_quota_exceeded" and error["type"] == "admission_error"
    assert headers["X-Admission-Reason"] == "token_quota_exceeded"
    assert headers["X-Request-Id"]
    # (estimate - 40) missing tokens at 100 a minute.
    wait_s = (estimate - 40) * 60 / 100
    assert headers["Retry-After"] == str(int(wait_s) + (wait_s % 1 > 0))
    assert headers["x-ratelimit-remaining-tokens"] == "40"
    assert len(engine.bodies) == 1  # the refused request reached no replica
    proxy.assert_idle()

    clock.advance(int(headers["Retry-After"]))  # a client that waits as told
    status, _, _ = await chat(proxy, body)
    assert status == 200


async def test_day_quota_refuses_until_utc_midnight(
    start_proxy: Start, engine_url: str, clock: FakeClock
) -> None:
    """per_day 100: once used, the refusal's Retry-After is the 90 s to 00:00 UTC (not
    clamped to 60) and the reset header says so; after midnight the day is new."""
    proxy = await start_proxy(quota_config(engine_url, {"per_day": 100}), quota_clock=clock)
    body = {"messages": [], "max_tokens": 50, "generate": 80}  # generates 80: an under-estimate
    status, headers, _ = await chat(proxy, body)
    assert status == 200
    assert headers["x-ratelimit-remaining-tokens"] == "10"  # 100 - (10 + 80)
    assert headers["x-ratelimit-reset-tokens"] == "1m30s"
    status, headers, _ = await chat(proxy, body)
    assert status == 429
    assert headers["Retry-After"] == "90"
    clock.advance(90)
    status, headers, _ = await chat(proxy, body)
    assert status == 200
    assert headers["x-ratelimit-remaining-tokens"] == "10"


async def test_correction_over_and_under_the_estimate(
    start_proxy: Start, engine_url: str, clock: FakeClock
) -> None:
    """The charge ends as the real usage: less than the estimate (refund), more (extra
    charge), none at all for an upstream error; the access log shows both figures."""
    log = io.StringIO()
    config = quota_config(engine_url, {"per_day": 10_000})
    proxy = await start_proxy(config, quota_clock=clock, access_log=log)
    over = {"messages": [], "max_tokens": 200, "generate": 5}
    under = {"messages": [], "max_tokens": 20, "generate": 300, "prompt_tokens": 40}
    assert (await chat(proxy, over))[0] == 200
    assert (await chat(proxy, under))[0] == 200
    await wait_for(lambda: log.getvalue().count("\n") == 2)
    lines = [json.loads(line) for line in log.getvalue().splitlines()]
    charged = [(line["quota_charged_tokens"], line["quota_actual_tokens"]) for line in lines]
    assert charged == [(estimate_of(over, 200), 15), (estimate_of(under, 20), 340)]
    state = await (await proxy.client.get("/admin/state")).json()
    assert state["tenants"]["a"]["quota"]["day"] == {
        "limit": 10_000, "used": 355, "remaining": 10_000 - 355,
    }  # fmt: skip
    assert state["tenants"]["b"]["quota"] is None


async def test_concurrent_requests_never_overrun_the_quota(
    start_proxy: Start, engine_url: str, engine: Engine, clock: FakeClock
) -> None:
    """20 requests at once against room for 10 estimates: exactly 10 reach the replica
    (charged at admission, before any answer), 10 are refused, nothing is left held."""
    body = {"messages": [], "max_tokens": 60, "hold": True}
    estimate = estimate_of(body, 60)
    proxy = await start_proxy(
        quota_config(engine_url, {"per_minute": 10 * estimate}, max_concurrency=32),
        quota_clock=clock,
    )
    tasks = [asyncio.ensure_future(chat(proxy, body)) for _ in range(20)]
    await wait_for(
        lambda: engine.waiting == 10 and sum(t.done() for t in tasks) == 10, timeout_s=30
    )
    engine.gate.set()
    statuses = sorted(status for status, _, _ in await asyncio.gather(*tasks))
    assert statuses == [200] * 10 + [429] * 10
    assert len(engine.bodies) == 10
    proxy.assert_idle()


async def test_stream_without_include_usage_is_byte_identical(
    start_proxy: Start, engine_url: str, engine: Engine, clock: FakeClock
) -> None:
    """The proxy asks the engine for usage and removes what that added: the quota tenant's
    stream is byte for byte the stream a tenant without a quota gets, and the charge is
    the usage the engine reported."""
    proxy = await start_proxy(quota_config(engine_url, {"per_day": 10_000}), quota_clock=clock)
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 7, "stream": True}
    status_a, headers_a, stream_a = await chat(proxy, body, KEY_A)
    status_b, _, stream_b = await chat(proxy, body, KEY_B)
    assert status_a == status_b == 200
    assert stream_a == stream_b
    assert b'"usage"' not in stream_a and stream_a.endswith(b"data: [DONE]\n\n")
    assert engine.bodies[0]["stream_options"] == {"include_usage": True}
    assert "stream_options" not in engine.bodies[1]
    # Headers of a stream are the state at admission; the settlement follows.
    assert int(headers_a["x-ratelimit-remaining-tokens"]) == 10_000 - estimate_of(body, 7)
    await wait_for(lambda: not proxy.runtime.active)
    state = await (await proxy.client.get("/admin/state")).json()
    assert state["tenants"]["a"]["quota"]["used"] == 10 + 7


async def test_stream_with_include_usage_keeps_its_usage_chunk(
    start_proxy: Start, engine_url: str, engine: Engine, clock: FakeClock
) -> None:
    """A client that asked for usage gets the engine's stream unchanged, usage chunk included."""
    proxy = await start_proxy(quota_config(engine_url, {"per_day": 10_000}), quota_clock=clock)
    body = {
        "messages": [],
        "max_tokens": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    _, _, stream_a = await chat(proxy, body, KEY_A)
    _, _, stream_b = await chat(proxy, body, KEY_B)
    assert stream_a == stream_b
    assert b'"choices":[],"usage":{"prompt_tokens":10' in stream_a
    assert engine.bodies[0] == engine.bodies[1]
    await wait_for(lambda: not proxy.runtime.active)
    state = await (await proxy.client.get("/admin/state")).json()
    assert state["tenants"]["a"]["quota"]["used"] == 13


async def test_stream_without_any_usage_counts_content_chunks(
    start_proxy: Start, engine_url: str, clock: FakeClock
) -> None:
    """An engine that reports no usage: the prompt estimate plus one per streamed chunk."""
    log = io.StringIO()
    config = quota_config(engine_url, {"per_day": 10_000})
    proxy = await start_proxy(config, quota_clock=clock, access_log=log)
    body = {"messages": [], "max_tokens": 100, "generate": 6, "stream": True, "no_usage": True}
    assert (await chat(proxy, body))[0] == 200
    await wait_for(lambda: bool(log.getvalue()))
    line = json.loads(log.getvalue())
    # Six content chunks; the finishing chunk (an empty delta with its reason) is none.
    assert line["quota_actual_tokens"] == len(json.dumps(body)) // 4 + 6


async def test_client_leaving_mid_stream_is_charged_what_it_got(
    start_proxy: Start, engine_url: str, clock: FakeClock
) -> None:
    """A stream that stalls after 3 tokens and whose client leaves: charged the prompt
    estimate and the 3 chunks generated, not the 500 it asked for."""
    log = io.StringIO()
    config = quota_config(engine_url, {"per_day": 10_000})
    proxy = await start_proxy(config, quota_clock=clock, access_log=log)
    body = {"messages": [], "max_tokens": 500, "stream": True, "stall_after": 3}
    async with aiohttp.ClientSession() as session:
        response = await session.post(
            proxy.url + CHAT, json=body, headers={"Authorization": f"Bearer {KEY_A}"}
        )
        seen = b""
        async with asyncio.timeout(10):
            while seen.count(b'"content"') < 3:
                seen += await response.content.readany()
        response.close()
    await wait_for(lambda: bool(log.getvalue()), timeout_s=10)
    line = json.loads(log.getvalue())
    assert line["status"] == 499
    assert line["quota_charged_tokens"] == len(json.dumps(body)) // 4 + 500
    assert line["quota_actual_tokens"] == len(json.dumps(body)) // 4 + 3
    await wait_for(lambda: proxy.runtime.dispatcher.total_inflight() == 0, timeout_s=10)


async def test_reload_changes_the_quota_and_keeps_the_use(
    start_proxy: Start, engine_url: str, clock: FakeClock
) -> None:
    """Use 60 of 100 a day, reload to 200: 140 left, not 200 (nor 100 - 60 of the old)."""
    proxy = await start_proxy(quota_config(engine_url, {"per_day": 100}), quota_clock=clock)
    assert (await chat(proxy, {"messages": [], "max_tokens": 50}))[0] == 200
    apply_config(proxy.runtime, quota_config(engine_url, {"per_day": 200}))
    _, headers, _ = await chat(proxy, {"messages": [], "max_tokens": 10, "generate": 0})
    assert headers["x-ratelimit-limit-tokens"] == "200"
    assert headers["x-ratelimit-remaining-tokens"] == str(200 - 60 - 10)


async def test_headers_and_metric_for_rate_and_quota(
    start_proxy: Start, engine_url: str, clock: FakeClock
) -> None:
    """rate_per_s 0.01 (burst 2) and a minute quota: both header families on a success and on
    a rate_limited refusal; the gauge has the tenant's minute window."""
    config = quota_config(engine_url, {"per_minute": 1000}, rate_per_s=0.01, burst=2)
    proxy = await start_proxy(config, quota_clock=clock)
    body = {"messages": [], "max_tokens": 10, "generate": 10}
    _, headers, _ = await chat(proxy, body)
    assert headers["x-ratelimit-limit-requests"] == "2"
    assert headers["x-ratelimit-remaining-requests"] == "1"
    assert headers["x-ratelimit-remaining-tokens"] == "980"
    await chat(proxy, body)
    status, headers, _ = await chat(proxy, body)
    assert status == 429 and headers["X-Admission-Reason"] == "rate_limited"
    assert headers["x-ratelimit-remaining-requests"] == "0"
    assert headers["x-ratelimit-remaining-tokens"] == "960"
    text = await (await proxy.client.get("/metrics")).text()
    assert 'admission_quota_remaining_tokens{tenant="a",window="minute"} 960.0' in text
    status, headers, _ = await chat(proxy, body, KEY_B)
    assert not [h for h in headers if h.startswith("x-ratelimit")]  # b is unlimited


async def test_day_rollover_refills_the_day_and_the_gauge(
    start_proxy: Start, engine_url: str, clock: FakeClock
) -> None:
    """The gauge and /admin/state show a new day's full quota after 00:00 UTC."""
    proxy = await start_proxy(quota_config(engine_url, {"per_day": 500}), quota_clock=clock)
    await chat(proxy, {"messages": [], "max_tokens": 10, "generate": 90})
    state = await (await proxy.client.get("/admin/state")).json()
    assert state["tenants"]["a"]["quota"]["used"] == 100
    clock.advance(90)
    assert int(BEFORE_MIDNIGHT + 90) % DAY_S == 0
    state = await (await proxy.client.get("/admin/state")).json()
    assert state["tenants"]["a"]["quota"]["used"] == 0
    text = await (await proxy.client.get("/metrics")).text()
    assert 'admission_quota_remaining_tokens{tenant="a",window="day"} 500.0' in text


async def test_refused_after_the_charge_is_refunded(
    start_proxy: Start, engine_url: str, clock: FakeClock
) -> None:
    """Charged, then refused by the queue stage (every replica drained: 503
    no_healthy_replica): nothing is used, and the refusal's headers say so."""
    log = io.StringIO()
    config = quota_config(engine_url, {"per_day": 1000})
    proxy = await start_proxy(config, quota_clock=clock, access_log=log)
    assert (await proxy.client.post("/admin/replicas/r0/drain")).status == 200
    body = {"messages": [], "max_tokens": 50}
    status, headers, _ = await chat(proxy, body)
    assert status == 503 and headers["X-Admission-Reason"] == "no_healthy_replica"
    assert headers["x-ratelimit-remaining-tokens"] == "1000"
    await wait_for(lambda: bool(log.getvalue()))
    line = json.loads(log.getvalue())
    assert (line["quota_charged_tokens"], line["quota_actual_tokens"]) == (estimate_of(body, 50), 0)
    proxy.assert_idle()


async def test_embeddings_are_estimated_without_output(
    start_proxy: Start, engine_url: str, clock: FakeClock
) -> None:
    """An embeddings request generates nothing: charged its prompt estimate only."""
    log = io.StringIO()
    proxy = await start_proxy(
        quota_config(engine_url, {"per_day": 1000}), quota_clock=clock, access_log=log
    )
    body = {"input": "x" * 400}
    response = await proxy.client.post(
        "/v1/embeddings", json=body, headers={"Authorization": f"Bearer {KEY_A}"}
    )
    assert response.status == 200
    await wait_for(lambda: bool(log.getvalue()))
    assert json.loads(log.getvalue())["quota_charged_tokens"] == len(json.dumps(body)) // 4


@pytest.mark.parametrize(
    ("path", "body", "output"),
    [
        ("/embedding", b'{"content": "' + b"x" * 400 + b'"}', 0),  # llama.cpp's own embeddings
        ("/v1/rerank", b'{"query": "q", "documents": ["' + b"d" * 300 + b'"]}', 0),
        ("/rerank", b'{"query": "q", "documents": ["' + b"d" * 300 + b'"]}', 0),
        ("/completion", b'{"prompt": "' + b"p" * 200 + b'", "n_predict": 9}', 9),
        ("/infill", b'{"input_prefix": "def f(", "n_predict": 3}', 3),
        # Not JSON: forwarded as before (the engine judges it), charged by its bytes and
        # the tenant's expected output (256 before any answer), never a 400 here.
        ("/completions", b"prompt=" + b"q" * 100, 256),
    ],
)
async def test_every_route_an_engine_spends_tokens_on_is_charged(
    start_proxy: Start, engine_url: str, clock: FakeClock, path: str, body: bytes, output: int
) -> None:
    """llama.cpp's own API and the rerank and embedding routes take seats like the OpenAI
    routes: a tenant's token quota charges them too (they used to pass uncharged)."""
    log = io.StringIO()
    proxy = await start_proxy(
        quota_config(engine_url, {"per_day": 1000}), quota_clock=clock, access_log=log
    )
    headers = {"Authorization": f"Bearer {KEY_A}", "Content-Type": "application/json"}
    async with proxy.client.post(path, data=body, headers=headers) as response:
        assert response.status == 200
        assert "x-ratelimit-remaining-tokens" in response.headers
    await wait_for(lambda: bool(log.getvalue()))
    assert json.loads(log.getvalue())["quota_charged_tokens"] == len(body) // 4 + output
    proxy.assert_idle()


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("texts", "samples"), [(1, 1), (3, 1), (1, 3), (2, 3)])
async def test_sglang_batch_is_charged_every_answer(
    start_proxy: Start,
    engine_url: str,
    clock: FakeClock,
    stream: bool,
    texts: int,
    samples: int,
) -> None:
    """SGLang's ``/generate`` with a list of texts answers each, ``n`` times each:
    charged its ``max_new_tokens`` per answer at admission and settled to every
    answer's generated tokens plus each text's prompt once (``meta_info``; a stream:
    each answer's last counts). It was charged one text's output and settled to one
    answer's counts; then, with ``n``, each text's prompt was charged ``n`` times
    (SGLang prefills it once, and its own OpenAI usage counts it once)."""
    log = io.StringIO()
    proxy = await start_proxy(
        quota_config(engine_url, {"per_day": 10_000}), quota_clock=clock, access_log=log
    )
    text: Any = [f"text {i}" for i in range(texts)] if texts > 1 else "text"
    sampling = {"max_new_tokens": 4} | ({"n": samples} if samples > 1 else {})
    body = {"text": text, "sampling_params": sampling, "stream": stream}
    async with proxy.client.post(
        "/generate", json=body, headers={"Authorization": f"Bearer {KEY_A}"}
    ) as response:
        assert response.status == 200
        await response.read()
    await wait_for(lambda: bool(log.getvalue()))
    line = json.loads(log.getvalue())
    answers = texts * samples
    assert line["quota_charged_tokens"] == estimate_of(body, 4 * answers)
    assert (line["input_tokens"], line["output_tokens"]) == (5 * texts, 4 * answers)
    assert line["quota_actual_tokens"] == 5 * texts + 4 * answers
    if stream:
        assert line["ttft_ms"] is not None
    proxy.assert_idle()


async def test_a_request_larger_than_the_whole_quota_is_told_it_can_never_fit(
    start_proxy: Start, engine_url: str, clock: FakeClock
) -> None:
    """per_minute 100 and max_tokens 500: no wait would ever admit it, so the 429 says
    so (and what to change) instead of sending the client back in a minute for ever;
    a request that only has to wait is told it is over its quota, as before."""
    proxy = await start_proxy(quota_config(engine_url, {"per_minute": 100}), quota_clock=clock)
    status, headers, body = await chat(proxy, {"messages": [], "max_tokens": 500})
    assert status == 429 and headers["X-Admission-Reason"] == "token_quota_exceeded"
    message = json.loads(body)["error"]["message"]
    assert "more than the whole token quota per minute of tenant 'a' (100)" in message
    assert "can never be admitted" in message and "max_tokens" in message
    assert (await chat(proxy, {"messages": [], "max_tokens": 80}))[0] == 200
    status, _, body = await chat(proxy, {"messages": [], "max_tokens": 80})
    assert status == 429
    assert "is over its token quota per minute" in json.loads(body)["error"]["message"]
    proxy.assert_idle()
