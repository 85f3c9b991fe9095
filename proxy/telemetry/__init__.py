"""Telemetry hooks: what the request path calls, never a layer it passes through.

Business code calls ``Telemetry.request_ended(record)`` once per request and
a few counters on the way (``retry``, ``retry_budget_exhausted``); metrics and
the access log are derived here from the request's record. Tracing plugs in
behind the same hooks.
"""

from __future__ import annotations

from proxy.record import RequestRecord
from proxy.telemetry.logs import access_line
from proxy.telemetry.metrics import Metrics, TenantLabels


class Telemetry:
    __slots__ = ("access_log", "labels", "metrics")

    def __init__(self, metrics: Metrics, labels: TenantLabels, *, access_log: bool = True) -> None:
        self.metrics = metrics
        self.labels = labels
        self.access_log = access_log

    def request_ended(self, record: RequestRecord) -> None:
        """Count and log one finished request; called exactly once per request."""
        m = self.metrics
        tenant = self.labels(record.tenant)
        outcome = record.outcome or "failed"
        if record.counted:
            m.requests.labels(tenant, record.priority, outcome, record.reason).inc()
            if record.timeout_layer is not None:
                m.timeouts.labels(record.timeout_layer).inc()
            if record.entrance_ms is not None:
                m.wait.labels("entrance", tenant).observe(record.entrance_ms / 1000.0)
            if record.queue_ms is not None:
                m.wait.labels("queue", tenant).observe(record.queue_ms / 1000.0)
            if record.upstream_ms is not None:
                m.wait.labels("first_byte", tenant).observe(record.upstream_ms / 1000.0)
            if record.ttft_ms is not None:
                m.ttft.labels(tenant).observe(record.ttft_ms / 1000.0)
            if record.total_ms is not None:
                m.duration.labels(tenant, outcome).observe(record.total_ms / 1000.0)
            if record.input_tokens:
                m.tokens.labels(tenant, "input").inc(record.input_tokens)
            if record.output_tokens:
                m.tokens.labels(tenant, "output").inc(record.output_tokens)
            if record.good:
                m.goodput.labels(tenant).inc()
        if self.access_log:
            access_line(record)

    def retry(self, reason: str) -> None:
        self.metrics.retries.labels(reason).inc()

    def retry_budget_exhausted(self) -> None:
        self.metrics.retry_budget_exhausted.inc()
