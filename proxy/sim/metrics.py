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
_Family = type[GaugeMetricFamily] | type[CounterMetricFamily]


class EngineCollector:
    """Gauges and counters named as vLLM's, labelled with `model_name` like vLLM's."""

    def __init__(self, engine: SimEngine) -> None:
        self._engine = engine

    def collect(self) -> Iterable[Metric]:
        stats = self._engine.stats()
        labels = [self._engine.config.model_name]
        families: tuple[tuple[_Family, str, str, float], ...] = (
            (GaugeMetricFamily, "vllm:num_requests_running",
             "Number of requests in model execution batches.", stats.running),
            (GaugeMetricFamily, "vllm:num_requests_waiting",
             "Number of requests waiting to be processed.", stats.waiting),
            (GaugeMetricFamily, "vllm:kv_cache_usage_perc",
             "KV-cache usage. 1 means 100 percent usage.", stats.kv_cache_usage),
            (CounterMetricFamily, "vllm:prompt_tokens",
             "Number of prefill tokens processed.", stats.prompt_tokens),
            (CounterMetricFamily, "vllm:generation_tokens",
             "Number of generation tokens processed.", stats.tokens_generated),
            (CounterMetricFamily, "vllm:request_success",
             "Count of successfully processed requests.", stats.completed),
            (CounterMetricFamily, "sim:request_aborted",
             "Requests aborted by client disconnect (not a vLLM name).", stats.aborted),
        )  # fmt: skip
        for kind, name, documentation, value in families:
            family = kind(name, documentation, labels=LABELS)
            family.add_metric(labels, value)
            yield family


def build_registry(engine: SimEngine) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(engine))
    return registry
