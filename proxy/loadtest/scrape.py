"""Reading the target's Prometheus ``/metrics`` while the load runs.

Owns ``parse_metrics`` (text to a ``MetricsSample``: pure) and
``MetricsSampler`` (a bounded background scrape on an interval). What is
read, by the names of docs/REFERENCE.md and the engines' own:

- queue depth: the proxy's ``admission_queue_depth{tenant,priority}``; against
  a bare engine, its waiting queue (``vllm:num_requests_waiting``);
- retries: ``admission_retries_total{reason}`` and
  ``admission_retry_budget_exhausted_total`` (counters: reports use deltas);
- memory: the engine's KV-cache usage (``vllm:kv_cache_usage_perc``, older
  vLLM's ``vllm:gpu_cache_usage_perc``, SGLang's ``sglang:token_usage``),
  else the proxy's NVML ``admission_gpu_memory_used_ratio`` (the highest GPU).

A failed scrape is skipped, never fatal: the load test's answer must not
depend on whether the target exports metrics.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from proxy.tasks import stop

__all__ = ["MetricsSample", "MetricsSampler", "ScrapeTarget", "parse_metrics", "scrape_once"]

#: Engine KV-cache gauges (0..1), in order of preference.
KV_CACHE_METRICS = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage")
GPU_MEMORY_METRIC = "admission_gpu_memory_used_ratio"
#: Longest a single scrape may take; a slower one is skipped.
SCRAPE_TIMEOUT_S = 2.0


class ScrapeTarget:
    """A run's target and where its engine metrics are read (both plans have one)."""

    __slots__ = ()
    url: str
    #: ``None``: ``<url>/metrics``; ``""``: no scraping.
    metrics_url: str | None

    @property
    def base_url(self) -> str:
        return self.url.rstrip("/")

    @property
    def scrape_url(self) -> str | None:
        if self.metrics_url == "":
            return None
        return self.metrics_url or self.base_url + "/metrics"


@dataclass(frozen=True, slots=True)
class MetricsSample:
    """One scrape, at ``t`` seconds on the run's clock."""

    t: float
    queue_depth: Mapping[str, float] = field(default_factory=dict)
    engine_waiting: float | None = None
    replica_inflight: float | None = None
    retries: Mapping[str, float] = field(default_factory=dict)
    retry_budget_exhausted: float | None = None
    memory_ratio: float | None = None
    memory_source: str | None = None
    #: ``process_cpu_seconds_total`` and ``process_resident_memory_bytes`` of the
    #: process serving ``/metrics`` (prometheus_client's process collector; vLLM has it).
    process_cpu_s: float | None = None
    process_rss_bytes: float | None = None

    @property
    def total_depth(self) -> float | None:
        """Requests waiting in the proxy's queues; a bare engine's waiting queue otherwise."""
        if self.queue_depth:
            return sum(self.queue_depth.values())
        return self.engine_waiting

    @property
    def total_retries(self) -> float:
        return sum(self.retries.values())


def parse_metrics(text: str, t: float, model: str | None = None) -> MetricsSample:
    """The figures the load tests use from one Prometheus text exposition.

    With ``model``, the queue depth is that model pool's
    (``admission_model_queue_depth{model}``) when the proxy exports it, so a
    run aimed at one pool is not blamed for another pool's queue.
    """
    depth: dict[str, float] = {}
    pool_depth: float | None = None
    process_cpu: float | None = None
    process_rss: float | None = None
    retries: dict[str, float] = {}
    kv: dict[str, float] = {}
    gpu_memory: list[float] = []
    waiting: list[float] = []
    inflight: list[float] = []
    exhausted: float | None = None
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name, labels, value = sample.name, sample.labels, float(sample.value)
            if name == "admission_queue_depth":
                key = f"{labels.get('tenant', '')}/{labels.get('priority', '')}"
                depth[key] = depth.get(key, 0.0) + value
            elif name == "admission_model_queue_depth":
                if model is not None and labels.get("model") == model:
                    pool_depth = (pool_depth or 0.0) + value
            elif name == "process_cpu_seconds_total":
                process_cpu = value
            elif name == "process_resident_memory_bytes":
                process_rss = value
            elif name == "admission_retries_total":
                reason = labels.get("reason", "")
                retries[reason] = retries.get(reason, 0.0) + value
            elif name == "admission_retry_budget_exhausted_total":
                exhausted = (exhausted or 0.0) + value
            elif name == "admission_replica_inflight":
                inflight.append(value)
            elif name == GPU_MEMORY_METRIC:
                gpu_memory.append(value)
            elif name == "vllm:num_requests_waiting":
                waiting.append(value)
            elif name in KV_CACHE_METRICS:
                kv[name] = max(kv.get(name, 0.0), value)
    memory_ratio: float | None = None
    memory_source: str | None = None
    for name in KV_CACHE_METRICS:
        if name in kv:
            memory_ratio, memory_source = kv[name], "kv_cache"
            break
    else:
        if gpu_memory:
            memory_ratio, memory_source = max(gpu_memory), "gpu_memory"
    if pool_depth is not None:
        depth = {f"model:{model}": pool_depth}
    return MetricsSample(
        t=t,
        queue_depth=depth,
        engine_waiting=sum(waiting) if waiting else None,
        replica_inflight=sum(inflight) if inflight else None,
        retries=retries,
        retry_budget_exhausted=exhausted,
        memory_ratio=memory_ratio,
        memory_source=memory_source,
        process_cpu_s=process_cpu,
        process_rss_bytes=process_rss,
    )


async def scrape_once(
    session: aiohttp.ClientSession, url: str, zero: float, model: str | None = None
) -> MetricsSample | None:
    """One scrape, or None when the target has no usable ``/metrics`` right now."""
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=SCRAPE_TIMEOUT_S)) as resp:
            if resp.status != 200:
                await resp.read()
                return None
            text = await resp.text()
    except (aiohttp.ClientError, TimeoutError, UnicodeDecodeError):
        return None
    try:
        return parse_metrics(text, time.perf_counter() - zero, model)
    except ValueError:  # not Prometheus text
        return None


class MetricsSampler:
    """Scrapes ``url`` every ``interval_s`` into ``samples`` until the context exits.

    It uses its own one-connection session, so scrapes never queue behind the
    load's connections (and never count as load). With ``url`` None it does
    nothing, so callers need no second code path when scraping is off.
    """

    __slots__ = (
        "_interval_s", "_model", "_session", "_task", "_url", "_zero", "failures", "samples",
    )  # fmt: skip

    def __init__(
        self, url: str | None, zero: float, interval_s: float, model: str | None = None
    ) -> None:
        self._url = url
        self._model = model
        self._zero = zero
        self._interval_s = interval_s
        self._session: aiohttp.ClientSession | None = None
        self._task: asyncio.Task[None] | None = None
        self.samples: list[MetricsSample] = []
        self.failures = 0

    async def __aenter__(self) -> MetricsSampler:
        if self._url is None:
            return self
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=1), cookie_jar=aiohttp.DummyCookieJar()
        )
        self._task = asyncio.create_task(self._run(), name="loadtest-metrics")
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        task, self._task = self._task, None
        await stop(task)
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def scrape_now(self) -> MetricsSample | None:
        """One extra scrape right now (a phase boundary), recorded with the others."""
        if self._session is None or self._url is None:
            return None
        sample = await scrape_once(self._session, self._url, self._zero, self._model)
        if sample is None:
            self.failures += 1
        else:
            self.samples.append(sample)
        return sample

    async def _run(self) -> None:
        while True:
            await self.scrape_now()
            await asyncio.sleep(self._interval_s)

    @property
    def latest(self) -> MetricsSample | None:
        return self.samples[-1] if self.samples else None

    def peak_memory(self, start: float, end: float) -> tuple[float, str] | None:
        """Highest memory ratio scraped in [start, end], with its source."""
        readings = [
            (s.memory_ratio, s.memory_source)
            for s in self.samples
            if start <= s.t <= end and s.memory_ratio is not None and s.memory_source
        ]
        if not readings:
            return None
        ratio, source = max(readings, key=lambda reading: reading[0] or 0.0)
        return (ratio or 0.0), source or ""

    def process_cpu(self, start: float, end: float) -> tuple[float | None, float | None]:
        """CPU (seconds per second) and peak resident bytes of the scraped process."""
        inside = [s for s in self.samples if start <= s.t <= end and s.process_cpu_s is not None]
        if len(inside) < 2 or inside[-1].t <= inside[0].t:
            return None, None
        first, last = inside[0], inside[-1]
        cpu = max(0.0, (last.process_cpu_s or 0.0) - (first.process_cpu_s or 0.0))
        rss = [s.process_rss_bytes for s in inside if s.process_rss_bytes is not None]
        return cpu / (last.t - first.t), (max(rss) if rss else None)

    def __repr__(self) -> str:
        return f"<MetricsSampler {self._url} {len(self.samples)} samples, {self.failures} failed>"
