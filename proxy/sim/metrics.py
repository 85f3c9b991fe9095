"""vLLM-named Prometheus metrics of the simulated replica.

Owns a collector that reads an `EngineStats` snapshot at scrape time: the
engine's step loop never updates metric objects, and each sim registers in its
own `CollectorRegistry`, so several sims can live in one process.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from proxy.sim.engine import SimEngine

__all__ = ["EngineCollector", "build_registry"]

LABELS = ["model_name"]


class EngineCollector:
    """Gauges and counters named as vLLM's, labelled with `model_name` like vLLM's."""

    def __init__(self, engine: SimEngine) -> None:
        self._engine = engine

    def collect(self) -> Iterable[Metric]:
        stats = self._engine.stats()
        labels = [self._engine.config.model_name]
        gauges = (
            (
                "vllm:num_requests_running",
                "Number of requests in model execution batches.",
                stats.running,
            ),
            (
                "vllm:num_requests_waiting",
                "Number of requests waiting to be processed.",
                stats.waiting,
            ),
            (
                "vllm:kv_cache_usage_perc",
                "KV-cache usage. 1 means 100 percent usage.",
                stats.kv_cache_usage,
            ),
        )
        for name, documentation, value in gauges:
            gauge = GaugeMetricFamily(name, documentation, labels=LABELS)
            gauge.add_metric(labels, value)
            yield gauge
        counters = (
            ("vllm:prompt_tokens", "Number of prefill tokens processed.", stats.prompt_tokens),
            (
                "vllm:generation_tokens",
                "Number of generation tokens processed.",
                stats.tokens_generated,
            ),
            ("vllm:request_success", "Count of successfully processed requests.", stats.completed),
            (
                "sim:request_aborted",
                "Requests aborted by client disconnect (not a vLLM name).",
                stats.aborted,
            ),
        )
        for name, documentation, total in counters:
            counter = CounterMetricFamily(name, documentation, labels=LABELS)
            counter.add_metric(labels, total)
            yield counter


def build_registry(engine: SimEngine) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(engine))
    return registry
