"""One staircase level's row: throughput, latency, TTFT, queue wait, errors, memory.

Owns ``LevelStats`` (the row the knee rules read and the reports print) and
``summarise_level``, which turns a level's request results and its
measurement window into that row. No I/O here.

Throughput counts successful requests only, over the measurement window
(after warm-up, before the drain), so requests that fail fast never look like
capacity. Latency and TTFT percentiles are over successful requests too; the
failures are counted apart, by kind.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field

from proxy.loadtest.results import RequestResult, error_kind, percentile_ms

__all__ = ["LevelStats", "achieved_concurrency", "summarise_level"]


@dataclass(frozen=True, slots=True)
class LevelStats:
    """One measured run of one concurrency level (``run`` 2 is a confirmation re-run)."""

    concurrency: int
    run: int = 1
    requests: int = 0
    ok: int = 0
    errors: Mapping[str, int] = field(default_factory=dict)
    duration_s: float = 0.0
    requests_per_s: float = 0.0
    output_tokens_per_s: float = 0.0
    latency_p50_ms: float | None = None
    latency_p95_ms: float | None = None
    latency_p99_ms: float | None = None
    ttft_p50_ms: float | None = None
    ttft_p95_ms: float | None = None
    queue_p50_ms: float | None = None
    queue_p95_ms: float | None = None
    queue_source: str | None = None
    memory_ratio: float | None = None
    memory_source: str | None = None
    achieved_concurrency: float | None = None
    loop_lag_p99_ms: float | None = None
    truncated: bool = False
    # Resources over the level (``resources``): CPU in cores busy (1.0 = one
    # core), resident memory, GPU utilisation (mean of the busiest GPU) and
    # GPU memory (peak ratio, least free); None where nothing measured it.
    proxy_cpu: float | None = None
    proxy_rss_bytes: int | None = None
    engine_cpu: float | None = None
    engine_rss_bytes: int | None = None
    cpu_source: str | None = None
    gpu_utilization: float | None = None
    gpu_memory_ratio: float | None = None
    gpu_memory_free_bytes: int | None = None
    gpu_source: str | None = None
    #: The cool-down waited before this level, and whether the target was idle after it.
    cool_down_s: float = 0.0
    idle_at_start: bool | None = None
    busy_at_start: str | None = None

    @property
    def error_count(self) -> int:
        return sum(self.errors.values())

    def to_json(self) -> dict[str, object]:
        data = asdict(self)
        data["errors"] = dict(self.errors)
        data["error_count"] = self.error_count
        return data


def achieved_concurrency(results: Sequence[RequestResult], start: float, end: float) -> float:
    """Mean requests in flight over [start, end] (Little's law over the exact intervals).

    A closed loop asked for ``c`` should show close to ``c`` here; much less
    means the generator, not the target, set the pace.
    """
    span = end - start
    if span <= 0:
        return 0.0
    busy = sum(
        max(0.0, min(r.ended_at, end) - max(r.started_at, start))
        for r in results
        if r.ended_at == r.ended_at  # skip NaN: never finished
    )
    return busy / span


def summarise_level(
    concurrency: int,
    measured: Sequence[RequestResult],
    window: tuple[float, float],
    *,
    run: int = 1,
    everything: Sequence[RequestResult] = (),
    memory: tuple[float, str] | None = None,
    loop_lag_p99_ms: float | None = None,
    truncated: bool = False,
) -> LevelStats:
    """The level's row from its measured results and measurement window.

    ``everything`` (warm-up and drain included) feeds the achieved
    concurrency, since requests that started during warm-up still occupy the
    target during the window.
    """
    start, end = window
    span = max(end - start, 1e-9)
    good = [r for r in measured if r.ok]
    errors = Counter(error_kind(r) for r in measured if not r.ok)
    queue_sources = {r.queue_source for r in good if r.queue_source}
    queue_source = "proxy" if "proxy" in queue_sources else next(iter(queue_sources), None)
    queue_values = [r.queue_ms / 1000.0 for r in good if r.queue_ms is not None]
    return LevelStats(
        concurrency=concurrency,
        run=run,
        requests=len(measured),
        ok=len(good),
        errors=dict(sorted(errors.items())),
        duration_s=end - start,
        requests_per_s=len(good) / span,
        output_tokens_per_s=sum(r.output_tokens for r in good) / span,
        latency_p50_ms=percentile_ms((r.latency_s for r in good), 50),
        latency_p95_ms=percentile_ms((r.latency_s for r in good), 95),
        latency_p99_ms=percentile_ms((r.latency_s for r in good), 99),
        ttft_p50_ms=percentile_ms((r.ttft_s for r in good), 50),
        ttft_p95_ms=percentile_ms((r.ttft_s for r in good), 95),
        queue_p50_ms=percentile_ms(queue_values, 50),
        queue_p95_ms=percentile_ms(queue_values, 95),
        queue_source=queue_source,
        memory_ratio=None if memory is None else memory[0],
        memory_source=None if memory is None else memory[1],
        achieved_concurrency=achieved_concurrency(everything or measured, start, end),
        loop_lag_p99_ms=loop_lag_p99_ms,
        truncated=truncated,
    )
