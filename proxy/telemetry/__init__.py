"""Telemetry hooks: what the request path calls, never a layer it passes through.

Business code calls ``Telemetry.request_ended(record)`` once per request and
a few counters on the way (``retry``, ``retry_budget_exhausted``); metrics and
the access log are derived here from the request's record. Tracing plugs in
behind the same hooks.

The series every request updates are ``metrics.CounterFamily`` and
``metrics.HistogramFamily`` (one addition, one ``bisect``); the durations come
from the record, computed once by ``RequestRecord.end``. For the
prometheus-client counters left (timeouts, retries), whose ``labels(...)``
validates and locks on every call, the children are cached here per label
tuple (the set of tuples is bounded by the fixed reason and layer codes).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from proxy.record import RequestRecord
from proxy.settings import DEFAULT_MAX_TENANT_LABELS
from proxy.telemetry.logs import AccessLog
from proxy.telemetry.metrics import (
    CounterFamily,
    HistogramFamily,
    Metrics,
    ModelLabels,
    TenantLabels,
)
from proxy.telemetry.tracing import Tracing


class _Children:
    """Cached ``metric.labels(*values)`` children."""

    __slots__ = ("_cache", "_metric")

    def __init__(self, metric: Any) -> None:
        self._metric = metric
        self._cache: dict[tuple[str, ...], Any] = {}

    def __call__(self, *values: str) -> Any:
        child = self._cache.get(values)
        if child is None:
            child = self._cache[values] = self._metric.labels(*values)
        return child


class Telemetry:
    __slots__ = (
        "_duration",
        "_goodput",
        "_requests",
        "_retries",
        "_timeouts",
        "_tokens",
        "_ttft",
        "_wait",
        "access_log",
        "labels",
        "metrics",
        "model_labels",
        "tracing",
    )

    _requests: CounterFamily
    _wait: HistogramFamily
    _ttft: HistogramFamily
    _duration: HistogramFamily
    _tokens: CounterFamily
    _goodput: CounterFamily

    def __init__(
        self,
        metrics: Metrics,
        labels: TenantLabels,
        *,
        access_log: AccessLog | None = None,
        tracing: Tracing | None = None,
    ) -> None:
        self.tracing = tracing or Tracing(None)
        self.metrics = metrics
        self.labels = labels
        #: Capped like tenant labels (``telemetry.max_tenant_labels``, set by the app).
        self.model_labels = ModelLabels(DEFAULT_MAX_TENANT_LABELS)
        self.access_log = access_log
        self._requests = metrics.requests
        self._timeouts = _Children(metrics.timeouts)
        self._wait = metrics.wait
        self._ttft = metrics.ttft
        self._duration = metrics.duration
        self._tokens = metrics.tokens
        self._goodput = metrics.goodput
        self._retries = _Children(metrics.retries)

    def request_ended(self, record: RequestRecord) -> None:
        """Count and log one finished request; called exactly once per request."""
        if record.counted:
            tenant = self.labels(record.tenant)
            outcome = record.outcome or "failed"
            self._requests.labels(tenant, record.priority, outcome, record.reason).inc()
            if record.timeout_layer is not None:
                self._timeouts(record.timeout_layer).inc()
            arrival = record.arrival
            wait = self._wait
            # Each layer observes every request that entered it, up to when it left it,
            # however that was (answered, timed out, refused, the client gone): the
            # waits that ended a request are the ones an operator looks for.
            ended = record.ended_at if record.ended_at is not None else arrival
            entrance_done = record.entrance_done if record.entrance_done is not None else ended
            wait.labels("entrance", tenant).observe(entrance_done - arrival)
            if record.enqueued_at is not None:
                left_queue = record.dispatched_at or ended
                wait.labels("queue", tenant).observe(left_queue - record.enqueued_at)
            dispatched = record.dispatched_at
            if dispatched is not None:
                first_byte = record.first_byte_at if record.first_byte_at is not None else ended
                wait.labels("first_byte", tenant).observe(first_byte - dispatched)
            if record.first_token_at is not None:
                self._ttft.labels(tenant).observe(record.first_token_at - arrival)
            if record.ended_at is not None:
                self._duration.labels(tenant, outcome).observe(record.ended_at - arrival)
            if record.input_tokens:
                self._tokens.labels(tenant, "input").inc(record.input_tokens)
            if record.output_tokens:
                self._tokens.labels(tenant, "output").inc(record.output_tokens)
            if record.good:
                self._goodput.labels(tenant).inc()
            if record.model is not None:
                model = self.model_labels(record.model) if record.model_served else "unknown"
                self.metrics.model_requests.labels(model, outcome).inc()
            if record.observed is not None:
                self.metrics.observed_refusals.labels(
                    tenant, record.priority, record.observed
                ).inc()
            if record.degraded is not None:
                self.metrics.degraded.labels(tenant, record.priority, record.degraded).inc()
        trace_id = None
        if record.trace is not None:
            self.tracing.request_ended(record.trace, record, record.gpu)
            trace_id = record.trace.trace_id
        if self.access_log is not None:
            self.access_log.write(record, trace_id)

    def forget_tenants(self, labels: Iterable[str]) -> None:
        """Drop every series of tenant labels no longer in use (a reload removed the
        tenant, ``TenantLabels.reconfigure``): the label set stays within the cap."""
        metrics = self.metrics
        families: tuple[CounterFamily | HistogramFamily, ...] = (
            metrics.requests, metrics.wait, metrics.ttft, metrics.duration, metrics.goodput,
            metrics.tokens, metrics.observed_refusals, metrics.degraded,
        )  # fmt: skip
        for label in labels:
            for family in families:
                family.remove_where("tenant", label)

    def retry(self, reason: str) -> None:
        self._retries(reason).inc()

    def retry_budget_exhausted(self) -> None:
        self.metrics.retry_budget_exhausted.inc()
