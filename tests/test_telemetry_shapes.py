"""Telemetry an operator relies on in an incident, request shape by request shape.

A live proxy in front of simulator replicas (or the scripted test upstream
where a shape needs a precise failure), the real OpenTelemetry SDK with an
in-memory exporter, the access log on a stream, and ``/metrics`` read with
prometheus-client's parser. For every shape, ``Watch.settle`` checks what all
shapes share: one access line with every field typed, one ``proxy.request``
span that says the same, one count in the line's bucket. Each test then checks
what its shape adds.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from aiohttp import web
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import SpanKind

from proxy.sim import SimConfig, SimServer, start_sim
from tests.conftest import ProxyUnderTest
from tests.helpers import KEY_A, KEY_B, make_config, wait_for
from tests.telemetry_watch import Samples, Seen, Watch, delta

Start = Callable[..., Awaitable[ProxyUnderTest]]
CHAT = "/v1/chat/completions"
AUTH = {"Authorization": f"Bearer {KEY_A}"}
MSG = [{"role": "user", "content": "hello"}]
INCOMING = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@pytest.fixture
async def sim() -> AsyncIterator[SimServer]:
    server = await start_sim(SimConfig(slots=4, decode_base_ms=2.0, decode_per_seq_ms=0.5))
    try:
        yield server
    finally:
        await server.close()


@pytest.fixture
def watch() -> Watch:
    return Watch()


async def started(start_proxy: Start, watch: Watch, config: Any, **kwargs: Any) -> ProxyUnderTest:
    proxy = await start_proxy(config, **watch.kwargs(), **kwargs)
    watch.proxy = proxy
    await watch.mark()
    return proxy


def names(one: Seen) -> set[str]:
    return {span.name for span in one.spans}


def attrs(span: ReadableSpan) -> dict[str, Any]:
    return dict(span.attributes or {})


def waits(before: Samples, after: Samples) -> dict[str, float]:
    """``admission_wait_seconds`` observations added, by layer."""
    out: dict[str, float] = {}
    for labels, change in delta(before, after, "admission_wait_seconds_count").items():
        layer = dict(labels)["layer"]
        out[layer] = out.get(layer, 0.0) + change
    return out


def by(before: Samples, after: Samples, name: str, label: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for labels, change in delta(before, after, name).items():
        key = dict(labels).get(label, "")
        out[key] = out.get(key, 0.0) + change
    return out


async def test_completed_request(start_proxy: Start, sim: SimServer, watch: Watch) -> None:
    """A completed answer: the whole tree, parented on the client's trace, engine timing;
    every wait layer once, tokens as logged, goodput once."""
    proxy = await started(start_proxy, watch, make_config([sim.url]))
    resp = await proxy.client.post(
        CHAT, json={"messages": MSG, "max_tokens": 5}, headers={**AUTH, "traceparent": INCOMING}
    )
    assert resp.status == 200
    (one,), before, after = await watch.settle()
    line, root = one.line, one.root
    assert line["trace_id"] == INCOMING.split("-")[1]
    assert root.parent is not None and format(root.parent.span_id, "016x") == INCOMING.split("-")[2]
    assert names(one) == {
        "proxy.request", "proxy.entrance", "proxy.queue", "proxy.upstream", "proxy.batch",
        "proxy.gpu",
    }  # fmt: skip
    assert root.kind is SpanKind.SERVER and one.one("proxy.upstream").kind is SpanKind.CLIENT
    for name in ("proxy.entrance", "proxy.queue", "proxy.batch", "proxy.gpu"):
        assert one.one(name).kind is SpanKind.INTERNAL
    assert attrs(root)["url.path"] == CHAT
    upstream = attrs(one.one("proxy.upstream"))
    assert upstream == {
        "admission.replica": "r0", "admission.attempt": 1, "http.response.status_code": 200,
    }  # fmt: skip
    assert attrs(one.one("proxy.batch")) == {"admission.timing_source": "engine"}
    gpu = attrs(one.one("proxy.gpu"))
    assert gpu["admission.timing_source"] == "engine"
    assert gpu["gen_ai.usage.input_tokens"] == line["input_tokens"]
    assert gpu["gen_ai.usage.output_tokens"] == line["output_tokens"] == 5
    queue = attrs(one.one("proxy.queue"))
    assert queue["admission.queue.wait_ms"] == line["queue_ms"]
    assert set(queue) == {"admission.queue.depth_at_enqueue", "admission.queue.wait_ms"}
    assert line["attempts"] == 1 and line["replica"] == "r0" and line["status"] == 200
    assert line["entrance_ms"] is not None and line["upstream_ms"] is not None
    assert waits(before, after) == {"entrance": 1, "queue": 1, "first_byte": 1}
    assert by(before, after, "admission_tokens_total", "direction") == {
        "input": line["input_tokens"], "output": 5,
    }  # fmt: skip
    assert by(before, after, "admission_goodput_total", "tenant") == {"a": 1}
    assert by(before, after, "admission_request_duration_seconds_count", "outcome") == {
        "completed": 1
    }
    assert not delta(before, after, "admission_timeouts_total")


async def test_streamed_request(start_proxy: Start, sim: SimServer, watch: Watch) -> None:
    """A stream: batch from the engine's queue time, GPU measured here; TTFT logged and
    observed; goodput once."""
    proxy = await started(start_proxy, watch, make_config([sim.url]))
    resp = await proxy.client.post(
        CHAT, json={"messages": MSG, "max_tokens": 5, "stream": True}, headers=AUTH
    )
    await resp.read()
    (one,), before, after = await watch.settle()
    line = one.line
    assert attrs(one.one("proxy.batch")) == {"admission.timing_source": "engine"}
    gpu = attrs(one.one("proxy.gpu"))
    assert gpu["admission.timing_source"] == "proxy"
    assert gpu["gen_ai.usage.output_tokens"] == line["output_tokens"] == 5
    # GenAI's time to first chunk: request sent to the stream's first chunk, in s (the
    # attempt's span covers exactly that); the first token is the proxy's own attribute.
    upstream = one.one("proxy.upstream")
    assert upstream.start_time is not None and upstream.end_time is not None
    first_chunk_s = (upstream.end_time - upstream.start_time) / 1e9
    assert gpu["gen_ai.response.time_to_first_chunk"] == pytest.approx(first_chunk_s, abs=1e-5)
    assert gpu["admission.time_to_first_token"] >= gpu["gen_ai.response.time_to_first_chunk"]
    assert line["ttft_ms"] is not None and line["ttft_ms"] >= line["upstream_ms"]
    assert by(before, after, "admission_ttft_seconds_count", "tenant") == {"a": 1}
    assert by(before, after, "admission_goodput_total", "tenant") == {"a": 1}
    assert waits(before, after) == {"entrance": 1, "queue": 1, "first_byte": 1}


@pytest.mark.parametrize(
    ("path", "headers", "body", "status", "reason"),
    [
        (CHAT, {}, {}, 401, "unauthenticated"),
        (CHAT, {"Authorization": "Bearer sk-not-a-key"}, {}, 401, "unauthenticated"),
        (CHAT, {**AUTH, "X-Priority": "batch"}, {}, 403, "priority_not_allowed"),
        (CHAT, {**AUTH, "X-Priority": "nope"}, {}, 400, "bad_request"),
        ("/sim/faults", AUTH, {}, 404, "route_not_allowed"),
        (CHAT, AUTH, {"x": "y" * 3000}, 413, "body_too_large"),
        (CHAT, AUTH, None, 400, "bad_request"),
    ],
)
async def test_refused_at_the_entrance(
    start_proxy: Start,
    sim: SimServer,
    watch: Watch,
    path: str,
    headers: dict[str, str],
    body: Any,
    status: int,
    reason: str,
) -> None:
    """Refused at the entrance: proxy.request and proxy.entrance only; the time the
    entrance took is logged and observed in the entrance layer, like every request's."""
    config = make_config([sim.url], server={"max_body_bytes": 2000})
    proxy = await started(start_proxy, watch, config)
    if body is None:
        resp = await proxy.client.post(path, data=b"{not json", headers=headers)
    else:
        resp = await proxy.client.post(path, json=body, headers=headers)
    assert (resp.status, resp.headers["X-Admission-Reason"]) == (status, reason)
    (one,), before, after = await watch.settle()
    line = one.line
    assert names(one) == {"proxy.request", "proxy.entrance"}
    assert (line["status"], line["outcome"], line["reason"]) == (status, "rejected", reason)
    assert line["entrance_ms"] is not None and line["entrance_ms"] <= line["total_ms"]
    assert line["queue_ms"] is line["upstream_ms"] is line["ttft_ms"] is None
    assert line["attempts"] == 0 and line["replica"] is None
    assert waits(before, after) == {"entrance": 1}
    assert not delta(before, after, "admission_goodput_total")
    assert not delta(before, after, "admission_timeouts_total")


async def test_rate_limited(start_proxy: Start, sim: SimServer, watch: Watch) -> None:
    tenants = {"a": {"api_keys": [KEY_A], "rate_per_s": 0.01, "burst": 1}}
    proxy = await started(start_proxy, watch, make_config([sim.url], tenants=tenants))
    statuses = []
    for _ in range(2):
        resp = await proxy.client.post(CHAT, json={"messages": MSG, "max_tokens": 2}, headers=AUTH)
        await resp.read()
        statuses.append(resp.status)
    assert statuses == [200, 429]
    (_, refused), before, after = await watch.settle(2)
    assert (refused.line["outcome"], refused.line["reason"]) == ("rejected", "rate_limited")
    assert names(refused) == {"proxy.request", "proxy.entrance"}
    assert refused.line["entrance_ms"] is not None
    assert waits(before, after) == {"entrance": 2, "queue": 1, "first_byte": 1}


async def test_entrance_timeout(start_proxy: Start, upstream_url: str, watch: Watch) -> None:
    """A body that never finishes: 408, the entrance's whole wait logged and observed, one
    entrance timeout."""
    config = make_config([upstream_url], server={"entrance_ms": 200})
    proxy = await started(start_proxy, watch, config)
    host, port = proxy.client.server.host, proxy.client.server.port
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(
        f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY_A}\r\n"
        "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{".encode()
    )
    await writer.drain()
    async with asyncio.timeout(5):
        head = await reader.readuntil(b"\r\n\r\n")
    writer.close()
    assert head.startswith(b"HTTP/1.1 408")
    # Server-Timing says where the time went: all of it at the entrance.
    timing = next(h for h in head.split(b"\r\n") if h.lower().startswith(b"server-timing:"))
    entrance = float(timing.split(b"entrance;dur=")[1].split(b",")[0])
    assert entrance >= 200
    (one,), before, after = await watch.settle()
    line = one.line
    assert (line["outcome"], line["reason"]) == ("timed_out", "entrance_timeout")
    assert line["status"] == 408
    assert line["entrance_ms"] is not None and line["entrance_ms"] >= 200
    assert waits(before, after) == {"entrance": 1}
    observed = delta(before, after, "admission_wait_seconds_sum")
    assert observed[(("layer", "entrance"), ("tenant", "a"))] >= 0.2
    assert by(before, after, "admission_timeouts_total", "layer") == {"entrance": 1}


async def test_queue_timeout(start_proxy: Start, upstream_url: str, watch: Watch) -> None:
    """Left the queue at its budget: the queue span and layer carry the whole wait."""
    config = make_config([upstream_url], seats=1, budgets={"queue_ms": 200})
    proxy = await started(start_proxy, watch, config)
    holder = asyncio.ensure_future(proxy.client.post(CHAT, json={"hang_ms": 1000}, headers=AUTH))
    await wait_for(lambda: proxy.runtime.pool.total_inflight() == 1)
    resp = await proxy.client.post(CHAT, json={}, headers={"Authorization": f"Bearer {KEY_B}"})
    assert resp.status == 503
    await (await holder).read()
    seen, before, after = await watch.settle(2)
    (late,) = [s for s in seen if s.line["tenant"] == "b"]
    line = late.line
    assert (line["outcome"], line["reason"]) == ("timed_out", "queue_timeout")
    assert names(late) == {"proxy.request", "proxy.entrance", "proxy.queue"}
    queue = attrs(late.one("proxy.queue"))
    assert queue["admission.queue.wait_ms"] == line["queue_ms"] >= 200
    assert queue["admission.queue.depth_at_enqueue"] == 1
    assert by(before, after, "admission_timeouts_total", "layer") == {"queue": 1}
    b_waits = {
        dict(k)["layer"]: v
        for k, v in delta(before, after, "admission_wait_seconds_count").items()
        if dict(k)["tenant"] == "b"
    }
    assert b_waits == {"entrance": 1, "queue": 1}


async def test_predicted_wait_refusal(start_proxy: Start, upstream_url: str, watch: Watch) -> None:
    """Refused by prediction: no queue span (it never joined the queue), rejected."""
    tenants = {
        "a": {"api_keys": [KEY_A]},
        "b": {"api_keys": [KEY_B], "budgets": {"queue_ms": 1}},
    }
    proxy = await started(start_proxy, watch, make_config([upstream_url], seats=1, tenants=tenants))
    for _ in range(24):  # the estimator learns the seat time
        resp = await proxy.client.post(CHAT, json={"hang_ms": 20}, headers=AUTH)
        assert resp.status == 200
    holder = asyncio.ensure_future(proxy.client.post(CHAT, json={"hang_ms": 1000}, headers=AUTH))
    await wait_for(lambda: proxy.runtime.pool.total_inflight() == 1)
    resp = await proxy.client.post(CHAT, json={}, headers={"Authorization": f"Bearer {KEY_B}"})
    assert resp.headers["X-Admission-Reason"] == "predicted_wait_exceeds_budget"
    await (await holder).read()
    seen, _, _ = await watch.settle(26)
    (refused,) = [s for s in seen if s.line["tenant"] == "b"]
    assert refused.line["outcome"] == "rejected" and refused.line["status"] == 503
    assert names(refused) == {"proxy.request", "proxy.entrance"}


async def test_retried_request(start_proxy: Start, sim: SimServer, watch: Watch) -> None:
    """One proxy.upstream per attempt, numbered, the retry's reason on the second, one
    proxy.backoff between them; one retry counted."""
    retry = {"base_backoff_ms": 5, "max_backoff_ms": 10}
    proxy = await started(start_proxy, watch, make_config([sim.url], retry=retry))
    await sim.set_faults(error_rate=1.0, error_status=503)
    resp = await proxy.client.post(CHAT, json={"messages": MSG}, headers=AUTH)
    assert resp.status == 503
    (one,), before, after = await watch.settle()
    line = one.line
    assert (line["outcome"], line["reason"], line["attempts"]) == ("failed", "upstream_status", 2)
    first, second = one.named("proxy.upstream")
    assert attrs(first) == {
        "admission.replica": "r0", "admission.attempt": 1, "http.response.status_code": 503,
    }  # fmt: skip
    assert attrs(second)["admission.attempt"] == 2
    assert attrs(second)["admission.retry_reason"] == "http_503"
    (backoff,) = one.named("proxy.backoff")
    assert first.end_time is not None and second.start_time is not None
    assert backoff.start_time is not None and backoff.end_time is not None
    assert first.end_time <= backoff.start_time <= backoff.end_time <= second.start_time
    assert "proxy.batch" not in names(one) and "proxy.gpu" not in names(one)
    assert by(before, after, "admission_retries_total", "reason") == {"http_503": 1}
    assert not delta(before, after, "admission_goodput_total")


async def test_each_attempt_sends_its_own_traceparent(
    start_proxy: Start, aiohttp_server: Any, watch: Watch
) -> None:
    """The replica sees, on each attempt, the traceparent naming that attempt's span."""
    sent: list[str] = []

    async def flaky(request: web.Request) -> web.Response:
        sent.append(request.headers["traceparent"])
        if len(sent) == 1:
            return web.json_response({"error": {"message": "busy"}}, status=503)
        usage = {"prompt_tokens": 2, "completion_tokens": 1}
        return web.json_response({"choices": [], "usage": usage})

    async def listing(request: web.Request) -> web.Response:
        return web.json_response({"data": []})

    app = web.Application()
    app.router.add_post(CHAT, flaky)
    app.router.add_route("*", "/{tail:.*}", listing)
    server = await aiohttp_server(app)
    retry = {"base_backoff_ms": 5, "max_backoff_ms": 10}
    config = make_config([str(server.make_url("")).rstrip("/")], retry=retry)
    proxy = await started(start_proxy, watch, config)
    resp = await proxy.client.post(CHAT, json={}, headers={**AUTH, "traceparent": INCOMING})
    assert resp.status == 200
    (one,), _, _ = await watch.settle()
    attempts = one.named("proxy.upstream")
    assert len(attempts) == len(sent) == 2
    for span, header in zip(attempts, sent, strict=True):
        _, trace_id, span_id, _ = header.split("-")
        assert trace_id == INCOMING.split("-")[1]
        assert span_id == format(span.context.span_id, "016x")
    # The answering attempt's engine spans; the request completed after a retry.
    assert {"proxy.batch", "proxy.gpu", "proxy.backoff"} <= names(one)


async def test_cancelled_in_the_queue(start_proxy: Start, upstream_url: str, watch: Watch) -> None:
    proxy = await started(start_proxy, watch, make_config([upstream_url], seats=1))
    holder = asyncio.ensure_future(proxy.client.post(CHAT, json={"hang_ms": 800}, headers=AUTH))
    await wait_for(lambda: proxy.runtime.pool.total_inflight() == 1)
    waiter = asyncio.ensure_future(
        proxy.client.post(CHAT, json={}, headers={"Authorization": f"Bearer {KEY_B}"})
    )
    await wait_for(lambda: len(proxy.runtime.dispatcher.scheduler) == 1)
    waiter.cancel()
    await (await holder).read()
    seen, before, after = await watch.settle(2)
    (left,) = [s for s in seen if s.line["tenant"] == "b"]
    line = left.line
    assert (line["status"], line["outcome"], line["reason"]) == (
        499, "cancelled", "client_disconnected",
    )  # fmt: skip
    assert names(left) == {"proxy.request", "proxy.entrance", "proxy.queue"}
    assert line["queue_ms"] is not None and line["attempts"] == 0
    assert not delta(before, after, "admission_timeouts_total")


async def test_cancelled_mid_stream(start_proxy: Start, upstream_url: str, watch: Watch) -> None:
    proxy = await started(start_proxy, watch, make_config([upstream_url]))
    resp = await proxy.client.post(
        CHAT, json={"stream": True, "max_tokens": 50, "gap_ms": 50}, headers=AUTH
    )
    await resp.content.readline()
    resp.close()
    (one,), before, after = await watch.settle()
    line = one.line
    assert (line["status"], line["outcome"]) == (499, "cancelled")
    assert attrs(one.one("proxy.upstream"))["http.response.status_code"] == 200
    assert not delta(before, after, "admission_goodput_total")
    assert waits(before, after) == {"entrance": 1, "queue": 1, "first_byte": 1}


@pytest.mark.parametrize(
    ("body", "outcome", "reason", "layer"),
    [
        ({"cut_after": 2}, "failed", "upstream_protocol_error", None),
        ({"pause_after": 2, "pause_ms": 1500}, "timed_out", "idle_timeout", "idle"),
    ],
)
async def test_broken_mid_stream(
    start_proxy: Start,
    upstream_url: str,
    watch: Watch,
    body: dict[str, Any],
    outcome: str,
    reason: str,
    layer: str | None,
) -> None:
    """A stream that breaks after the commit point: counted under the failure, its
    timeout layer once; the attempt itself answered 200."""
    config = make_config([upstream_url], timeouts={"idle_ms": 200})
    proxy = await started(start_proxy, watch, config)
    body = {"stream": True, "max_tokens": 5, **body}
    resp = await proxy.client.post(CHAT, json=body, headers=AUTH)
    assert resp.status == 200
    assert reason.encode() in await resp.read()
    (one,), before, after = await watch.settle()
    line = one.line
    assert (line["outcome"], line["reason"]) == (outcome, reason)
    # The client was sent 200 and then the SSE error event: the status is the one sent
    # (as for a stream the shutdown cuts), the outcome and reason say what broke.
    assert line["status"] == 200 and attrs(one.root)["http.response.status_code"] == 200
    assert line["ttft_ms"] is not None and line["output_tokens"] == 2
    assert attrs(one.one("proxy.upstream"))["http.response.status_code"] == 200
    assert one.root.status.status_code.name == "ERROR"
    timeouts = by(before, after, "admission_timeouts_total", "layer")
    assert timeouts == ({} if layer is None else {layer: 1})
    assert not delta(before, after, "admission_goodput_total")


async def test_first_byte_timeout(start_proxy: Start, upstream_url: str, watch: Watch) -> None:
    """No first byte within first_byte_ms: the attempt's span says why; the wait for the
    first byte is observed in its layer like one that ended with a byte."""
    config = make_config([upstream_url], budgets={"first_byte_ms": 200}, retry={"max_attempts": 1})
    proxy = await started(start_proxy, watch, config)
    resp = await proxy.client.post(CHAT, json={"stream": True, "hang_ms": 1500}, headers=AUTH)
    assert resp.status == 504
    (one,), before, after = await watch.settle()
    assert (one.line["outcome"], one.line["reason"]) == ("timed_out", "first_byte_timeout")
    upstream = one.one("proxy.upstream")
    assert attrs(upstream)["error.type"] == "first_byte_timeout"
    assert upstream.status.status_code.name == "ERROR"
    assert by(before, after, "admission_timeouts_total", "layer") == {"first_byte": 1}
    assert waits(before, after) == {"entrance": 1, "queue": 1, "first_byte": 1}
    observed = delta(before, after, "admission_wait_seconds_sum")
    assert observed[(("layer", "first_byte"), ("tenant", "a"))] >= 0.2


async def test_shutting_down(start_proxy: Start, upstream_url: str, watch: Watch) -> None:
    """Arrivals and queued tickets answered shutting_down: rejected, once each."""
    proxy = await started(start_proxy, watch, make_config([upstream_url], seats=1))
    holder = asyncio.ensure_future(proxy.client.post(CHAT, json={"hang_ms": 500}, headers=AUTH))
    await wait_for(lambda: proxy.runtime.pool.total_inflight() == 1)
    waiter = asyncio.ensure_future(
        proxy.client.post(CHAT, json={}, headers={"Authorization": f"Bearer {KEY_B}"})
    )
    await wait_for(lambda: len(proxy.runtime.dispatcher.scheduler) == 1)
    proxy.runtime.begin_shutdown()
    late = await proxy.client.post(CHAT, json={}, headers={"Authorization": f"Bearer {KEY_B}"})
    assert (await waiter).status == late.status == 503
    await (await holder).read()
    seen, _, _ = await watch.settle(3)
    refused = [s for s in seen if s.line["tenant"] == "b"]
    assert len(refused) == 2
    for one in refused:
        assert (one.line["outcome"], one.line["reason"]) == ("rejected", "shutting_down")
    assert sorted(len(one.spans) for one in refused) == [2, 3]  # arrival; queued


async def test_goodput_leaves_out_a_late_first_token(
    start_proxy: Start, upstream_url: str, watch: Watch
) -> None:
    """A completed stream whose first token came after first_byte_ms (its first byte in
    time) is completed but not goodput; a timely one is both."""
    config = make_config([upstream_url], budgets={"first_byte_ms": 300})
    proxy = await started(start_proxy, watch, config)
    for gap in (0, 600):
        body = {"stream": True, "max_tokens": 1, "gap_ms": gap}
        resp = await proxy.client.post(CHAT, json=body, headers=AUTH)
        await resp.read()
        assert resp.status == 200
    seen, before, after = await watch.settle(2)
    assert [s.line["outcome"] for s in seen] == ["completed", "completed"]
    assert seen[1].line["ttft_ms"] >= 600
    assert by(before, after, "admission_goodput_total", "tenant") == {"a": 1}


@pytest.mark.parametrize("ending", ["cancelled", "broken"])
async def test_a_stream_that_started_has_its_engine_spans(
    start_proxy: Start, sim: SimServer, watch: Watch, ending: str
) -> None:
    """The engine queued and computed for a stream its client left, or that broke off
    after its first tokens: proxy.batch and proxy.gpu show it, as for a completed one."""
    proxy = await started(start_proxy, watch, make_config([sim.url]))
    if ending == "broken":
        await sim.set_faults(reset_mid_stream_after_tokens=2)
    body = {"messages": MSG, "max_tokens": 200, "stream": True}
    resp = await proxy.client.post(CHAT, json=body, headers=AUTH)
    assert resp.status == 200
    if ending == "cancelled":
        seen = b""
        async with asyncio.timeout(5):
            while seen.count(b'"content"') < 3:
                seen += await resp.content.readany()
        resp.close()
    else:
        await resp.read()
    (one,), _, _ = await watch.settle()
    assert one.line["outcome"] == ("cancelled" if ending == "cancelled" else "failed")
    assert attrs(one.one("proxy.batch")) == {"admission.timing_source": "engine"}
    gpu = attrs(one.one("proxy.gpu"))
    assert gpu["admission.timing_source"] == "proxy"
    assert "gen_ai.response.time_to_first_chunk" in gpu


async def test_many_requests_of_every_shape_at_once(
    start_proxy: Start, upstream_url: str, watch: Watch
) -> None:
    """Sixty requests at once, completing, queue-timing out, timing out upstream, broken
    mid-stream, refused: one line, one root span and one count each, in matching
    buckets (``Watch.settle``), and the timeouts counted once per timed-out line."""
    config = make_config(
        [upstream_url],
        seats=2,
        budgets={"queue_ms": 300, "first_byte_ms": 200},
        timeouts={"idle_ms": 200},
        retry={"max_attempts": 1},
        tenants={
            "a": {"api_keys": [KEY_A], "queue_capacity": 64},
            "b": {"api_keys": [KEY_B], "queue_capacity": 64},
        },
    )
    proxy = await started(start_proxy, watch, config)
    shapes: list[tuple[dict[str, str], dict[str, Any]]] = [
        (AUTH, {"max_tokens": 2}),
        (AUTH, {"stream": True, "max_tokens": 3, "gap_ms": 20}),
        (AUTH, {"stream": True, "hang_ms": 600}),
        (AUTH, {"stream": True, "max_tokens": 4, "cut_after": 1}),
        (AUTH, {"stream": True, "max_tokens": 4, "pause_after": 1, "pause_ms": 600}),
        ({"Authorization": "Bearer sk-nobody"}, {}),
        ({"Authorization": f"Bearer {KEY_B}"}, {"hang_ms": 100}),
    ]

    async def send(i: int) -> None:
        headers, body = shapes[i % len(shapes)]
        resp = await proxy.client.post(CHAT, json=body, headers=headers)
        await resp.read()

    await asyncio.gather(*(send(i) for i in range(60)))
    seen, before, after = await watch.settle(60)
    timed_out = [s.line["reason"] for s in seen if s.line["outcome"] == "timed_out"]
    assert timed_out and any(s.line["reason"] == "unauthenticated" for s in seen)
    layers = by(before, after, "admission_timeouts_total", "layer")
    assert sum(layers.values()) == len(timed_out)
    for layer, count in layers.items():
        assert count == sum(1 for reason in timed_out if reason.startswith(layer))
    assert sum(by(before, after, "admission_wait_seconds_count", "layer").values()) == sum(
        1 + (s.line["queue_ms"] is not None) + (s.line["attempts"] > 0) for s in seen
    )


async def test_model_pools_name_the_model_everywhere(
    start_proxy: Start, sim: SimServer, watch: Watch
) -> None:
    """The served model (an alias logged as its target) in the access line, the root
    span's gen_ai.request.model and admission_model_requests_total; a name no pool
    serves is logged as asked and counted under ``unknown``."""
    tenants = {"a": {"api_keys": [KEY_A], "allowed_models": ["sim-model"]}}
    config = make_config([sim.url], tenants=tenants, model_aliases={"mini": "sim-model"})
    proxy = await started(start_proxy, watch, config)
    await wait_for(lambda: bool(proxy.runtime.models.served_models()))
    for model in ("mini", "nope"):
        body = {"model": model, "messages": MSG, "max_tokens": 2}
        await (await proxy.client.post(CHAT, json=body, headers=AUTH)).read()
    (served, missing), before, after = await watch.settle(2)
    assert served.line["model"] == attrs(served.root)["gen_ai.request.model"] == "sim-model"
    assert (missing.line["reason"], missing.line["model"]) == ("model_not_found", "nope")
    assert attrs(missing.root)["gen_ai.request.model"] == "nope"
    counted = {
        (dict(k)["model"], dict(k)["outcome"]): v
        for k, v in delta(before, after, "admission_model_requests_total").items()
    }
    assert counted == {("sim-model", "completed"): 1, ("unknown", "rejected"): 1}


async def test_token_quota_fields_and_gauge(
    start_proxy: Start, sim: SimServer, watch: Watch
) -> None:
    """A quota refusal is charged nothing (null fields); a served request logs its charge
    and its correction, and the gauge shows the quota less the real usage."""
    tenants = {"a": {"api_keys": [KEY_A], "token_quota": {"per_minute": 1000}}}
    proxy = await started(start_proxy, watch, make_config([sim.url], tenants=tenants))
    for max_tokens in (5000, 3):
        body = {"messages": MSG, "max_tokens": max_tokens}
        await (await proxy.client.post(CHAT, json=body, headers=AUTH)).read()
    (refused, served), _, after = await watch.settle(2)
    assert refused.line["reason"] == "token_quota_exceeded"
    assert refused.line["quota_charged_tokens"] is refused.line["quota_actual_tokens"] is None
    used = served.line["input_tokens"] + served.line["output_tokens"]
    assert served.line["quota_actual_tokens"] == used
    assert served.line["quota_charged_tokens"] >= used
    gauge = after[("admission_quota_remaining_tokens", (("tenant", "a"), ("window", "minute")))]
    assert 1000 - used <= gauge <= 1000  # refilling meanwhile
