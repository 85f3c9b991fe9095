"""Replica health: passive ejection, active probes, warm-up, engine saturation.

``Health`` owns the background loop (started and stopped by the app's
``cleanup_ctx``) and the per-replica counters the request path feeds with
``attempt_succeeded`` / ``attempt_failed``. It moves each replica's
``ReplicaState`` (replicas.py draws the transitions) and flips the hold-offs
``ReplicaPool`` reads (``saturated``, ``gpu_guarded``); it never
holds a seat and its requests are never counted as client requests.

Rules (docs/REFERENCE.md):
- failures that count: connect errors and timeouts, resets, 500/502/504,
  first-byte timeouts and failed probes, on one counter per replica; 429 and
  503 are saturation, not sickness;
- the k-th consecutive ejection lasts ``eject_ms * 2^(k-1)``, at most 300 s;
  k resets after a success;
- passive ejection never removes the last serving replica; failed probes can;
- an ejected replica returns when its ejection has expired, a probe succeeds
  and its warm-up succeeds; at start-up every replica is warmed first;
- a replica not yet healthy once (since start-up, or since a reload added it)
  is never ejected: it is ``starting``, probed every ``interval_ms`` with no
  backoff, and takes no traffic until a probe and its warm-up succeed; an
  engine loading a model for minutes must not be pushed into 300 s ejections;
- engine metrics older than ``saturation.stale_ms`` are ignored: a scrape
  that fails never stops dispatch.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import aiohttp
import structlog
from prometheus_client.parser import text_string_to_metric_families

from proxy.clock import Clock
from proxy.errors import ProxyError
from proxy.models import ModelTable, parse_model_list
from proxy.replicas import Replica, ReplicaPool, ReplicaState
from proxy.settings import Config
from proxy.telemetry.gpu import GpuReading
from proxy.upstream import translate

log = structlog.get_logger(__name__)

#: The longest single ejection (docs/REFERENCE.md).
MAX_EJECTION_S = 300.0
#: Engine gauges read for saturation, in order of preference.
WAITING_METRICS = (
    "vllm:num_requests_waiting",
    "sglang:num_queue_reqs",
    "tgi_queue_size",
    "llamacpp:requests_deferred",
)
KV_CACHE_METRICS = (
    "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc",
    "sglang:token_usage",
    "llamacpp:kv_cache_usage_ratio",  # older llama.cpp builds
)
#: Engine gauges of requests being computed now (reported, not acted on).
RUNNING_METRICS = (
    "vllm:num_requests_running",
    "sglang:num_running_reqs",
    "tgi_batch_current_size",
    "llamacpp:requests_processing",
)
#: Failures of these reasons count toward ejection (429 and 503 do not).
COUNTED_REASONS = frozenset(
    {"upstream_connect_error", "connect_timeout", "upstream_protocol_error", "first_byte_timeout"}
)
COUNTED_STATUSES = frozenset({500, 502, 504})
#: Per-call time limit for probes, scrapes and warm-up requests.
PROBE_TIMEOUT_S = 2.0
WARMUP_TIMEOUT_S = 30.0


@dataclass(slots=True)
class EngineReading:
    at: float
    waiting: float | None
    kv_cache: float | None
    running: float | None = None


def parse_engine_metrics(text: str, at: float = 0.0) -> EngineReading:
    """Waiting and running requests and KV-cache usage (0..1) from an engine's metrics.

    Whichever engine's names appear are used (vLLM, SGLang, TGI, llama.cpp).
    A name may have several series (one per data-parallel rank, per model):
    counts are summed, since every rank's queue is the replica's queue, but a
    ratio takes the largest, since summing two ranks at 0.6 reads 1.2 and would
    hold the replica off forever; the fullest rank is the one that preempts.
    NaN samples are skipped.
    """
    values: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not math.isnan(sample.value):
                values.setdefault(sample.name, []).append(sample.value)

    def first(names: tuple[str, ...], combine: Callable[[list[float]], float]) -> float | None:
        return next((combine(values[n]) for n in names if n in values), None)

    return EngineReading(
        at,
        first(WAITING_METRICS, sum),
        first(KV_CACHE_METRICS, max),
        first(RUNNING_METRICS, sum),
    )


class Health:
    """Health state and the probe loop for every replica of a pool."""

    def __init__(
        self,
        pool: ReplicaPool,
        config: Config,
        clock: Clock,
        on_change: Callable[[], None],
        *,
        models: ModelTable | None = None,
    ) -> None:
        self._pool = pool
        #: Fed by discovery: a replica without static ``models`` is asked its
        #: ``GET /v1/models`` at warm-up and after every successful probe.
        self._models = models
        self._config = config
        self._clock = clock
        self._on_change = on_change
        self._readings: dict[str, EngineReading] = {}
        self._session: aiohttp.ClientSession | None = None

    def set_config(self, config: Config) -> None:
        self._config = config

    # -- the request path's hooks (synchronous, no I/O) --------------------------------

    def attempt_succeeded(self, replica: Replica) -> None:
        replica.failures = 0
        replica.ejections = 0
        replica.healthy_once = True

    def attempt_failed(self, replica: Replica, error: ProxyError | None, status: int = 0) -> None:
        """Count a failure if its kind is sickness; eject past the threshold."""
        if error is not None and error.reason not in COUNTED_REASONS:
            return
        if error is None and status not in COUNTED_STATUSES:
            return
        self._count_failure(replica, passive=True)

    def _count_failure(self, replica: Replica, *, passive: bool) -> None:
        replica.failures += 1
        if replica.ejected or replica.failures < self._config.health.eject_after_failures:
            return
        if passive and not any(r.serving for r in self._pool.replicas if r is not replica):
            return  # never eject the last serving replica on passive evidence
        self._eject(replica)

    def _eject(self, replica: Replica) -> None:
        if not replica.healthy_once:
            self._hold_starting(replica)
            return
        replica.ejections += 1
        base = self._config.health.eject_ms / 1000.0
        duration = min(MAX_EJECTION_S, base * 2 ** (replica.ejections - 1))
        replica.move_to(ReplicaState.EJECTED)
        replica.ejected_until = self._clock.now() + duration
        log.warning("replica ejected", replica=replica.name, seconds=duration,
                    failures=replica.failures, ejection=replica.ejections)  # fmt: skip

    def _hold_starting(self, replica: Replica) -> None:
        """Never healthy yet: no ejection and no backoff, only the next probe."""
        replica.failures = 0
        if not replica.starting:
            replica.move_to(ReplicaState.STARTING)
            log.info("replica starting: probed every interval until it answers",
                     replica=replica.name, error=replica.probe_error)  # fmt: skip

    def _came_up(self, replica: Replica) -> None:
        """A probe (or warm-up) succeeded: from now on the normal ejection rules apply."""
        replica.healthy_once = True
        replica.probe_error = None
        if replica.health is ReplicaState.STARTING:
            replica.move_to(ReplicaState.SERVING)
            log.info("replica started", replica=replica.name)

    def earliest_return_s(self, among: frozenset[str] | None = None) -> float:
        """Seconds until the first ejection ends (Retry-After of no_healthy_replica).

        ``among``: the replicas of the request's model pool (None: every one); another
        pool's replica coming back serves none of its requests. A starting replica
        may come up at its next probe: one interval.
        """
        now = self._clock.now()
        replicas = [r for r in self._pool.replicas if among is None or r.name in among]
        waits = [r.ejected_until - now for r in replicas if r.ejected]
        interval = self._config.health.interval_ms / 1000.0
        if any(r.starting for r in replicas):
            return interval
        return max(interval, min(waits)) if waits else interval

    # -- the background loop -----------------------------------------------------------

    async def run(self, session: aiohttp.ClientSession) -> None:
        """Warm every replica, then probe on the interval until cancelled."""
        self._session = session
        if self._config.warmup.requests > 0:
            for replica in self._pool.replicas:
                replica.move_to(ReplicaState.WARMING)
        await asyncio.gather(*(self._start(r) for r in self._pool.replicas))
        while True:
            await asyncio.sleep(self._config.health.interval_ms / 1000.0)
            await asyncio.gather(*(self._check(r) for r in self._pool.replicas))
            self.refresh_saturation()

    async def _start(self, replica: Replica) -> None:
        if not replica.warming:
            await self._model_of(replica)  # discovery; warm-up does it otherwise
        if replica.warming:
            if await self._warm(replica):
                self._came_up(replica)
            else:
                self._eject(replica)  # never healthy yet: it stays starting
        self._on_change()

    async def _check(self, replica: Replica) -> None:
        if replica.config.metrics_url:
            await self._scrape(replica)
        if replica.starting:
            if await self._probe(replica) and await self._warm(replica):
                replica.failures = 0
                self._came_up(replica)
                self._on_change()
            return
        if replica.ejected:
            if self._clock.now() < replica.ejected_until:
                return
            if await self._probe(replica) and await self._warm(replica):
                replica.move_to(ReplicaState.SERVING)
                replica.failures = 0
                self._came_up(replica)
                log.info("replica returned", replica=replica.name)
                self._on_change()
            else:
                self._eject(replica)  # again, for the next, longer duration
            return
        if not await self._probe(replica):
            self._count_failure(replica, passive=False)
            return
        if not replica.draining:
            replica.failures = 0
            self._came_up(replica)
        await self._model_of(replica)  # discovery: adapters come and go without a reload

    async def _probe(self, replica: Replica) -> bool:
        """One GET of the health path; why it failed is kept for ``/admin/state``."""
        path = self._config.health.path
        error = await self._ask(replica, "GET", path, PROBE_TIMEOUT_S, f"GET {path}", "")
        if error is None:
            return True
        if error != replica.probe_error:
            log.warning("probe failed", replica=replica.name, error=error)
        replica.probe_error = error
        return False

    async def _ask(
        self, replica: Replica, method: str, path: str, timeout_s: float, what: str,
        prefix: str, **request: object,
    ) -> str | None:  # fmt: skip
        """None when the replica answers ``method path`` with a 2xx; else why not."""
        try:
            async with self._get_session().request(
                method, replica.url + path, ssl=replica.ssl,
                timeout=aiohttp.ClientTimeout(total=timeout_s), **request,  # type: ignore[arg-type]
            ) as resp:  # fmt: skip
                await resp.read()
                if 200 <= resp.status < 300:
                    return None
                return f"{what} answered {resp.status}"
        except aiohttp.ClientError as exc:
            return prefix + translate(exc, replica).message
        except TimeoutError:
            return f"{what} gave no answer within {timeout_s:.0f} s"

    async def _warm(self, replica: Replica) -> bool:
        """``warmup.requests`` completions of one token; the replica serves only after."""
        if replica.health is ReplicaState.STARTING:
            replica.move_to(ReplicaState.WARMING)
        elif replica.health is ReplicaState.EJECTED:
            replica.move_to(ReplicaState.RETURNING)
        try:
            model = await self._model_of(replica)
            for _ in range(self._config.warmup.requests):
                if not await self._warmup_request(replica, model):
                    return False
            return True
        finally:
            # back where it came from (unless ejected meanwhile); the caller decides
            if replica.health is ReplicaState.WARMING:
                replica.move_to(ReplicaState.STARTING)
            elif replica.health is ReplicaState.RETURNING:
                replica.move_to(ReplicaState.EJECTED)

    async def _model_of(self, replica: Replica) -> str | None:
        """The model a warm-up names: the first its ``GET /v1/models`` lists.

        That answer also feeds the model table (discovery); a replica with
        static ``models`` is never asked and warms up with its first one.
        """
        table = self._models
        if table is not None and not table.discovers(replica.name):
            return replica.config.models[0] if replica.config.models else None
        # An engine started with an API key (vLLM's --api-key) guards /v1/models too.
        headers = {"Authorization": f"Bearer {replica.api_key}"} if replica.api_key else None
        with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError, KeyError,
                                 IndexError, TypeError):  # fmt: skip
            async with self._get_session().get(
                replica.url + "/v1/models",
                headers=headers,
                ssl=replica.ssl,
                timeout=aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S),
            ) as resp:
                if resp.status != 200 and table is not None and not table.models_of(replica.name):
                    # Nothing known yet: the replica serves no pool until this succeeds.
                    log.warning("model discovery failed", replica=replica.name,
                                status=resp.status)  # fmt: skip
                if resp.status == 200:
                    body = await resp.read()
                    if table is not None and table.update(replica.name, parse_model_list(body)):
                        log.info("replica models changed", replica=replica.name,
                                 models=sorted(table.models_of(replica.name)))  # fmt: skip
                        self._on_change()
                    return str(json.loads(body)["data"][0]["id"])
        return None

    async def _warmup_request(self, replica: Replica, model: str | None) -> bool:
        body: dict[str, object] = {"prompt": "warm-up", "max_tokens": 1}
        if model is not None:
            body["model"] = model
        headers = {"Content-Type": "application/json", "X-Request-Id": "admission-warmup"}
        if replica.api_key:
            headers["Authorization"] = f"Bearer {replica.api_key}"
        error = await self._ask(
            replica, "POST", "/v1/completions", WARMUP_TIMEOUT_S, "warm-up", "warm-up: ",
            data=json.dumps(body), headers=headers,
        )  # fmt: skip
        if error is None:
            return True
        log.warning("warm-up failed", replica=replica.name, error=error)
        replica.probe_error = error
        return False

    async def _scrape(self, replica: Replica) -> None:
        url = replica.config.metrics_url
        assert url is not None
        try:
            async with self._get_session().get(
                url, ssl=replica.ssl, timeout=aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S)
            ) as resp:
                if resp.status != 200:
                    return
                text = await resp.text()
            reading = parse_engine_metrics(text, self._clock.now())
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return  # the last reading goes stale; dispatch falls back to seat counting
        self._readings[replica.name] = reading
        self.refresh_saturation()

    def engine_reading(self, name: str) -> EngineReading | None:
        """The last fresh engine reading of a replica (``/admin/state``), None when stale."""
        reading = self._readings.get(name)
        stale_s = self._config.saturation.stale_ms / 1000.0
        if reading is None or self._clock.now() - reading.at > stale_s:
            return None
        return reading

    def reading_names(self) -> set[str]:
        """Replicas with an engine reading kept, fresh or stale."""
        return set(self._readings)

    def refresh_saturation(self) -> None:
        """Mark replicas saturated from fresh readings only; stale ones count as not.

        Readings of replicas gone from the pool (a reload removed them) are dropped
        here, every round: replica names come and go with an autoscaled fleet."""
        for gone in self._readings.keys() - {r.name for r in self._pool.replicas}:
            del self._readings[gone]
        max_waiting = self._config.saturation.max_waiting
        max_kv = self._config.saturation.max_kv_cache
        changed = False
        for replica in self._pool.replicas:
            reading = self.engine_reading(replica.name)
            saturated = False
            if reading is not None:
                saturated = bool(
                    (max_waiting is not None and reading.waiting is not None
                     and reading.waiting > max_waiting)
                    or (max_kv is not None and reading.kv_cache is not None
                        and reading.kv_cache > max_kv)
                )  # fmt: skip
            if saturated != replica.saturated:
                replica.saturated = saturated
                changed = True
        if changed:
            self._on_change()

    def apply_gpu_guard(self, snapshot: Mapping[int, GpuReading]) -> None:
        """Hold off replicas whose GPU memory is over ``gpu.memory_guard`` (sidecar mode)."""
        guard = self._config.gpu.memory_guard
        changed = False
        for replica in self._pool.replicas:
            index = replica.config.gpu_index
            reading = snapshot.get(index) if index is not None else None
            guarded = guard is not None and reading is not None and reading.memory_ratio > guard
            if guarded != replica.gpu_guarded:
                replica.gpu_guarded = guarded
                changed = True
                log.info("gpu guard", replica=replica.name, guarded=guarded)
        if changed:
            self._on_change()

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("health loop not started")
        return self._session
