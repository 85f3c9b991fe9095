"""``serve --workers N``: what one merged ``/metrics`` scrape costs the event loop.

The worker a scrape reaches adds its siblings' expositions to its own on the
event loop that serves requests (``proxy/worker_metrics.py``). This times
``merge`` over N workers' texts of T tenants (a counter by outcome and two
histograms by tenant, the proxy's largest families) beside, in the same run,
the same sum read with prometheus-client's parser (how the first version
merged), and reports both per scrape and their ratio.

    .venv/bin/python -m bench.worker_metrics_merge [--workers 4] [--tenants 100]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from proxy.worker_metrics import merge

OUTCOMES = ("completed", "rejected", "cancelled")


def exposition(tenants: int, seed: int) -> str:
    registry = CollectorRegistry()
    requests = Counter("admission_requests", "R", ["tenant", "outcome"], registry=registry)
    ttft = Histogram("admission_ttft_seconds", "T", ["tenant"], registry=registry)
    duration = Histogram(
        "admission_request_duration_seconds", "D", ["tenant", "outcome"], registry=registry
    )
    for i in range(tenants):
        tenant = f"tenant-{i}"
        ttft.labels(tenant).observe(0.01 * ((i + seed) % 50))
        for outcome in OUTCOMES:
            requests.labels(tenant, outcome).inc(i + seed)
            duration.labels(tenant, outcome).observe(0.1 * ((i + seed) % 30))
    return generate_latest(registry).decode()


def parser_sum(texts: Sequence[str]) -> int:
    """The baseline: every sample read by prometheus-client's parser and summed."""
    sums: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for text in texts:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                key = (sample.name, tuple(sorted(sample.labels.items())))
                sums[key] = sums.get(key, 0.0) + sample.value
    return len(sums)


def best_of(repeats: int, run: Callable[[], object]) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--tenants", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    texts = [exposition(args.tenants, seed) for seed in range(args.workers)]
    lines = sum(text.count("\n") for text in texts)
    merged = best_of(args.repeats, lambda: merge(texts))
    parsed = best_of(args.repeats, lambda: parser_sum(texts))
    print(
        f"{args.workers} workers x {args.tenants} tenants ({lines} lines): "
        f"merge {merged * 1e3:.1f} ms, prometheus-client parser {parsed * 1e3:.1f} ms, "
        f"ratio {parsed / merged:.1f}x"
    )


if __name__ == "__main__":
    main()
