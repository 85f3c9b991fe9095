"""Prometheus metrics: the names and labels of docs/REFERENCE.md (a contract).

Each app owns its own ``CollectorRegistry`` so several proxies can live in one
process (tests, benchmarks) without colliding. Counters and histograms are
updated by the hooks in ``telemetry/__init__.py``; gauges that describe
current state (queue depth, replica seats) are read from the live objects at
scrape time by ``StateCollector``, so the request path never updates them and
they can never drift from the truth.

The series every request updates (``admission_requests_total``, the wait,
TTFT and duration histograms, goodput, tokens) are ``CounterFamily`` and
``HistogramFamily``: the same exposition as prometheus-client's ``Counter``
and ``Histogram`` (``_total``, ``_bucket``, ``_count``, ``_sum``,
``_created``), but an update is one addition and, for a histogram, one
``bisect``, instead of a validation, a lock and a Python loop over the
buckets (docs/BENCHMARKS.md, overhead, says what it saved). They take no lock: the request path and
``/metrics`` both run on the event loop's thread. The rarer counters
(timeouts, retries, reloads) stay prometheus-client objects.
"""

from __future__ import annotations

import os
import time
from bisect import bisect_left
from collections.abc import Callable, Collection, Container, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import cast

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

#: prometheus-client's ``le`` label text for a bucket bound ("0.005", "+Inf").
_go_float = cast(Callable[[float], str], floatToGoString)

#: Latency buckets in seconds, from a fast cache hit to a long generation.
LATENCY_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
)  # fmt: skip
OTHER_TENANTS = "other"
#: prometheus-client's switch for the ``_created`` series, honoured here alike.
CREATED_SERIES = os.environ.get("PROMETHEUS_DISABLE_CREATED_SERIES", "False").lower() not in (
    "true", "1", "t",
)  # fmt: skip


class CounterChild:
    """One labelled counter series."""

    __slots__ = ("created", "value")

    def __init__(self) -> None:
        self.value = 0.0
        self.created = time.time()

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount


class HistogramChild:
    """One labelled histogram series; ``counts`` per bucket, not cumulative."""

    __slots__ = ("bounds", "counts", "created", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0.0] * len(bounds)
        self.sum = 0.0
        self.created = time.time()

    def observe(self, amount: float) -> None:
        # The first bound >= amount is the bucket ``le`` counts it in (+Inf last).
        self.counts[bisect_left(self.bounds, amount)] += 1.0
        self.sum += amount


class _Family(Collector):
    """A labelled metric registered in a registry; children are made on first use."""

    _type = ""

    def __init__(
        self, name: str, documentation: str, labelnames: Sequence[str], registry: CollectorRegistry
    ) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        registry.register(self)

    def describe(self) -> Iterable[Metric]:
        return [Metric(self.name, self.documentation, self._type)]


class CounterFamily(_Family):
    """A labelled counter, exposed like prometheus-client's ``Counter``."""

    _type = "counter"

    def __init__(
        self, name: str, documentation: str, labelnames: Sequence[str], registry: CollectorRegistry
    ) -> None:
        super().__init__(name, documentation, labelnames, registry)
        self._children: dict[tuple[str, ...], CounterChild] = {}

    def labels(self, *values: str) -> CounterChild:
        child = self._children.get(values)
        if child is None:
            if len(values) != len(self.labelnames):
                raise ValueError(f"{self.name} takes labels {self.labelnames}, got {values}")
            child = self._children[values] = CounterChild()
        return child

    def series(self) -> list[tuple[tuple[str, ...], CounterChild]]:
        """Every labelled series so far (a copy: safe to read while requests add more)."""
        return list(self._children.items())

    def remove_where(self, label: str, value: str) -> None:
        """Drop every series whose ``label`` is ``value`` (a label no longer in use)."""
        index = self.labelnames.index(label)
        for values in [values for values in self._children if values[index] == value]:
            del self._children[values]

    def collect(self) -> Iterable[Metric]:
        metric = Metric(self.name, self.documentation, self._type)
        for values, child in list(self._children.items()):
            labels = dict(zip(self.labelnames, values, strict=True))
            metric.add_sample(self.name + "_total", labels, child.value)
            if CREATED_SERIES:
                metric.add_sample(self.name + "_created", labels, child.created)
        return [metric]


class HistogramFamily(_Family):
    """A labelled histogram, exposed like prometheus-client's ``Histogram``."""

    _type = "histogram"

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str],
        registry: CollectorRegistry,
        *,
        buckets: Sequence[float],
    ) -> None:
        super().__init__(name, documentation, labelnames, registry)
        bounds = tuple(float(b) for b in buckets)
        if list(bounds) != sorted(bounds):
            raise ValueError("buckets not in sorted order")
        self.bounds = bounds if bounds[-1] == float("inf") else (*bounds, float("inf"))
        self._le = tuple(_go_float(b) for b in self.bounds)
        self._children: dict[tuple[str, ...], HistogramChild] = {}

    def labels(self, *values: str) -> HistogramChild:
        child = self._children.get(values)
        if child is None:
            if len(values) != len(self.labelnames):
                raise ValueError(f"{self.name} takes labels {self.labelnames}, got {values}")
            child = self._children[values] = HistogramChild(self.bounds)
        return child

    def series(self) -> list[tuple[tuple[str, ...], HistogramChild]]:
        """Every labelled series so far (a copy: safe to read while requests add more)."""
        return list(self._children.items())

    def remove_where(self, label: str, value: str) -> None:
        """Drop every series whose ``label`` is ``value`` (a label no longer in use)."""
        index = self.labelnames.index(label)
        for values in [values for values in self._children if values[index] == value]:
            del self._children[values]

    def collect(self) -> Iterable[Metric]:
        metric = Metric(self.name, self.documentation, self._type)
        name = self.name
        for values, child in list(self._children.items()):
            labels = dict(zip(self.labelnames, values, strict=True))
            total = 0.0
            for le, count in zip(self._le, child.counts, strict=True):
                total += count
                metric.add_sample(name + "_bucket", {**labels, "le": le}, total)
            metric.add_sample(name + "_count", labels, total)
            if self.bounds[0] >= 0:
                metric.add_sample(name + "_sum", labels, child.sum)
            if CREATED_SERIES:
                metric.add_sample(name + "_created", labels, child.created)
        return [metric]


class TenantLabels:
    """Maps tenant names to metric labels, folding all past the first N into "other".

    Bounded label sets keep Prometheus cardinality under the operator's control.
    """

    __slots__ = ("_named",)

    def __init__(self, tenants: Iterable[str], max_labels: int) -> None:
        self._named = frozenset(list(tenants)[:max_labels])

    def __call__(self, tenant: str) -> str:
        if tenant in self._named or tenant == "unknown":
            return tenant
        return OTHER_TENANTS

    def reconfigure(
        self, tenants: Iterable[str], max_labels: int, busy: Container[str] = frozenset()
    ) -> frozenset[str]:
        """After a reload: the new tenants and cap, relabelling nobody without need;
        returns the labels forgotten, whose series the caller drops.

        Tenants labelled already keep their label, in file order, as far as
        the cap allows (a series does not change name under a dashboard);
        newcomers take the places left, in file order. A removed tenant keeps
        its label without taking a place while it has requests in the proxy
        (``busy``): they still end after the reload and are counted as its own.
        A removed tenant with none is forgotten (at this reload or, busy now, at
        a later one): kept, every tenant a reload ever removed held its label
        and series, past the cap, for the process's life. If it comes back, it
        takes a place again.
        """
        configured = list(tenants)
        named = self._named
        ordered = [t for t in configured if t in named] + [t for t in configured if t not in named]
        removed = named - set(configured)
        kept = frozenset(t for t in removed if t in busy)
        self._named = frozenset(ordered[:max_labels]) | kept
        return removed - kept


class ModelLabels:
    """Model names as metric labels, at most ``max_labels`` at once.

    Models come and go with discovery (LoRA adapters loaded and unloaded), so
    the set is not configured. A new model takes a free name; when none is
    free, the name used longest ago by a model no replica serves any more is
    forgotten (``forget`` drops its series, so a churning fleet cannot grow
    the scrape without bound) and the new model takes it. Only when every
    name is held by a model still served does the new one share ``other``.
    Before, the first names kept their places for the process's life, and
    after that many adapters every new model was ``other`` for good.
    """

    __slots__ = ("_named", "forget", "max_labels", "served")

    def __init__(
        self,
        max_labels: int,
        served: Callable[[], Collection[str]] = tuple,
        forget: Callable[[str], None] = lambda name: None,
    ) -> None:
        self.max_labels = max_labels
        #: Models served now (the model table's), asked only when a name must be freed.
        self.served = served
        self.forget = forget
        #: Named models, least recently used first.
        self._named: dict[str, None] = {}

    def __call__(self, model: str) -> str:
        named = self._named
        if model in named:
            del named[model]  # to the most recent end
            named[model] = None
            return model
        if len(named) >= self.max_labels and not self._free_one(len(named) - self.max_labels + 1):
            return OTHER_TENANTS
        named[model] = None
        return model

    def _free_one(self, count: int) -> bool:
        """Forget up to ``count`` names of models no longer served, oldest use first;
        True when that left a name free. Fewer than ``count`` (a cap lowered by a
        reload, most names still served) are forgotten all the same: kept, they held
        names and series past the cap until that many more models went."""
        served = set(self.served())
        gone = [name for name in self._named if name not in served][:count]
        for name in gone:
            del self._named[name]
            self.forget(name)
        return len(gone) == count


@dataclass(frozen=True, slots=True)
class StateSnapshot:
    """What the state collector reads at scrape time."""

    queue_depth: dict[tuple[str, str], int]
    queue_depth_max: dict[str, int]
    replicas: Sequence[tuple[str, int, int, bool]]  # name, inflight, limit, healthy
    gpus: Sequence[tuple[str, float, float]]  # gpu, utilization ratio, memory used ratio
    #: Requests started on a headroom seat, per tenant label, since start.
    headroom: dict[str, int] = field(default_factory=dict)
    #: Tickets waiting now per model pool label (model pools only).
    model_queue_depth: dict[str, int] = field(default_factory=dict)
    #: Token quota left per (tenant label, window): ``minute`` or ``day``.
    quota_remaining: dict[tuple[str, str], int] = field(default_factory=dict)


class StateCollector(Collector):
    def __init__(self, snapshot: Callable[[], StateSnapshot]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot()
        depth = GaugeMetricFamily(
            "admission_queue_depth", "Tickets waiting now", labels=["tenant", "priority"]
        )
        for (tenant, priority), value in sorted(snap.queue_depth.items()):
            depth.add_metric([tenant, priority], value)
        yield depth
        high = GaugeMetricFamily(
            "admission_queue_depth_max", "Queue high-water mark since start", labels=["tenant"]
        )
        for tenant, value in sorted(snap.queue_depth_max.items()):
            high.add_metric([tenant], value)
        yield high
        inflight = GaugeMetricFamily(
            "admission_replica_inflight", "Seats taken", labels=["replica"]
        )
        limit = GaugeMetricFamily("admission_replica_limit", "Seats", labels=["replica"])
        healthy = GaugeMetricFamily(
            "admission_replica_healthy", "1 when the replica takes traffic", labels=["replica"]
        )
        for name, used, seats, ok in snap.replicas:
            inflight.add_metric([name], used)
            limit.add_metric([name], seats)
            healthy.add_metric([name], 1.0 if ok else 0.0)
        yield inflight
        yield limit
        yield healthy
        headroom = CounterMetricFamily(
            "admission_headroom_dispatches",
            "Requests started on a seat above the knee (tenants below their fair share)",
            labels=["tenant"],
        )
        for tenant, value in sorted(snap.headroom.items()):
            headroom.add_metric([tenant], value)
        yield headroom
        pools = GaugeMetricFamily(
            "admission_model_queue_depth", "Tickets waiting now per model pool", labels=["model"]
        )
        for model, value in sorted(snap.model_queue_depth.items()):
            pools.add_metric([model], value)
        yield pools
        quota = GaugeMetricFamily(
            "admission_quota_remaining_tokens",
            "Tokens left of each tenant's token quota, per window (minute, day)",
            labels=["tenant", "window"],
        )
        for (tenant, window), value in sorted(snap.quota_remaining.items()):
            quota.add_metric([tenant, window], value)
        yield quota
        util = GaugeMetricFamily(
            "admission_gpu_utilization_ratio", "GPU utilization (0..1)", labels=["gpu"]
        )
        mem = GaugeMetricFamily(
            "admission_gpu_memory_used_ratio", "GPU memory used/total", labels=["gpu"]
        )
        for gpu, u, m in snap.gpus:
            util.add_metric([gpu], u)
            mem.add_metric([gpu], m)
        yield util
        yield mem


class Metrics:
    """The counters and histograms the request path updates."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = CounterFamily(
            "admission_requests",
            "Requests by final outcome",
            ["tenant", "priority", "outcome", "reason"],
            r,
        )
        self.wait = HistogramFamily(
            "admission_wait_seconds",
            "Wait per layer",
            ["layer", "tenant"],
            r,
            buckets=LATENCY_BUCKETS,
        )
        self.ttft = HistogramFamily(
            "admission_ttft_seconds", "Arrival to first token", ["tenant"], r,
            buckets=LATENCY_BUCKETS,
        )  # fmt: skip
        self.duration = HistogramFamily(
            "admission_request_duration_seconds",
            "Arrival to the end of the response",
            ["tenant", "outcome"],
            r,
            buckets=LATENCY_BUCKETS,
        )
        self.timeouts = Counter("admission_timeouts", "Timeouts by layer", ["layer"], registry=r)
        self.retries = Counter("admission_retries", "Retries by reason", ["reason"], registry=r)
        self.retry_budget_exhausted = Counter(
            "admission_retry_budget_exhausted", "Retries refused by the budget", registry=r
        )
        self.goodput = CounterFamily(
            "admission_goodput", "2xx answers that met their TTFT and total budgets", ["tenant"], r
        )
        self.model_requests = CounterFamily(
            "admission_model_requests",
            "Requests routed by model, by final outcome",
            ["model", "outcome"],
            r,
        )
        self.tokens = CounterFamily(
            "admission_tokens", "Tokens by direction", ["tenant", "direction"], r
        )
        self.config_reloads = Counter(
            "admission_config_reloads", "Config reloads by result", ["result"], registry=r
        )
        for result in ("ok", "invalid", "rolled_back"):
            self.config_reloads.labels(result)
        self.observed_refusals = CounterFamily(
            "admission_observed_refusals",
            "mode: observe: requests forwarded that enforcing would have refused",
            ["tenant", "priority", "reason"],
            r,
        )
        self.degraded = CounterFamily(
            "admission_degraded_requests",
            "Requests degraded instead of refused (overload)",
            ["tenant", "priority", "degradation"],
            r,
        )


class PressureCollector(Collector):
    """``admission_budget_pressure{priority}``, read at scrape time (``pressure.py``)."""

    def __init__(self, pressure: Callable[[], dict[str, float]]) -> None:
        self._pressure = pressure

    def collect(self) -> Iterator[Metric]:
        gauge = GaugeMetricFamily(
            "admission_budget_pressure",
            "p95 queue wait over the queue budget, last 30 s (1: budget used up)",
            labels=["priority"],
        )
        for priority, value in sorted(self._pressure().items()):
            gauge.add_metric([priority], value)
        yield gauge
