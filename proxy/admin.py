"""Reserved paths: liveness, readiness, metrics and the admin API.

These never reach a replica and are never counted as requests. ``/admin/*``
needs ``Authorization: Bearer <token>`` when the token variable named by
``admin.token_env`` is set; when it is unset, admin answers loopback clients
only, so a fresh deployment is never open to the network.

Every answer here carries ``X-Request-Id``; every refusal is section 6's
error body with ``X-Admission-Reason``: 401 ``unauthenticated`` first (so
a client without the token learns nothing about which admin paths exist),
then 404 ``not_found`` for an unknown path and 405 ``method_not_allowed``
(with ``Allow``) for a known one asked with another method.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
from collections.abc import Awaitable, Callable
from functools import partial

import structlog
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from proxy.config_history import ConfigHistory
from proxy.entrance import bearer_token, error_answer, expect_continue, request_id_of
from proxy.errors import (
    BadRequest,
    InternalError,
    MethodNotAllowed,
    NoPreviousConfig,
    NotFound,
    ProxyError,
    Unauthenticated,
)
from proxy.reload import RELOADER, Reloader
from proxy.runtime import RUNTIME, Runtime
from proxy.settings import ConfigError, dump_effective_config
from proxy.state.quota import QuotaLimits
from proxy.telemetry.history import HISTORY
from proxy.telemetry.metrics import PressureCollector, StateCollector, StateSnapshot
from proxy.telemetry.state_metrics import SharedStateCollector
from proxy.token_quota import limits_of
from proxy.ui import add_ui_routes
from proxy.worker_admin import WORKER_ADMIN, set_draining
from proxy.worker_history import WORKER_HISTORY, WorkerHistory
from proxy.worker_metrics import WORKER_METRICS
from proxy.worker_state import WORKER_STATE, WorkerState

log = structlog.get_logger(__name__)
ReservedHandler = Callable[[web.Request], Awaitable[web.StreamResponse]]
#: The admin actions and the method each serves.
ADMIN_METHODS: dict[str, tuple[str, ...]] = {
    "config": ("GET",),
    "state": ("GET",),
    "history": ("GET",),
    "reload": ("POST",),
    "rollback": ("POST",),
}
REPLICA_ACTIONS = ("drain", "undrain")


def state_snapshot(runtime: Runtime) -> StateSnapshot:
    labels = runtime.telemetry.labels
    scheduler = runtime.dispatcher.scheduler
    depth: dict[tuple[str, str], int] = {}
    for name, tenant in runtime.rules.config.tenants.items():
        for cls in tenant.classes():
            key = (labels(name), cls)
            depth[key] = depth.get(key, 0) + scheduler.depth_by_class(name, cls)
    high: dict[str, int] = {}
    for name, value in runtime.dispatcher.depth_high_water().items():
        label = labels(name)
        high[label] = max(high.get(label, 0), value)
    replicas = [
        (r.name, r.inflight, r.limit, r.serving and not r.ejected) for r in runtime.pool.replicas
    ]
    gpus = [
        (str(i), reading.utilization, reading.memory_ratio)
        for i, reading in sorted(runtime.gpu.snapshot.items())
    ]
    headroom: dict[str, int] = {}
    for name, value in runtime.dispatcher.headroom_grants_by_tenant().items():
        label = labels(name)
        headroom[label] = headroom.get(label, 0) + value
    model_labels = runtime.telemetry.model_labels
    by_model: dict[str, int] = {}
    depths = runtime.dispatcher.scheduler.depth_by_model()
    # Every served model has its series (0 until a ticket waits), as /admin/state's pools.
    served = runtime.models.served_models() if runtime.models.pooled else frozenset()
    for model in sorted(served | depths.keys()):
        label = model_labels(model)
        by_model[label] = by_model.get(label, 0) + depths.get(model, 0)
    quota: dict[tuple[str, str], int] = {}
    for (name, window), value in runtime.token_quotas.remaining_by_window(
        quota_limits(runtime)
    ).items():
        key = (labels(name), window)
        quota[key] = quota.get(key, 0) + value
    return StateSnapshot(depth, high, replicas, gpus, headroom, by_model, quota)


def quota_limits(runtime: Runtime) -> dict[str, QuotaLimits]:
    """Each tenant's token quota limits, for tenants that have one."""
    limits = {}
    for name, tenant in runtime.rules.config.tenants.items():
        quota = limits_of(tenant.token_quota.per_minute, tenant.token_quota.per_day)
        if quota is not None:
            limits[name] = quota
    return limits


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    runtime = request.app[RUNTIME]
    ready = not runtime.shutting_down and any(r.serving for r in runtime.pool.replicas)
    # Replicas not yet healthy once (an engine still loading its model).
    starting = [r.name for r in runtime.pool.replicas if r.starting]
    return web.json_response(
        {"ready": ready, "shutting_down": runtime.shutting_down, "starting": starting},
        status=200 if ready else 503,
    )


async def metrics(request: web.Request) -> web.Response:
    """This process's metrics; with ``serve --workers N``, every worker's added up
    (``worker_metrics.py``), whichever worker the scrape reached."""
    group = request.app[WORKER_METRICS]
    if group is not None:
        body = await group.scrape()
    else:
        body = generate_latest(request.app[RUNTIME].telemetry.metrics.registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


def _authorized(request: web.Request, runtime: Runtime) -> bool:
    token = os.environ.get(runtime.rules.config.admin.token_env)
    if token:
        given = bearer_token(request.headers.get("Authorization", ""))
        # As bytes: compare_digest refuses non-ASCII text, which a client may send.
        return given is not None and hmac.compare_digest(
            given.encode("utf-8", "surrogateescape"), token.encode("utf-8", "surrogateescape")
        )
    try:
        return ipaddress.ip_address(request.remote or "").is_loopback
    except ValueError:
        return False


def _admin_methods(action: str) -> tuple[str, ...] | None:
    """The methods ``/admin/<action>`` serves, or None when there is no such path."""
    parts = action.split("/")
    if len(parts) == 3 and parts[0] == "replicas" and parts[2] in REPLICA_ACTIONS:
        return ("POST",)
    return ADMIN_METHODS.get(action)


async def admin(request: web.Request) -> web.StreamResponse:
    runtime = request.app[RUNTIME]
    if not _authorized(request, runtime):
        raise Unauthenticated("admin needs a valid bearer token")
    action = request.match_info["action"]
    methods = _admin_methods(action)
    if methods is None:
        raise NotFound("no such admin path")
    if request.method not in methods:
        raise MethodNotAllowed("this admin path does not serve that method", allow=methods)
    if request.method == "GET" and action == "config":
        text = dump_effective_config(runtime.rules.config, mask_secrets=True)
        reloader = request.app[RELOADER]
        if reloader is not None:
            text = history_comment(reloader.history) + text
        return web.Response(text=text, content_type="application/yaml")
    if request.method == "GET" and action == "state":
        group = request.app[WORKER_STATE]  # ``serve --workers N``: every worker's, merged
        return web.json_response(await group.state() if group is not None else admin_state(runtime))
    if request.method == "GET" and action == "history":
        since = request.query.get("since")
        try:
            after = float(since) if since is not None else None
        except ValueError:
            raise BadRequest("since: a number (the t of the last point seen)") from None
        group_history = request.app[WORKER_HISTORY]  # ``serve --workers N``: every worker's
        if group_history is not None:
            return web.json_response(await group_history.since(after))
        return web.json_response(request.app[HISTORY].since(after))
    if request.method == "POST" and action == "reload":
        reloader = request.app[RELOADER]
        if reloader is None:
            return web.json_response(
                {"result": "unavailable", "message": "started without a config file"}, status=409
            )
        result = await reloader.reload("admin")
        if result.ok:
            await _pass_on(request, "reload")
            return web.json_response({"result": "ok"})
        errors = [{"path": i.path, "message": i.message} for i in result.issues]
        return web.json_response({"result": "invalid", "errors": errors}, status=422)
    if request.method == "POST" and action == "rollback":
        answer, running = await rollback(request.app[RELOADER])
        if running is not None:
            await _pass_on(request, "rollback", sha256=running)
        return answer
    parts = action.split("/")
    if request.method == "POST" and len(parts) == 3 and parts[0] == "replicas":
        draining = parts[2] == "drain"
        if not set_draining(runtime, parts[1], draining):
            raise NotFound("no such replica")
        await _pass_on(request, parts[2], replica=parts[1])
        return web.json_response({"replica": parts[1], "draining": draining})
    raise NotFound("no such admin path")


def history_comment(history: ConfigHistory) -> str:
    """The config history as YAML comments above the dump (which still loads)."""
    lines = ["# config_history, newest first (POST /admin/rollback applies the second):"]
    for i, entry in enumerate(history.describe()):
        running = " (running)" if i == 0 else ""
        lines.append(f"#   sha256:{entry['sha256']} applied {entry['applied_at']}{running}")
    return "\n".join(lines) + "\n"


async def _pass_on(request: web.Request, op: str, **fields: str) -> None:
    """``serve --workers N``: the other workers make the same change."""
    group = request.app.get(WORKER_ADMIN)
    if group is not None:
        await group.publish(op, **fields)


async def rollback(reloader: Reloader | None) -> tuple[web.Response, str | None]:
    """``POST /admin/rollback``: the previous good config runs again, and which it is
    (with the SHA-256 now running, None when nothing was rolled back)."""
    if reloader is None:
        raise NoPreviousConfig("started without a config file: there is no config history")
    try:
        running, replaced = await reloader.rollback()
    except ConfigError as exc:  # a TLS file of the old config changed or vanished since
        errors = [{"path": i.path, "message": i.message} for i in exc.issues]
        return web.json_response({"result": "invalid", "errors": errors}, status=422), None
    answer = web.json_response(
        {
            "result": "ok",
            "running": running.describe(),
            "replaced": replaced.describe(),
            "history": reloader.history.describe(),
        }
    )
    return answer, running.sha256


def reserved_path(handler: ReservedHandler, methods: tuple[str, ...] | None) -> ReservedHandler:
    """``handler`` behind the answers every reserved path owes its client.

    ``X-Request-Id`` on every answer; 405 with ``Allow`` for a method not in
    ``methods`` (None: the handler checks); a ``ProxyError`` becomes section
    6's error answer, and anything unexpected a 500 ``internal_error``
    without details (they go to the log).
    """

    async def answer(request: web.Request) -> web.StreamResponse:
        request_id = request_id_of(request)
        try:
            if methods is not None and request.method not in methods:
                raise MethodNotAllowed("this path does not serve that method", allow=methods)
            response = await handler(request)
        except ProxyError as err:
            return error_answer(err, request_id)
        except Exception:
            log.exception("unhandled error", request_id=request_id, path=request.path)
            return error_answer(InternalError("internal error"), request_id)
        response.headers["X-Request-Id"] = request_id
        return response

    return answer


def _engine_state(runtime: Runtime, name: str) -> dict[str, float | None] | None:
    """The replica's last fresh engine metrics (``metrics_url``), None without any."""
    reading = runtime.health.engine_reading(name)
    if reading is None:
        return None
    return {"waiting": reading.waiting, "running": reading.running, "kv_cache": reading.kv_cache}


def _gpu_state(runtime: Runtime, index: int | None) -> dict[str, float] | None:
    """The replica's GPU (``gpu_index``, sidecar mode) as last sampled, None when unknown."""
    reading = runtime.gpu.snapshot.get(index) if index is not None else None
    if reading is None:
        return None
    return {
        "utilization": reading.utilization,
        "memory_used": reading.memory_used,
        "memory_total": reading.memory_total,
    }


def admin_state(runtime: Runtime) -> dict[str, object]:
    dispatcher = runtime.dispatcher
    table = runtime.models
    pooled = table.pooled
    tenants = {
        name: {
            "queued": dispatcher.scheduler.depth(name),
            "inflight": dispatcher.inflight(name),
            "weight": t.weight,
            "max_concurrency": t.max_concurrency,
            "queue_capacity": t.queue_capacity,
            "priority": t.priority,
            "rate_per_s": t.rate_per_s,
            "quota": runtime.token_quotas.use(
                name, limits_of(t.token_quota.per_minute, t.token_quota.per_day)
            ),
        }
        for name, t in runtime.rules.config.tenants.items()
    }
    replicas = {
        r.name: {
            "inflight": r.inflight,
            "limit": r.limit,
            "headroom": r.headroom,
            "ejected": r.ejected,
            "draining": r.draining,
            "warming": r.warming,
            "starting": r.starting,
            "state": r.state,
            "saturated": r.saturated,
            "gpu_guarded": r.gpu_guarded,
            "consecutive_failures": r.failures,
            "probe_error": r.probe_error,
            "engine": _engine_state(runtime, r.name),
            "gpu": _gpu_state(runtime, r.config.gpu_index),
            "models": sorted(table.models_of(r.name)),
            "pool": ", ".join(sorted(table.models_of(r.name))) if pooled else None,
        }
        for r in runtime.pool.replicas
    }
    # Model pools (empty while the proxy does not route by model).
    pools = {
        model: {
            "replicas": sorted(table.pool(model)),
            "aliases": table.aliases_of(model),
            "queued": dispatcher.scheduler.depth_of_model(model),
        }
        for model in sorted(table.served_models())
        if pooled
    }
    budget = runtime.retry_budget
    return {
        "tenants": tenants,
        "replicas": replicas,
        "pools": pools,
        "retry_budget": {"allowance": budget.allowance(), "summary": repr(budget)},
        "headroom_grants": dispatcher.headroom_grants,
        "shutting_down": runtime.shutting_down,
    }


def add_admin_routes(app: web.Application) -> None:
    runtime = app[RUNTIME]
    sockets = app[WORKER_METRICS]
    app[WORKER_STATE] = WorkerState(sockets, runtime, admin_state) if sockets is not None else None
    app[WORKER_HISTORY] = WorkerHistory(sockets, app[HISTORY]) if sockets is not None else None
    runtime.telemetry.metrics.registry.register(StateCollector(lambda: state_snapshot(runtime)))
    runtime.telemetry.metrics.registry.register(
        PressureCollector(
            lambda: runtime.dispatcher.pressure.by_class(runtime.rules.config.priorities)
        )
    )
    runtime.telemetry.metrics.registry.register(SharedStateCollector(lambda: runtime.state))
    get = ("GET", "HEAD")
    # Each with the entrance's Expect handler: aiohttp's own answers an unknown
    # expectation with a plain-text 417 that quotes it.
    add = partial(app.router.add_route, "*", expect_handler=expect_continue)
    add("/healthz", reserved_path(healthz, get))
    add("/readyz", reserved_path(readyz, get))
    add("/metrics", reserved_path(metrics, get))
    add_ui_routes(app, reserved_path, lambda request: _authorized(request, request.app[RUNTIME]))
    add("/admin/{action:.*}", reserved_path(admin, None))
