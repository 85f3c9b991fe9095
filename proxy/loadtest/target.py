"""What a load test is aimed at: the proxy or a bare engine, its config, and its load now.

Owns ``identify`` (one look at the target before the load: proxy or engine,
the proxy's effective config and its fingerprint, whether the replicas are
simulators, which loopback ports serve it) and ``read_busy`` (requests in
flight and queued right now, for the "was it idle when the level started"
note). Read-only: it never changes the target.

Through the proxy, everything comes from its admin API (``GET /admin/state``
and ``GET /admin/config``, which answer loopback clients without a token
unless ``admin.token_env`` is set; ``--admin-token-env`` names the variable
holding the token otherwise). Against an engine, from its ``/metrics``
(the waiting and running gauges the proxy's health probe reads). Every
failure here degrades to "unknown", noted in the report; none is fatal.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import yaml
from prometheus_client.parser import text_string_to_metric_families

from proxy.health import parse_engine_metrics

__all__ = [
    "Busy",
    "ConfigFingerprint",
    "TargetInfo",
    "fingerprint",
    "identify",
    "is_loopback",
    "read_busy",
]

#: Longest one admin or metrics read may take.
READ_TIMEOUT_S = 3.0
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "::1", "localhost"})


def is_loopback(url: str) -> bool:
    host = urlsplit(url).hostname or ""
    return host in LOOPBACK_HOSTS or host.startswith("127.")


@dataclass(frozen=True, slots=True)
class ConfigFingerprint:
    """The proxy config a run measured: SHA-256 of ``GET /admin/config`` and its key figures.

    The hash is over the effective config exactly as the proxy serves it
    (defaults filled in, secrets masked), so two runs with the same hash ran
    the same rules; ``summary`` names the knobs that shape capacity.
    """

    sha256: str
    summary: Mapping[str, Any] = field(default_factory=dict)

    @property
    def short(self) -> str:
        return f"sha256:{self.sha256[:12]}"

    def seats(self) -> int:
        """Seats of every replica (``max_concurrency`` summed)."""
        return sum(int(r.get("max_concurrency") or 0) for r in self.summary.get("replicas", []))

    def describe(self, *keys: str) -> str:
        """A short text of the named summary parts, e.g. ``seats 8 (r0 4, r1 4); queue_ms 400``."""
        parts: list[str] = [self.short]
        summary = self.summary
        for key in keys:
            if key == "seats":
                replicas = summary.get("replicas", [])
                each = ", ".join(f"{r['name']} {r.get('max_concurrency')}" for r in replicas)
                parts.append(f"seats {self.seats()} ({each})")
            elif key == "queues":
                tenants = summary.get("tenants", {})
                caps = ", ".join(f"{n} {t.get('queue_capacity')}" for n, t in tenants.items())
                parts.append(f"queue_ms {summary.get('queue_ms')}; queue_capacity {caps}")
            elif key == "retry":
                retry = summary.get("retry", {})
                parts.append(
                    f"retry max_attempts {retry.get('max_attempts')}, "
                    f"budget_ratio {retry.get('budget_ratio')}"
                )
            elif key in summary and summary[key] is not None:
                parts.append(f"{key} {summary[key]}")
        return "; ".join(parts)


def fingerprint(text: str) -> ConfigFingerprint:
    """The fingerprint of an effective config's YAML text (what ``/admin/config`` serves).

    The proxy precedes the YAML with ``config_history`` comment lines (hashes
    and times of the files applied); they are left out of the hash, so the
    same rules keep the same fingerprint after a reload of an identical file.
    """
    config_lines = [line for line in text.splitlines(keepends=True) if not line.startswith("#")]
    digest = hashlib.sha256("".join(config_lines).encode("utf-8")).hexdigest()
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError:
        doc = None
    if not isinstance(doc, dict):
        return ConfigFingerprint(digest)
    replicas = [
        {
            "name": r.get("name"),
            "url": r.get("url"),
            "max_concurrency": r.get("max_concurrency"),
            "models": r.get("models"),
        }
        for r in doc.get("replicas") or []
        if isinstance(r, dict)
    ]
    tenants = {
        str(name): {
            "priority": t.get("priority"),
            "max_concurrency": t.get("max_concurrency"),
            "queue_capacity": t.get("queue_capacity"),
            "rate_per_s": t.get("rate_per_s"),
        }
        for name, t in (doc.get("tenants") or {}).items()
        if isinstance(t, dict)
    }
    budgets = doc.get("budgets") or {}
    retry = doc.get("retry") or {}
    summary: dict[str, Any] = {
        "replicas": replicas,
        "tenants": tenants,
        "queue_ms": budgets.get("queue_ms"),
        "first_byte_ms": budgets.get("first_byte_ms"),
        "total_ms": budgets.get("total_ms"),
        "retry": {k: retry.get(k) for k in ("max_attempts", "budget_ratio", "retry_on")},
        "routing": (doc.get("routing") or {}).get("policy"),
    }
    for key in ("mode", "overload"):  # newer proxies' keys, when present
        if key in doc:
            summary[key] = doc[key]
    return ConfigFingerprint(digest, summary)


@dataclass(frozen=True, slots=True)
class TargetInfo:
    """What ``identify`` learned; ``kind`` is ``proxy`` or ``engine``."""

    kind: str
    admin: bool = False
    config: ConfigFingerprint | None = None
    simulator: bool = False
    #: Loopback ports of the engines behind the target (the target's own port for an engine).
    engine_ports: tuple[int, ...] = ()
    notes: tuple[str, ...] = ()

    @property
    def is_proxy(self) -> bool:
        return self.kind == "proxy"


async def _get(
    session: aiohttp.ClientSession, url: str, headers: Mapping[str, str]
) -> tuple[int, str, Mapping[str, str]] | None:
    timeout = aiohttp.ClientTimeout(total=READ_TIMEOUT_S)
    try:
        async with session.get(url, headers=dict(headers), timeout=timeout) as resp:
            return resp.status, await resp.text(), dict(resp.headers)
    except (aiohttp.ClientError, TimeoutError, UnicodeDecodeError):
        return None


def _port(url: str) -> int | None:
    parts = urlsplit(url)
    try:
        return parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        return None


async def _is_simulator(session: aiohttp.ClientSession, url: str) -> bool:
    answer = await _get(session, url.rstrip("/") + "/sim/stats", {})
    return answer is not None and answer[0] == 200


async def identify(
    session: aiohttp.ClientSession, base_url: str, admin_headers: Mapping[str, str]
) -> TargetInfo:
    """Proxy or engine; the proxy's config fingerprint; simulators; local engine ports."""
    notes: list[str] = []
    state = await _get(session, base_url + "/admin/state", admin_headers)
    is_proxy = state is not None and (
        (state[0] == 200 and '"replicas"' in state[1]) or "X-Admission-Reason" in state[2]
    )
    if not is_proxy:
        port = _port(base_url)
        local = is_loopback(base_url) and port is not None
        return TargetInfo(
            kind="engine",
            simulator=await _is_simulator(session, base_url),
            engine_ports=(port,) if local and port is not None else (),
        )
    assert state is not None
    if state[0] != 200:
        notes.append(
            f"the proxy's admin API answered {state[0]}: no config fingerprint, idle check "
            "or replica readings (give the admin token with --admin-token-env)"
        )
        return TargetInfo(kind="proxy", notes=tuple(notes))
    answer = await _get(session, base_url + "/admin/config", admin_headers)
    config = fingerprint(answer[1]) if answer is not None and answer[0] == 200 else None
    if config is None:
        notes.append("the proxy did not serve /admin/config: no config fingerprint")
    urls = [str(r["url"]) for r in (config.summary.get("replicas", []) if config else [])]
    simulator = bool(urls)
    for url in urls:
        if not await _is_simulator(session, url):
            simulator = False
            break
    ports = tuple(port for url in urls if is_loopback(url) and (port := _port(url)) is not None)
    return TargetInfo(
        kind="proxy",
        admin=True,
        config=config,
        simulator=simulator,
        engine_ports=ports,
        notes=tuple(notes),
    )


@dataclass(frozen=True, slots=True)
class Busy:
    """Requests in flight and queued at the target right now, and where that was read."""

    inflight: float
    queued: float
    source: str

    @property
    def idle(self) -> bool:
        return self.inflight <= 0 and self.queued <= 0

    def describe(self) -> str:
        return f"{self.inflight:g} in flight, {self.queued:g} queued ({self.source})"


def pool_in_state(state: Mapping[str, Any], model: str) -> str | None:
    """The pool ``model`` reaches in ``/admin/state``'s ``pools``: itself or an alias's target."""
    pools: Mapping[str, Any] = state.get("pools") or {}
    if model in pools:
        return model
    for name, pool in pools.items():
        if isinstance(pool, Mapping) and model in (pool.get("aliases") or ()):
            return str(name)
    return None


async def resolve_pool(
    session: aiohttp.ClientSession,
    base_url: str,
    info: TargetInfo,
    admin_headers: Mapping[str, str],
    model: str,
    metrics_url: str | None = None,
) -> tuple[str, str | None]:
    """The pool name ``--model`` is measured by (an alias's target), and a note when the
    proxy does not route it to a pool (its fleet-wide figures are read instead).

    The proxy's gauges and ``/admin/state`` name pools by the model served, so an
    alias must be resolved: through ``/admin/state`` (its pools list their
    aliases); without the admin API the pool gauge's labels on ``metrics_url``
    can only tell that the name is not a pool.
    """
    if not info.is_proxy:
        return model, None
    pools: list[str] | None = None
    if info.admin:
        answer = await _get(session, base_url + "/admin/state", admin_headers)
        try:
            state = json.loads(answer[1]) if answer is not None and answer[0] == 200 else None
        except ValueError:
            state = None
        if isinstance(state, dict):
            pool = pool_in_state(state, model)
            if pool is not None:
                return pool, None
            pools = sorted(state.get("pools") or {})
    if pools is None and metrics_url is not None:
        answer = await _get(session, metrics_url, {})
        if answer is not None and answer[0] == 200:
            try:
                pools = pool_labels(answer[1])
            except ValueError:
                pools = None
            if pools is not None and (model in pools or not pools):
                return model, None  # a pool, or a proxy whose gauge lists none yet
    if pools is None:
        return model, None
    listed = ", ".join(pools) or "none: it does not route by model"
    return model, (
        f"--model {model!r} is no model pool of the proxy (pools: {listed}; an alias "
        "resolves only with the admin API): idle checks and queue depth read for the "
        "whole fleet"
    )


async def pool_of(
    session: aiohttp.ClientSession,
    base_url: str,
    info: TargetInfo,
    admin_headers: Mapping[str, str],
    model: str,
    metrics_url: str | None,
    *,
    named: bool,
) -> tuple[str | None, str | None]:
    """The pool a run's model is measured by, and a note; ``None``: the whole fleet.

    The model a run sends is its pool whether the operator named it (``named``)
    or it was discovered (the first of ``/v1/models``): otherwise another pool's
    traffic marks the run's levels busy. A discovered model that is no pool (a
    proxy not routing by model) is measured fleet-wide without a note; a named
    one says so.
    """
    pool, note = await resolve_pool(session, base_url, info, admin_headers, model, metrics_url)
    if note is not None and not named:
        return None, None
    return pool, note


def pool_labels(text: str) -> list[str]:
    """The pools a proxy's ``/metrics`` names (``admission_model_queue_depth``), sorted."""
    return sorted(
        {
            sample.labels.get("model", "")
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == "admission_model_queue_depth"
        }
    )


def _busy_from_state(state: Mapping[str, Any], model: str | None) -> Busy:
    """In flight and queued from ``/admin/state``: one pool's when ``model`` reaches one."""
    replicas: Mapping[str, Any] = state.get("replicas") or {}
    pools: Mapping[str, Any] = state.get("pools") or {}
    name = pool_in_state(state, model) if model else None
    pool = pools.get(name) if name else None
    if pool is not None:
        members = set(pool.get("replicas") or [])
        chosen = [r for name, r in replicas.items() if name in members]
        queued = float(pool.get("queued") or 0)
    else:
        chosen = list(replicas.values())
        queued = float(sum((t.get("queued") or 0) for t in (state.get("tenants") or {}).values()))
    inflight = float(sum(r.get("inflight") or 0 for r in chosen))
    # The engines' own gauges catch work the proxy no longer tracks (a request
    # the client abandoned that the engine still computes).
    engine_running = sum(
        float((r.get("engine") or {}).get("running") or 0) for r in chosen if r.get("engine")
    )
    engine_waiting = sum(
        float((r.get("engine") or {}).get("waiting") or 0) for r in chosen if r.get("engine")
    )
    source = "proxy /admin/state" + (f", pool {name}" if pool is not None else "")
    return Busy(max(inflight, engine_running), queued + engine_waiting, source)


def _busy_from_metrics(text: str) -> Busy | None:
    """An engine's running and waiting gauges, read as the proxy's health probe reads them."""
    reading = parse_engine_metrics(text)
    if reading.running is None and reading.waiting is None:
        return None
    return Busy(reading.running or 0.0, reading.waiting or 0.0, "engine /metrics")


async def read_busy(
    session: aiohttp.ClientSession,
    base_url: str,
    info: TargetInfo,
    admin_headers: Mapping[str, str],
    *,
    metrics_url: str | None,
    model: str | None = None,
) -> Busy | None:
    """The target's load right now, or None when it tells nothing."""
    if info.is_proxy:
        if not info.admin:
            return None
        answer = await _get(session, base_url + "/admin/state", admin_headers)
        if answer is None or answer[0] != 200:
            return None
        try:
            state = json.loads(answer[1])
        except ValueError:
            return None
        return _busy_from_state(state, model) if isinstance(state, dict) else None
    if metrics_url is None:
        return None
    answer = await _get(session, metrics_url, {})
    if answer is None or answer[0] != 200:
        return None
    try:
        return _busy_from_metrics(answer[1])
    except ValueError:
        return None
