"""What an operator sees of the requests a test sends: spans, access lines, metrics.

``Watch`` holds one proxy's in-memory span exporter and access-log stream,
and reads its ``/metrics`` page with prometheus-client's own parser. ``settle``
waits until every request has left the handler and returns what each request
left behind, joined by request id, so a test can hold the three views of one
request against each other: exactly one access line, exactly one
``proxy.request`` span with the same outcome and trace, and exactly one
increment of ``admission_requests_total`` in the same bucket.
"""

from __future__ import annotations

import io
import json
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import ProxyUnderTest
from tests.helpers import wait_for

#: The access line's fields and the JSON types each may take (docs/REFERENCE.md).
ACCESS_FIELDS: dict[str, tuple[type, ...]] = {
    "request_id": (str,),
    "trace_id": (str, type(None)),
    "tenant": (str,),
    "priority": (str,),
    "method": (str,),
    "path": (str,),
    "status": (int,),
    "outcome": (str,),
    "reason": (str,),
    "entrance_ms": (float, int, type(None)),
    "queue_ms": (float, int, type(None)),
    "ttft_ms": (float, int, type(None)),
    "upstream_ms": (float, int, type(None)),
    "total_ms": (float, int),
    "attempts": (int,),
    "replica": (str, type(None)),
    "model": (str, type(None)),
    "input_tokens": (int, type(None)),
    "output_tokens": (int, type(None)),
    "quota_charged_tokens": (int, type(None)),
    "quota_actual_tokens": (int, type(None)),
    "degraded": (str, type(None)),
    "observed": (str, type(None)),
}
OUTCOMES = {"completed", "rejected", "timed_out", "failed", "cancelled"}
#: The GenAI semantic-convention span attributes the proxy sets, by their exact names
#: (a ``gen_ai.*`` name outside the conventions, or a metric's name, is none of them).
GEN_AI_ATTRIBUTES = frozenset({
    "gen_ai.request.model", "gen_ai.usage.input_tokens", "gen_ai.usage.output_tokens",
    "gen_ai.response.time_to_first_chunk",
})  # fmt: skip

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(text: str) -> Samples:
    """Every sample of a /metrics page, keyed by name and sorted labels."""
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def delta(before: Samples, after: Samples, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """The series of ``name`` that changed between two scrapes, by how much."""
    out = {}
    for (sample, labels), value in after.items():
        if sample == name:
            change = value - before.get((sample, labels), 0.0)
            if change:
                out[labels] = change
    return out


@dataclass
class Seen:
    """One request as the operator sees it."""

    line: dict[str, Any]
    spans: list[ReadableSpan] = field(default_factory=list)

    @property
    def root(self) -> ReadableSpan:
        (root,) = [s for s in self.spans if s.name == "proxy.request"]
        return root

    def named(self, name: str) -> list[ReadableSpan]:
        return sorted((s for s in self.spans if s.name == name), key=lambda s: s.start_time or 0)

    def one(self, name: str) -> ReadableSpan:
        (span,) = self.named(name)
        return span


class Watch:
    def __init__(self) -> None:
        self.exporter = InMemorySpanExporter()
        self.provider = TracerProvider()
        self.provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        self.log = io.StringIO()
        self.proxy: ProxyUnderTest | None = None
        self._lines_read = 0
        self._before: Samples = {}

    def kwargs(self) -> dict[str, Any]:
        return {"tracer_provider": self.provider, "access_log": self.log}

    async def metrics(self) -> Samples:
        assert self.proxy is not None
        resp = await self.proxy.client.get("/metrics")
        assert resp.status == 200
        return scrape(await resp.text())

    async def mark(self) -> None:
        """Start a new observation window: what ``settle`` reports is what came after."""
        assert self.proxy is not None
        await wait_for(lambda: not self.proxy.runtime.active)  # type: ignore[union-attr]
        self._lines_read = len(self.log.getvalue().splitlines())
        self.exporter.clear()
        self._before = await self.metrics()

    async def settle(self, expected: int = 1) -> tuple[list[Seen], Samples, Samples]:
        """Wait for every request to end; the requests seen since ``mark``, checked for
        the invariants every shape shares, with the scrapes before and after."""
        proxy = self.proxy
        assert proxy is not None
        await wait_for(lambda: not proxy.runtime.active and len(self._lines()) >= expected)
        lines = self._lines()
        spans = self.exporter.get_finished_spans()
        after = await self.metrics()
        seen = [Seen(line) for line in lines]
        by_trace = {s.line["trace_id"]: s for s in seen}
        assert len(by_trace) == len(seen), "two requests share a trace id"
        for span in spans:
            owner = by_trace.get(format(span.context.trace_id, "032x"))
            assert owner is not None, f"span {span.name} belongs to no access line"
            owner.spans.append(span)
        assert len(seen) == expected, lines
        for one in seen:
            check_line(one.line)
            check_root(one)
        check_counted(seen, self._before, after)
        return seen, self._before, after

    def _lines(self) -> list[dict[str, Any]]:
        return [json.loads(t) for t in self.log.getvalue().splitlines()[self._lines_read :]]


def check_line(line: dict[str, Any]) -> None:
    """Every contract field, with its type; durations in ms, consistent with each other."""
    for name, types in ACCESS_FIELDS.items():
        assert name in line, name
        value = line[name]
        assert isinstance(value, types) and not isinstance(value, bool), (name, value)
    assert line["event"] == "request"
    assert line["outcome"] in OUTCOMES
    assert (line["reason"] == "none") == (line["outcome"] == "completed"), line
    assert line["total_ms"] >= 0
    for part in ("entrance_ms", "queue_ms", "ttft_ms", "upstream_ms"):
        if line[part] is not None:
            assert 0 <= line[part] <= line["total_ms"] + 0.001, (part, line)
    assert line["trace_id"] is not None and len(line["trace_id"]) == 32


def check_root(one: Seen) -> None:
    """The one ``proxy.request`` span says what the access line says."""
    root = one.root
    line = one.line
    attributes = root.attributes or {}
    assert root.parent is None or root.parent.is_remote
    assert attributes["admission.request_id"] == line["request_id"]
    assert attributes["admission.tenant"] == line["tenant"]
    assert attributes["admission.priority"] == line["priority"]
    assert attributes["admission.outcome"] == line["outcome"]
    assert attributes["admission.reason"] == line["reason"]
    assert attributes["http.response.status_code"] == line["status"]
    assert attributes["http.request.method"] == line["method"]
    for span in one.spans:
        if span is not root:
            assert span.parent is not None and span.parent.span_id == root.context.span_id, (
                span.name
            )
    assert len(one.named("proxy.entrance")) == 1
    for span in one.spans:
        assert span.start_time is not None and span.end_time is not None
        assert root.start_time is not None and root.end_time is not None
        assert root.start_time <= span.start_time <= span.end_time <= root.end_time, span.name
        for key in span.attributes or {}:
            assert "authorization" not in key.lower() and "api_key" not in key.lower(), key
            assert not key.startswith("gen_ai.") or key in GEN_AI_ATTRIBUTES, key


def check_counted(seen: list[Seen], before: Samples, after: Samples) -> None:
    """``admission_requests_total`` grew once per access line, in the line's bucket."""
    counted = delta(before, after, "admission_requests_total")
    expected: Counter[tuple[tuple[str, str], ...]] = Counter()
    for one in seen:
        line = one.line
        expected[
            tuple(
                sorted(
                    {
                        "tenant": line["tenant"],
                        "priority": line["priority"],
                        "outcome": line["outcome"],
                        "reason": line["reason"],
                    }.items()
                )
            )
        ] += 1
    assert counted == {k: float(v) for k, v in expected.items()}, (counted, expected)
