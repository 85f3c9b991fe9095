"""OpenTelemetry spans for one request: entrance, queue, upstream, batch, GPU.

Only the spans that must exist while the request runs are live: the server
span ``proxy.request`` (parented on the client's ``traceparent``) and each
``proxy.upstream`` attempt (whose context is injected into the attempt's
``traceparent``, so the engine's own spans join the trace). The rest
(``proxy.entrance``, ``proxy.queue``, ``proxy.backoff``, ``proxy.batch``,
``proxy.gpu``) are written when the request ends, from the instants its
record already holds, with explicit start and end times: no span objects and
no context switches on the hot path for them.

The exporter follows the standard variables (docs/REFERENCE.md): OTLP over HTTP
when ``OTEL_EXPORTER_OTLP_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``
is set or ``OTEL_TRACES_EXPORTER=otlp``; ``console`` for debugging; nothing
configured (or ``none``) means no tracer at all, and every hook returns at
its first line.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import structlog
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SpanExporter,
)
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from proxy.record import RequestRecord

log = structlog.get_logger(__name__)
_propagator = TraceContextTextMapPropagator()
SERVICE_NAME = "admission-proxy"


def exporter_from_env(env: Mapping[str, str] | None = None) -> SpanExporter | None:
    """The exporter the standard ``OTEL_*`` variables ask for, or None."""
    env = os.environ if env is None else env
    names = {n.strip().lower() for n in env.get("OTEL_TRACES_EXPORTER", "").split(",") if n}
    if "none" in names:
        return None
    endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get(
        "OTEL_EXPORTER_OTLP_ENDPOINT"
    )
    if "otlp" in names or (endpoint and not names):
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter()
    if "console" in names:
        return ConsoleSpanExporter()
    return None


def provider_from_env() -> TracerProvider | None:
    exporter = exporter_from_env()
    if exporter is None:
        return None
    provider = TracerProvider(resource=Resource.create({"service.name": SERVICE_NAME}))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    log.info("tracing on", exporter=type(exporter).__name__)
    return provider


def _ns(record: RequestRecord, instant: float) -> int:
    """A monotonic instant of the record as epoch nanoseconds."""
    return record.wall_arrival_ns + int((instant - record.arrival) * 1e9)


@dataclass(slots=True)
class RequestTrace:
    """The live spans of one request."""

    span: trace.Span
    context: Context
    attempts: list[AttemptSpan] = field(default_factory=list)

    @property
    def trace_id(self) -> str:
        return format(self.span.get_span_context().trace_id, "032x")


@dataclass(slots=True)
class AttemptSpan:
    span: trace.Span
    sent_at: float
    replica: str


class Tracing:
    """Span hooks; every method is a no-op when no provider is configured."""

    __slots__ = ("_provider", "_tracer")

    def __init__(self, provider: TracerProvider | None) -> None:
        self._provider = provider
        self._tracer = provider.get_tracer("admission-proxy") if provider is not None else None

    def start_request(
        self, headers: Mapping[str, str], record: RequestRecord
    ) -> RequestTrace | None:
        if self._tracer is None:
            return None
        parent = _propagator.extract(headers)
        span = self._tracer.start_span(
            "proxy.request",
            context=parent,
            kind=SpanKind.SERVER,
            start_time=record.wall_arrival_ns,
            attributes={"http.request.method": record.method, "url.path": record.path},
        )
        return RequestTrace(span, trace.set_span_in_context(span, parent))

    def upstream_started(
        self,
        rt: RequestTrace | None,
        record: RequestRecord,
        replica: str,
        sent_at: float,
        headers: MutableMapping[str, str],
    ) -> None:
        """Open a ``proxy.upstream`` span and inject its ``traceparent`` into ``headers``."""
        if rt is None or self._tracer is None:
            return
        attempt = record.attempts
        attributes: dict[str, Any] = {"admission.replica": replica, "admission.attempt": attempt}
        if record.retry_reasons and attempt > 1:
            attributes["admission.retry_reason"] = record.retry_reasons[-1]
        span = self._tracer.start_span(
            "proxy.upstream",
            context=rt.context,
            kind=SpanKind.CLIENT,
            start_time=_ns(record, sent_at),
            attributes=attributes,
        )
        _propagator.inject(headers, context=trace.set_span_in_context(span, rt.context))
        rt.attempts.append(AttemptSpan(span, sent_at, replica))

    def upstream_ended(
        self,
        rt: RequestTrace | None,
        record: RequestRecord,
        at: float,
        *,
        status: int | None = None,
        error: str | None = None,
    ) -> None:
        if rt is None or not rt.attempts:
            return
        span = rt.attempts[-1].span
        if status is not None:
            span.set_attribute("http.response.status_code", status)
        if error is not None:
            span.set_status(Status(StatusCode.ERROR, error))
            span.set_attribute("error.type", error)
        span.end(end_time=_ns(record, at))

    def request_ended(
        self, rt: RequestTrace | None, record: RequestRecord, gpu: Mapping[str, float] | None
    ) -> None:
        """Write the derived spans and close the request span."""
        if rt is None or self._tracer is None:
            return
        tracer, ctx = self._tracer, rt.context
        end = record.ended_at if record.ended_at is not None else record.arrival

        def child(name: str, start: float, stop: float, **attributes: Any) -> None:
            span = tracer.start_span(name, context=ctx, start_time=_ns(record, start),
                                     attributes=attributes)  # fmt: skip
            span.end(end_time=_ns(record, max(start, stop)))

        # A request refused at the entrance has one too, up to its answer.
        entrance_end = record.entrance_done if record.entrance_done is not None else end
        child("proxy.entrance", record.arrival, entrance_end)
        if record.enqueued_at is not None:
            left = record.dispatched_at if record.dispatched_at is not None else end
            child(
                "proxy.queue",
                record.enqueued_at,
                left,
                **{
                    "admission.queue.depth_at_enqueue": record.queue_depth_at_enqueue,
                    "admission.queue.wait_ms": round((left - record.enqueued_at) * 1000.0, 3),
                },
            )
        for start, stop in record.backoffs:
            child("proxy.backoff", start, stop)
        self._engine_spans(rt, record, end, child, gpu)
        span = rt.span
        span.set_attribute("admission.tenant", record.tenant)
        span.set_attribute("admission.priority", record.priority)
        span.set_attribute("admission.outcome", record.outcome or "failed")
        span.set_attribute("admission.reason", record.reason)
        span.set_attribute("admission.request_id", record.request_id)
        if record.model is not None:
            span.set_attribute("gen_ai.request.model", record.model)
        span.set_attribute("http.response.status_code", record.status)
        if record.outcome not in ("completed", "cancelled"):
            span.set_status(Status(StatusCode.ERROR, record.reason))
        span.end(end_time=_ns(record, end))

    @staticmethod
    def _engine_spans(
        rt: RequestTrace,
        record: RequestRecord,
        end: float,
        child: Any,
        gpu: Mapping[str, float] | None,
    ) -> None:
        """``proxy.batch`` and ``proxy.gpu`` of the attempt that answered.

        From the engine's own timing headers when it sent them (``engine``),
        else measured here: request sent to first token, first token to last
        chunk (``proxy``). Each span says which. Any 2xx answer that began has
        them, also one its client left or that broke off mid-stream: the engine
        queued and computed for it all the same, up to the end.
        """
        status = record.upstream_status
        if status is None or not 200 <= status < 300 or not rt.attempts:
            return
        sent = rt.attempts[-1].sent_at
        first = record.first_token_at or record.first_byte_at
        if record.engine_queue_ms is not None:
            batch_end, batch_source = sent + record.engine_queue_ms / 1000.0, "engine"
        elif first is not None:
            batch_end, batch_source = first, "proxy"
        else:
            return
        child("proxy.batch", sent, batch_end, **{"admission.timing_source": batch_source})
        if record.engine_inference_ms is not None:
            gpu_end, gpu_source = batch_end + record.engine_inference_ms / 1000.0, "engine"
        else:
            gpu_end, gpu_source = end, "proxy"
        attributes: dict[str, Any] = {"admission.timing_source": gpu_source}
        if record.input_tokens is not None:
            attributes["gen_ai.usage.input_tokens"] = record.input_tokens
        if record.output_tokens is not None:
            attributes["gen_ai.usage.output_tokens"] = record.output_tokens
        # GenAI's own span attribute (``gen_ai.server.time_to_first_token`` is a metric's
        # name, no attribute): request sent to the stream's first chunk, in seconds.
        if record.streaming and record.first_byte_at is not None:
            attributes["gen_ai.response.time_to_first_chunk"] = round(
                record.first_byte_at - sent, 6
            )
        if record.first_token_at is not None:  # the first chunk that carried a token
            attributes["admission.time_to_first_token"] = round(record.first_token_at - sent, 6)
        for key, value in (gpu or {}).items():
            attributes[f"admission.gpu.{key}"] = value
        child("proxy.gpu", batch_end, gpu_end, **attributes)

    def shutdown(self) -> None:
        if self._provider is not None:
            self._provider.shutdown()
