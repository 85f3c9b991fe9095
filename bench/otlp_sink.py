"""A tiny OTLP/HTTP trace receiver: the collector stand-in for overhead benchmarks.

``POST /v1/traces`` takes an ``ExportTraceServiceRequest`` (protobuf, as the
OpenTelemetry SDK's OTLP/HTTP exporter sends it), counts its spans and
answers 200 with an empty ``ExportTraceServiceResponse``, so the proxy's
exporter does all its work (batching, encoding, the HTTP post) and nothing
else. ``GET /stats`` says what arrived, so a benchmark can check that the
spans it paid for were exported and not dropped; ``/health`` answers too.

    python -m bench.otlp_sink --port 4318
    OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:4318 admission-proxy serve ...
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from aiohttp import web
from google.protobuf.message import DecodeError  # type: ignore[import-untyped]
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from bench import serving
from bench.serving import health

PROTOBUF = "application/x-protobuf"


@dataclass(slots=True)
class Received:
    exports: int = 0
    bytes: int = 0
    spans: int = 0
    #: Bodies that did not parse as an ExportTraceServiceRequest (answered 400).
    invalid: int = 0


RECEIVED: web.AppKey[Received] = web.AppKey("received", Received)


def span_count(request: ExportTraceServiceRequest) -> int:
    return sum(
        len(scope.spans) for resource in request.resource_spans for scope in resource.scope_spans
    )


async def traces(request: web.Request) -> web.Response:
    received = request.app[RECEIVED]
    body = await request.read()
    try:
        export = ExportTraceServiceRequest.FromString(body)
    except DecodeError:
        received.invalid += 1
        return web.Response(status=400, text="not an ExportTraceServiceRequest")
    received.exports += 1
    received.bytes += len(body)
    received.spans += span_count(export)
    return web.Response(body=b"", content_type=PROTOBUF)  # an empty response: full success


async def stats(request: web.Request) -> web.Response:
    return web.json_response(asdict(request.app[RECEIVED]))


def build_app() -> web.Application:
    app = web.Application(client_max_size=64 * 1024 * 1024)  # the exporter's own limit
    app[RECEIVED] = Received()
    app.router.add_post("/v1/traces", traces)
    app.router.add_get("/stats", stats)
    app.router.add_get("/health", health)
    return app


def main() -> None:
    serving.main(__doc__, lambda _: build_app())


if __name__ == "__main__":
    main()
