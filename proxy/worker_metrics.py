"""``serve --workers N``: one scrape of ``/metrics`` counts every worker.

The N workers share one port, so the kernel hands each scrape to any one of
them, and each has only its own counters: a scrape saw one worker's numbers,
the next another's, and Prometheus read every change of worker as a counter
reset (``rate()`` over such a series is meaningless). prometheus-client's own
answer, its multiprocess mode, keeps every value in shared files, which the
request path's counters (``telemetry.metrics``, written for speed) do not
use. Instead each worker also serves its own exposition on a Unix socket in a
directory private to its group (``socket_dir``), and the worker a scrape
reaches reads its siblings' there and answers their sum (``merge``):

- counters and histograms are summed, series by series (a ``_created``
  series takes the earliest);
- each gauge by what it means across processes (``GAUGE_MERGE``): queue
  depths and seats held here are summed; readings every worker takes of the
  same thing (a replica's limit, GPU readings, instances) take the largest;
  health, shared state and quota left take the smallest (one worker that
  sees a problem shows it); the budget pressure takes the worst worker's.

A sibling that does not answer within ``SIBLING_TIMEOUT_S`` (a worker
restarting) is left out of that scrape, and its socket file removed when
nothing listens on it any more. The sockets are only for this: nothing but
``GET /metrics`` is served there, and the directory is the user's alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import tempfile
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import aiohttp
import structlog
from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

log = structlog.get_logger(__name__)

#: A sibling that has not answered by then is left out of the scrape.
SIBLING_TIMEOUT_S = 1.0
Merge = Callable[[Sequence[float]], float]
#: How each gauge adds up across workers; a gauge not listed is summed.
GAUGE_MERGE: dict[str, Merge] = {
    "admission_queue_depth": sum,
    "admission_queue_depth_max": max,  # the fullest worker's queue (each has its capacity)
    "admission_replica_inflight": sum,
    "admission_replica_limit": max,
    "admission_replica_healthy": min,
    "admission_gpu_utilization_ratio": max,
    "admission_gpu_memory_used_ratio": max,
    "admission_model_queue_depth": sum,
    "admission_budget_pressure": max,
    "admission_quota_remaining_tokens": min,
    "admission_state_up": min,
    "admission_instances": max,
}


def socket_dir(group: str) -> Path:
    """Where the workers of ``group`` (one ``serve --workers`` parent) serve their metrics."""
    return Path(tempfile.gettempdir()) / f"admission-proxy-{group}"


def _rule(family: Metric, sample: str) -> Merge:
    if sample.endswith("_created"):
        return min
    if family.type == "gauge":
        return GAUGE_MERGE.get(family.name, sum)
    return sum


class _Merged(Collector):
    def __init__(self, families: Iterable[Metric]) -> None:
        self._families = list(families)

    def collect(self) -> Iterable[Metric]:
        return self._families


def merge(texts: Sequence[str]) -> bytes:
    """The Prometheus text of several workers' expositions, added up as one process's."""
    families: dict[str, Metric] = {}
    values: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], list[float]]] = {}
    for text in texts:
        for family in text_string_to_metric_families(text):
            if family.name not in families:
                families[family.name] = Metric(family.name, family.documentation, family.type)
            series = values.setdefault(family.name, {})
            for sample in family.samples:
                key = (sample.name, tuple(sorted(sample.labels.items())))
                series.setdefault(key, []).append(sample.value)
    for name, merged in families.items():
        for (sample_name, labels), found in values[name].items():
            merged.add_sample(sample_name, dict(labels), _rule(merged, sample_name)(found))
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged(families.values()))
    return generate_latest(registry)


class WorkerMetrics:
    """This worker's metrics socket, and the group's merged scrape."""

    __slots__ = ("_registry", "_runner", "directory", "path")

    def __init__(self, group: str, registry: CollectorRegistry) -> None:
        self._registry = registry
        self.directory = socket_dir(group)
        self.path = self.directory / f"{os.getpid()}.sock"
        self._runner: web.AppRunner | None = None

    def __repr__(self) -> str:
        return f"<WorkerMetrics {self.path}>"

    async def start(self) -> None:
        self.directory.mkdir(mode=0o700, exist_ok=True)
        app = web.Application()
        app.router.add_get("/metrics", self._own)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()  # a former process of the same pid
        await web.UnixSite(runner, str(self.path)).start()
        self._runner = runner

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        with contextlib.suppress(OSError):
            self.directory.rmdir()  # the group's last worker to stop

    async def _own(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self._registry))

    async def scrape(self) -> bytes:
        """Every reachable worker's metrics, this one's included, merged."""
        own = generate_latest(self._registry).decode()
        siblings = [p for p in self.directory.glob("*.sock") if p != self.path]
        found = await asyncio.gather(*(self._sibling(path) for path in siblings))
        return merge([own, *(text for text in found if text is not None)])

    async def _sibling(self, path: Path) -> str | None:
        try:
            async with (
                aiohttp.ClientSession(
                    connector=aiohttp.UnixConnector(path=str(path)),
                    timeout=aiohttp.ClientTimeout(total=SIBLING_TIMEOUT_S),
                ) as session,
                session.get("http://worker/metrics") as response,
            ):
                return await response.text() if response.status == 200 else None
        except (aiohttp.ClientConnectorError, FileNotFoundError):
            _forget(path)  # nothing listens there: a worker that died without cleaning up
            return None
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.warning("worker metrics not read", socket=str(path), error=repr(exc))
            return None


def _forget(path: Path) -> None:
    """Remove a dead worker's socket file (a local unlink: not worth a thread)."""
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


#: The app's ``WorkerMetrics``; None outside a ``serve --workers`` group.
WORKER_METRICS: web.AppKey[WorkerMetrics | None] = web.AppKey("worker_metrics")
