"""Wiring: ``build_app`` assembles the proxy from its parts.

Every long-lived resource (the upstream client session) is opened and closed
side by side in a ``cleanup_ctx`` generator, torn down in reverse order.
Every part is built first, then one frozen ``Runtime`` that holds them; the
app is frozen after start-up; components are reached through typed
``AppKey``s (``RUNTIME``, ``RELOADER``). Seams for tests: ``clock`` (time),
``gpu`` (the NVML probe) and ``session_factory`` (the upstream transport).
"""

from __future__ import annotations

import asyncio
import os
import random
from collections.abc import AsyncIterator, Callable
from functools import partial
from typing import TextIO

import aiohttp
from aiohttp import web
from aiohttp.http import SERVER_SOFTWARE
from opentelemetry.sdk.trace import TracerProvider

from proxy.admin import add_admin_routes
from proxy.clock import Clock, MonotonicClock
from proxy.dispatch import Dispatcher
from proxy.entrance import SERVER_HEADER, expect_continue, handle
from proxy.health import Health
from proxy.models import ModelTable
from proxy.quotas import EntranceQuotas
from proxy.reload import RELOADER, Reloader
from proxy.replicas import Replica, ReplicaPool
from proxy.retries import RetryBudget, RetryPolicy
from proxy.runtime import RUNTIME, Rules, Runtime, configure_models
from proxy.scheduler import FairScheduler
from proxy.settings import Config
from proxy.state.quota import TokenQuotaStore, WallClock
from proxy.state.shared import token_quota_store
from proxy.tasks import stop
from proxy.telemetry import Telemetry
from proxy.telemetry.gpu import FakeGpuProbe, GpuProbe, GpuSampler, NvmlProbe
from proxy.telemetry.history import HISTORY, History, history_loop
from proxy.telemetry.logs import FLUSH_INTERVAL_S, AccessLog, flush_logs
from proxy.telemetry.metrics import Metrics, TenantLabels
from proxy.telemetry.tracing import Tracing, provider_from_env
from proxy.tls import tls_by_replica
from proxy.token_quota import TokenQuotas
from proxy.upstream import make_session
from proxy.worker_admin import WORKER_ADMIN, WorkerAdmin
from proxy.worker_metrics import WORKER_METRICS, WorkerMetrics

SessionFactory = Callable[[Config], aiohttp.ClientSession]


async def _server_header(request: web.Request, response: web.StreamResponse) -> None:
    """Name the product, not aiohttp's and Python's versions (aiohttp's default tells a
    scanner which known bugs to try). aiohttp fills its default in before this hook
    runs, so the default is what is replaced; a relayed answer keeps the engine's own
    header unless it is that same default (an engine on this aiohttp and Python)."""
    if response.headers.get("Server") == SERVER_SOFTWARE:
        response.headers["Server"] = SERVER_HEADER


def _default_session(config: Config) -> aiohttp.ClientSession:
    return make_session(config.timeouts.connect_ms / 1000.0)


def _access_log(setting: bool | TextIO) -> AccessLog | None:
    """True: stdout; False: off; a stream: that stream (tests, embedding)."""
    if setting is False:
        return None
    return AccessLog(None if setting is True else setting)


def _flush(runtime: Runtime) -> None:
    flush_logs()
    if runtime.telemetry.access_log is not None:
        runtime.telemetry.access_log.flush()


async def _flush_periodically(runtime: Runtime) -> None:
    while True:
        await asyncio.sleep(FLUSH_INTERVAL_S)
        _flush(runtime)


def build_runtime(
    config: Config,
    *,
    clock: Clock | None = None,
    seed: int | None = None,
    access_log: bool | TextIO = True,
    tracer_provider: TracerProvider | None = None,
    predictive_rejection: bool = True,
    gpu: GpuProbe | None = None,
    quota_clock: Clock | None = None,
    quota_store: TokenQuotaStore | None = None,
) -> Runtime:
    """Every part first, then one frozen ``Runtime`` holding them.

    ``quota_clock``: seconds since the epoch for the token quotas' minute and
    UTC day (tests move a fake one); the wall clock by default. ``quota_store``:
    where the token quotas' counters live; in memory (``LocalTokenQuotas``) by
    default.
    """
    clock = clock or MonotonicClock()
    rules = Rules.from_config(config)
    tls = tls_by_replica(config.replicas)
    replicas = [
        Replica(
            r,
            api_key=os.environ.get(r.api_key_env) if r.api_key_env else None,
            tls=tls[r.name],
        )
        for r in config.replicas
    ]
    pool = ReplicaPool(replicas, rng=random.Random(seed))
    scheduler = FairScheduler(
        {n: p.weight for n, p in config.priorities.items()},
        {n: t.weight for n, t in config.tenants.items()},
    )
    dispatcher = Dispatcher(
        pool, scheduler, clock, rules.tenant_limits(), predictive_rejection=predictive_rejection
    )
    dispatcher.set_observing(config.mode == "observe")
    quotas = EntranceQuotas(clock)
    quotas.configure(rules.rate_limits())
    telemetry = Telemetry(
        Metrics(),
        TenantLabels(config.tenants, config.telemetry.max_tenant_labels),
        access_log=_access_log(access_log),
        tracing=Tracing(tracer_provider),
    )
    models = ModelTable({}, {})
    configure_models(models, config)
    model_labels = telemetry.model_labels
    model_labels.max_labels = config.telemetry.max_tenant_labels
    model_labels.served = models.served_models
    model_labels.forget = partial(telemetry.metrics.model_requests.remove_where, "model")
    dispatcher.seats.models = models
    dispatcher.seats.affinity.max_load_factor = config.routing.max_load_factor
    health = Health(pool, config, clock, dispatcher.fleet_changed, models=models)
    rng = random.Random(seed)
    retry_policy = RetryPolicy(config.retry, rng)
    retry_budget = RetryBudget(config.retry.budget_ratio, config.retry.min_retries_per_s, clock)

    def gpu_guard() -> None:
        health.apply_gpu_guard(sampler.snapshot)

    probe = gpu if gpu is not None else FakeGpuProbe()
    sampler = GpuSampler(probe, gpu_guard, config.gpu.sample_ms / 1000.0)
    state = None
    if config.state.backend == "redis":
        from proxy.state.shared import SharedState

        state = SharedState(config.state, clock)
        dispatcher.shared = state.places
        state.places.on_freed = dispatcher.freed
    # The token quotas' store: in memory for one process, shared with
    # state.backend redis (its failure rule included); a test may pass its own.
    wall = quota_clock or WallClock()
    token_quotas = TokenQuotas(quota_store or token_quota_store(state, wall), wall)
    return Runtime(
        rules, clock, pool, dispatcher, quotas, telemetry, health, retry_policy, retry_budget,
        sampler, models=models, token_quotas=token_quotas, state=state,
    )  # fmt: skip


def build_app(
    config: Config,
    *,
    clock: Clock | None = None,
    session_factory: SessionFactory | None = None,
    seed: int | None = None,
    access_log: bool | TextIO = True,
    gpu: GpuProbe | None = None,
    tracer_provider: TracerProvider | None = None,
    config_path: str | None = None,
    predictive_rejection: bool = True,
    quota_clock: Clock | None = None,
    quota_store: TokenQuotaStore | None = None,
    worker_group: str | None = None,
) -> web.Application:
    """The proxy as an aiohttp application (not yet started).

    ``worker_group``: one of ``serve --workers N`` (with ``state.backend:
    redis``): admin changes pass on to the group's other workers
    (``worker_admin.py``).

    ``config_path``: the file the config came from; enables reload (SIGHUP,
    ``POST /admin/reload``) and the watcher that reloads on a content change.

    ``tracer_provider``: spans go there (tests pass one with an in-memory
    exporter); by default the provider the ``OTEL_*`` variables describe, or
    none at all.

    ``predictive_rejection=False``: never refuse on a predicted wait (the
    false-refusal benchmark's twin); deliberately not a config key.
    """
    provider = tracer_provider if tracer_provider is not None else provider_from_env()
    probe: GpuProbe = gpu if gpu is not None else NvmlProbe()
    runtime = build_runtime(
        config,
        clock=clock,
        seed=seed,
        access_log=access_log,
        tracer_provider=provider,
        predictive_rejection=predictive_rejection,
        gpu=probe,
        quota_clock=quota_clock,
        quota_store=quota_store,
    )
    # The entrance enforces max_body_bytes itself, with the contract's 413 answer.
    app = web.Application(client_max_size=config.server.max_body_bytes + 1)
    app.on_response_prepare.append(_server_header)
    app[RUNTIME] = runtime
    reloader = app[RELOADER] = Reloader(runtime, config_path) if config_path else None
    group = None
    if worker_group is not None and runtime.state is not None:
        group = WorkerAdmin(runtime.state, worker_group, runtime, reloader)
    app[WORKER_ADMIN] = group
    registry = runtime.telemetry.metrics.registry
    sockets = WorkerMetrics(worker_group, registry) if worker_group is not None else None
    app[WORKER_METRICS] = sockets
    factory = session_factory or _default_session

    async def upstream_session(app: web.Application) -> AsyncIterator[None]:
        runtime.open_session(factory(config))
        yield
        await runtime.close_session()

    async def health_loop(app: web.Application) -> AsyncIterator[None]:
        """Probes and warm-ups on their own session: never queued behind client traffic."""
        async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as session:
            task = asyncio.create_task(runtime.health.run(session))
            yield
            await stop(task)

    async def log_flusher(app: web.Application) -> AsyncIterator[None]:
        task = asyncio.create_task(_flush_periodically(runtime))
        yield
        await stop(task)
        _flush(runtime)
        await asyncio.to_thread(runtime.telemetry.tracing.shutdown)  # flushes the exporter

    async def gpu_sampler(app: web.Application) -> AsyncIterator[None]:
        """NVML in a worker thread on an interval; the path reads the snapshot only."""
        task = asyncio.create_task(runtime.gpu.run())
        yield
        await stop(task)
        if isinstance(probe, NvmlProbe):
            await asyncio.to_thread(probe.close)

    app.cleanup_ctx.append(log_flusher)
    app.cleanup_ctx.append(gpu_sampler)

    async def config_watcher(app: web.Application) -> AsyncIterator[None]:
        if reloader is None:
            yield
            return
        task = asyncio.create_task(reloader.watch())
        yield
        await stop(task)

    async def shared_state(app: web.Application) -> AsyncIterator[None]:
        """``state.backend: redis``: renewals, heartbeat, releases, notifications."""
        state = runtime.state
        if state is None:
            yield
            return
        await state.warm()
        loops = state.background() + ([group.listener.run] if group is not None else [])
        tasks = [asyncio.create_task(loop()) for loop in loops]
        yield
        for task in reversed(tasks):
            await stop(task)
        if group is not None:
            await group.close()
        await state.close()

    async def metrics_socket(app: web.Application) -> AsyncIterator[None]:
        """``serve --workers``: this worker's metrics for the group's scrapes."""
        if sockets is None:
            yield
            return
        await sockets.start()
        yield
        await sockets.close()

    app.cleanup_ctx.append(shared_state)
    app.cleanup_ctx.append(metrics_socket)
    app.cleanup_ctx.append(upstream_session)
    app.cleanup_ctx.append(health_loop)
    app.cleanup_ctx.append(config_watcher)
    app[HISTORY] = history = History(runtime.clock)
    app.cleanup_ctx.append(history_loop(history, runtime))
    add_admin_routes(app)
    app.router.add_route("*", "/{tail:.*}", handle, expect_handler=expect_continue)
    return app
