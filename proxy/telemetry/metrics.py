"""Prometheus metrics: the names and labels of DESIGN section 7 (a contract).

Each app owns its own ``CollectorRegistry`` so several proxies can live in one
process (tests, benchmarks) without colliding. Counters and histograms are
updated by the hooks in ``telemetry/__init__.py``; gauges that describe
current state (queue depth, replica seats) are read from the live objects at
scrape time by ``StateCollector``, so the request path never updates them and
they can never drift from the truth.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

#: Latency buckets in seconds, from a fast cache hit to a long generation.
LATENCY_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
)  # fmt: skip
OTHER_TENANTS = "other"


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


@dataclass(frozen=True, slots=True)
class StateSnapshot:
    """What the state collector reads at scrape time."""

    queue_depth: dict[tuple[str, str], int]
    queue_depth_max: dict[str, int]
    replicas: Sequence[tuple[str, int, int, bool]]  # name, inflight, limit, healthy
    gpus: Sequence[tuple[str, float, float]]  # gpu, utilization ratio, memory used ratio


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
        self.requests = Counter(
            "admission_requests",
            "Requests by final outcome",
            ["tenant", "priority", "outcome", "reason"],
            registry=r,
        )
        self.wait = Histogram(
            "admission_wait_seconds",
            "Wait per layer",
            ["layer", "tenant"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "admission_ttft_seconds",
            "Arrival to first token",
            ["tenant"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.duration = Histogram(
            "admission_request_duration_seconds",
            "Arrival to the end of the response",
            ["tenant", "outcome"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.timeouts = Counter("admission_timeouts", "Timeouts by layer", ["layer"], registry=r)
        self.retries = Counter("admission_retries", "Retries by reason", ["reason"], registry=r)
        self.retry_budget_exhausted = Counter(
            "admission_retry_budget_exhausted", "Retries refused by the budget", registry=r
        )
        self.goodput = Counter(
            "admission_goodput", "2xx answers that met their TTFT and total budgets",
            ["tenant"], registry=r,
        )  # fmt: skip
        self.tokens = Counter(
            "admission_tokens", "Tokens by direction", ["tenant", "direction"], registry=r
        )
        self.config_reloads = Counter(
            "admission_config_reloads", "Config reloads by result", ["result"], registry=r
        )
        for result in ("ok", "invalid"):
            self.config_reloads.labels(result)
