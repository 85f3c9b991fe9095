"""Spans end to end with an in-memory exporter: the tree, parents, propagation, timing."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from proxy.sim import SimConfig, SimServer, start_sim
from proxy.telemetry.tracing import exporter_from_env
from tests.conftest import ProxyUnderTest
from tests.helpers import KEY_A, make_config, wait_for
from tests.upstreams import Upstream

Start = Callable[..., Awaitable[ProxyUnderTest]]
CHAT = "/v1/chat/completions"
AUTH = {"Authorization": f"Bearer {KEY_A}"}
MSG = [{"role": "user", "content": "hello"}]
INCOMING = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@pytest.fixture
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture
def provider(exporter: InMemorySpanExporter) -> TracerProvider:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider


@pytest.fixture
async def sim() -> AsyncIterator[SimServer]:
    server = await start_sim(SimConfig(slots=4, decode_base_ms=2.0, decode_per_seq_ms=0.5))
    try:
        yield server
    finally:
        await server.close()


def by_name(spans: tuple[ReadableSpan, ...]) -> dict[str, list[ReadableSpan]]:
    out: dict[str, list[ReadableSpan]] = {}
    for span in spans:
        out.setdefault(span.name, []).append(span)
    return out


def ms(span: ReadableSpan) -> float:
    assert span.start_time is not None and span.end_time is not None
    return (span.end_time - span.start_time) / 1e6


async def finished(proxy: ProxyUnderTest, exporter: InMemorySpanExporter) -> dict[str, Any]:
    await wait_for(lambda: not proxy.runtime.active)
    return by_name(exporter.get_finished_spans())


async def test_span_tree_of_a_non_streamed_request(
    start_proxy: Start, sim: SimServer, provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    """Every span of the contract under proxy.request; batch and GPU from engine headers."""
    proxy = await start_proxy(make_config([sim.url]), tracer_provider=provider)
    resp = await proxy.client.post(CHAT, json={"messages": MSG, "max_tokens": 6}, headers=AUTH)
    assert resp.status == 200
    queue_ms = float(resp.headers["x-queue-time"])
    inference_ms = float(resp.headers["x-inference-time"])
    spans = await finished(proxy, exporter)
    (root,) = spans["proxy.request"]
    assert root.kind is SpanKind.SERVER
    assert root.attributes is not None
    assert root.attributes["admission.tenant"] == "a"
    assert root.attributes["admission.outcome"] == "completed"
    assert root.attributes["admission.reason"] == "none"
    root_id = root.context.span_id
    for name in ("proxy.entrance", "proxy.queue", "proxy.upstream", "proxy.batch", "proxy.gpu"):
        (span,) = spans[name]
        assert span.parent is not None and span.parent.span_id == root_id, name
        assert span.context.trace_id == root.context.trace_id
    (upstream,) = spans["proxy.upstream"]
    assert upstream.kind is SpanKind.CLIENT
    assert upstream.attributes is not None
    assert upstream.attributes["admission.replica"] == "r0"
    assert upstream.attributes["http.response.status_code"] == 200
    (batch,) = spans["proxy.batch"]
    (gpu,) = spans["proxy.gpu"]
    assert batch.attributes is not None and gpu.attributes is not None
    assert batch.attributes["admission.timing_source"] == "engine"
    assert gpu.attributes["admission.timing_source"] == "engine"
    assert ms(batch) == pytest.approx(queue_ms, abs=0.01)
    assert ms(gpu) == pytest.approx(inference_ms, abs=0.01)
    assert gpu.attributes["gen_ai.usage.output_tokens"] == 6
    (queue,) = spans["proxy.queue"]
    assert queue.attributes is not None and "admission.queue.wait_ms" in queue.attributes


async def test_streamed_request_measures_gpu_time_itself(
    start_proxy: Start, sim: SimServer, provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    """A stream's headers carry the engine queue time only: batch from the engine,
    GPU measured by the proxy (first token to last chunk)."""
    proxy = await start_proxy(make_config([sim.url]), tracer_provider=provider)
    resp = await proxy.client.post(
        CHAT, json={"messages": MSG, "max_tokens": 6, "stream": True}, headers=AUTH
    )
    await resp.read()
    spans = await finished(proxy, exporter)
    (batch,) = spans["proxy.batch"]
    (gpu,) = spans["proxy.gpu"]
    assert batch.attributes is not None and gpu.attributes is not None
    assert batch.attributes["admission.timing_source"] == "engine"
    assert gpu.attributes["admission.timing_source"] == "proxy"
    assert ms(batch) == pytest.approx(float(resp.headers["x-queue-time"]), abs=0.01)
    assert "gen_ai.response.time_to_first_chunk" in gpu.attributes


async def test_incoming_traceparent_is_the_parent_and_upstream_gets_its_own(
    start_proxy: Start,
    upstream_url: str,
    upstream_state: Upstream,
    provider: TracerProvider,
    exporter: InMemorySpanExporter,
) -> None:
    """proxy.request continues the client's trace; the replica receives the
    traceparent of the proxy.upstream span; without engine timing, both derived
    spans say timing_source=proxy."""
    proxy = await start_proxy(make_config([upstream_url]), tracer_provider=provider)
    resp = await proxy.client.post(
        CHAT, json={"stream": True, "max_tokens": 3}, headers={**AUTH, "traceparent": INCOMING}
    )
    await resp.read()
    spans = await finished(proxy, exporter)
    (root,) = spans["proxy.request"]
    assert format(root.context.trace_id, "032x") == INCOMING.split("-")[1]
    assert root.parent is not None and format(root.parent.span_id, "016x") == INCOMING.split("-")[2]
    (upstream,) = spans["proxy.upstream"]
    sent = upstream_state.seen[-1]["traceparent"]
    _, trace_id, span_id, _ = sent.split("-")
    assert trace_id == INCOMING.split("-")[1]
    assert span_id == format(upstream.context.span_id, "016x")
    for name in ("proxy.batch", "proxy.gpu"):
        (span,) = spans[name]
        assert span.attributes is not None
        assert span.attributes["admission.timing_source"] == "proxy"


async def test_one_upstream_span_per_attempt(
    start_proxy: Start, sim: SimServer, provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    """A retried request has one proxy.upstream span per attempt and a backoff span."""
    retry = {"base_backoff_ms": 5, "max_backoff_ms": 10}
    proxy = await start_proxy(make_config([sim.url], retry=retry), tracer_provider=provider)
    await sim.set_faults(error_rate=1.0, error_status=503)
    resp = await proxy.client.post(CHAT, json={"messages": MSG}, headers=AUTH)
    assert resp.status == 503
    spans = await finished(proxy, exporter)
    attempts = sorted(spans["proxy.upstream"], key=lambda s: s.start_time or 0)
    assert len(attempts) == 2
    assert [s.attributes["admission.attempt"] for s in attempts if s.attributes] == [1, 2]
    assert attempts[1].attributes is not None
    assert attempts[1].attributes["admission.retry_reason"] == "http_503"
    assert len(spans["proxy.backoff"]) == 1
    (root,) = spans["proxy.request"]
    assert root.attributes is not None and root.attributes["admission.reason"] == "upstream_status"


@pytest.mark.parametrize(
    ("path", "headers", "reason"),
    [
        (CHAT, {}, "unauthenticated"),
        (CHAT, {**AUTH, "X-Request-Timeout-Ms": "\u00b2"}, "bad_request"),
        ("/sim/faults", AUTH, "route_not_allowed"),
    ],
)
async def test_refused_at_the_entrance_still_has_an_entrance_span(
    start_proxy: Start,
    upstream_url: str,
    provider: TracerProvider,
    exporter: InMemorySpanExporter,
    path: str,
    headers: dict[str, str],
    reason: str,
) -> None:
    """A request refused before its body was read: proxy.entrance under proxy.request,
    from arrival to the answer, the root marked with the reason."""
    proxy = await start_proxy(make_config([upstream_url]), tracer_provider=provider)
    resp = await proxy.client.post(path, json={}, headers=headers)
    assert resp.headers["X-Admission-Reason"] == reason
    spans = await finished(proxy, exporter)
    (root,) = spans["proxy.request"]
    (entrance,) = spans["proxy.entrance"]
    assert entrance.parent is not None and entrance.parent.span_id == root.context.span_id
    assert root.start_time == entrance.start_time
    assert entrance.end_time is not None and root.end_time is not None
    assert entrance.end_time <= root.end_time
    assert root.attributes is not None and root.attributes["admission.reason"] == reason
    assert "proxy.queue" not in spans and "proxy.upstream" not in spans


async def test_access_line_carries_the_trace_id(
    start_proxy: Start, upstream_url: str, provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    """With tracing on, the access line names the request's trace."""
    import io
    import json

    log = io.StringIO()
    proxy = await start_proxy(make_config([upstream_url]), tracer_provider=provider, access_log=log)
    await proxy.client.post(CHAT, json={}, headers={**AUTH, "traceparent": INCOMING})
    await wait_for(lambda: not proxy.runtime.active)
    (line,) = [json.loads(text) for text in log.getvalue().splitlines()]
    assert line["trace_id"] == INCOMING.split("-")[1]


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, None),
        ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://x"}, None),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}, "OTLPSpanExporter"),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:4318/v1/traces"},
         "OTLPSpanExporter"),
        ({"OTEL_TRACES_EXPORTER": "otlp"}, "OTLPSpanExporter"),
        ({"OTEL_TRACES_EXPORTER": "console"}, "ConsoleSpanExporter"),
    ],
)  # fmt: skip
def test_exporter_follows_the_standard_variables(env: dict[str, str], expected: str | None) -> None:
    """OTLP over HTTP when an endpoint is set or asked for; console; otherwise none."""
    exporter = exporter_from_env(env)
    assert (type(exporter).__name__ if exporter is not None else None) == expected
