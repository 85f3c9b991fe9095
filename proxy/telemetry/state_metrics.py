"""The shared state's gauges, read at scrape time from the live client.

``admission_state_up`` (1 while Redis answers, and always with ``backend:
local``), ``admission_state_errors_total`` (failed or timed-out Redis calls)
and ``admission_instances`` (live instances last seen; 1 with ``local``).
Nothing on the request path updates them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from proxy.state.shared import SharedState


class SharedStateCollector(Collector):
    def __init__(self, state: Callable[[], SharedState | None]) -> None:
        self._state = state

    def collect(self) -> Iterator[Metric]:
        state = self._state()
        client = state.client if state is not None else None
        up = GaugeMetricFamily(
            "admission_state_up", "1 while the shared state answers (always 1 with local)"
        )
        up.add_metric([], 1.0 if client is None or client.up else 0.0)
        yield up
        errors = CounterMetricFamily(
            "admission_state_errors", "Shared state calls that failed or timed out"
        )
        errors.add_metric([], float(client.errors if client is not None else 0))
        yield errors
        instances = GaugeMetricFamily(
            "admission_instances", "Live instances sharing the state, last seen (1 with local)"
        )
        instances.add_metric([], float(client.instances if client is not None else 1))
        yield instances
