"""The last minutes of the proxy's state, kept in memory for the status page.

A page opened during an incident should show the minutes before it, so the
proxy itself keeps them: every ``interval_s`` (2 s) the app's history loop
(owned by ``cleanup_ctx``) appends one point to a ring of ``points`` (300:
ten minutes). A point holds, per tenant label, the queue depth, the requests
in flight and what ended since the previous point (completed, good, and the
requests not served by reason); per replica, its seats, state and last
readings. The request path pays nothing for it: the counts and the waits are
read from the counters and histograms it already updates.

Waits per layer (p50/p95) come from the ``admission_wait_seconds`` buckets
over the last ``WAIT_WINDOW_S``: the difference between the buckets now and a
mark taken about that long ago, interpolated inside a bucket the way
Prometheus' ``histogram_quantile`` does.

Memory is bounded: ``points`` points, each with one entry per tenant label
(``telemetry.max_tenant_labels`` + "other") and per replica, the reasons
bounded by the fixed reason codes; plus ``WAIT_WINDOW_S / MARK_EVERY_S + 1``
marks of one bucket list per (layer, tenant label).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aiohttp import web

from proxy.clock import Clock
from proxy.tasks import stop

if TYPE_CHECKING:
    from proxy.runtime import Runtime

INTERVAL_S = 2.0
POINTS = 300
#: The window of the waits' quantiles, and how often a mark of the buckets is taken.
WAIT_WINDOW_S = 120.0
MARK_EVERY_S = 30.0
LAYERS = ("entrance", "queue", "first_byte")
#: Outcomes shown as "not served": a client that hung up was not refused.
NOT_SERVED = frozenset({"rejected", "timed_out", "failed"})

Point = dict[str, Any]
Buckets = dict[tuple[str, str], tuple[float, ...]]


@dataclass(frozen=True, slots=True)
class Totals:
    """Cumulative counts read from the metrics at one sample."""

    #: (tenant label, outcome, reason) -> requests ended that way.
    ended: Mapping[tuple[str, str, str], float]
    #: tenant label -> goodput.
    good: Mapping[str, float]
    #: (layer, tenant label) -> per-bucket wait counts (not cumulative).
    waits: Buckets
    bounds: tuple[float, ...]


def quantile(q: float, bounds: tuple[float, ...], counts: Iterable[float]) -> float | None:
    """The ``q`` quantile of a histogram's per-bucket counts, None when empty.

    Linear inside the bucket, as ``histogram_quantile``; a rank in the +Inf
    bucket answers the highest finite bound.
    """
    counts = list(counts)
    total = sum(counts)
    if total <= 0:
        return None
    rank = q * total
    seen = 0.0
    for i, count in enumerate(counts):
        if count > 0 and seen + count >= rank:
            upper = bounds[i]
            lower = bounds[i - 1] if i > 0 else 0.0
            if upper == float("inf"):
                return lower
            return lower + (upper - lower) * (rank - seen) / count
        seen += count
    return bounds[-2] if len(bounds) > 1 else None


def waits_of(
    counts: Mapping[tuple[str, str], Sequence[float]], bounds: tuple[float, ...]
) -> dict[str, dict[str, dict[str, float | None]]]:
    """``waits``' answer from per (layer, tenant label) bucket counts over the window."""
    out: dict[str, dict[str, dict[str, float | None]]] = {}
    for (layer, tenant), window in counts.items():
        count = sum(window)
        if count <= 0:
            continue
        out.setdefault(tenant, {})[layer] = {
            "p50": quantile(0.5, bounds, window),
            "p95": quantile(0.95, bounds, window),
            "count": count,
        }
    return out


class History:
    """A ring of points, sampled by ``run``; ``since(t)`` serves ``/admin/history``.

    >>> history = History(clock)            # doctest: +SKIP
    >>> history.sample(point, totals)       # the loop does this every interval_s
    >>> history.since(None)["points"][-1]   # the newest point
    """

    __slots__ = ("_clock", "_last", "_marks", "_points", "interval_s")

    def __init__(self, clock: Clock, *, interval_s: float = INTERVAL_S, points: int = POINTS):
        self._clock = clock
        self.interval_s = interval_s
        self._points: deque[Point] = deque(maxlen=points)
        self._marks: deque[tuple[float, Buckets]] = deque(
            maxlen=int(WAIT_WINDOW_S / MARK_EVERY_S) + 1
        )
        self._last: Totals | None = None

    def sample(self, point: Point, totals: Totals) -> None:
        """Append ``point`` (state now), adding what ended since the previous sample."""
        now = self._clock.now()
        last = self._last
        tenants: dict[str, dict[str, Any]] = point.setdefault("tenants", {})
        for (tenant, outcome, reason), value in totals.ended.items():
            delta = value - (last.ended.get((tenant, outcome, reason), 0.0) if last else 0.0)
            if delta <= 0:
                continue
            entry = tenants.setdefault(tenant, {"queued": 0, "inflight": 0})
            if outcome == "completed":
                entry["completed"] = entry.get("completed", 0) + int(delta)
            elif outcome in NOT_SERVED:
                refused = entry.setdefault("refused", {})
                refused[reason] = refused.get(reason, 0) + int(delta)
        for tenant, value in totals.good.items():
            delta = value - (last.good.get(tenant, 0.0) if last else 0.0)
            if delta > 0:
                tenants.setdefault(tenant, {"queued": 0, "inflight": 0})["good"] = int(delta)
        point["t"] = now
        self._points.append(point)
        if not self._marks or now - self._marks[-1][0] >= MARK_EVERY_S:
            self._marks.append((now, dict(totals.waits)))
        self._last = totals

    def waits(self) -> dict[str, dict[str, dict[str, float | None]]]:
        """Per tenant label and layer: p50, p95 (seconds) and count over the window."""
        return waits_of(self.window_counts(), self.bounds)

    @property
    def bounds(self) -> tuple[float, ...]:
        """The wait buckets' upper bounds (none before the first sample)."""
        return self._last.bounds if self._last is not None else ()

    def window_counts(self) -> dict[tuple[str, str], list[float]]:
        """Per (layer, tenant label) the waits per bucket over the window (a worker
        group's ``/admin/history`` adds each worker's up before taking quantiles)."""
        if self._last is None:
            return {}
        base = self._marks[0][1] if self._marks else {}
        out = {}
        for key, counts in self._last.waits.items():
            before = base.get(key, (0.0,) * len(counts))
            out[key] = [c - b for c, b in zip(counts, before, strict=True)]
        return out

    def since(self, t: float | None) -> dict[str, Any]:
        """The points newer than ``t`` (all without it), and the waits now."""
        points = [p for p in self._points if t is None or p["t"] > t]
        return {
            "interval_s": self.interval_s,
            "window_s": self.interval_s * (self._points.maxlen or 0),
            "wait_window_s": WAIT_WINDOW_S,
            "now": self._clock.now(),
            "points": points,
            "waits": self.waits(),
        }

    async def run(self, runtime: Runtime) -> None:
        """The app's history loop: one sample every ``interval_s``."""
        while True:
            self.sample(state_point(runtime), read_totals(runtime))
            await asyncio.sleep(self.interval_s)

    def __repr__(self) -> str:
        return f"<History {len(self._points)}/{self._points.maxlen} points>"


#: Where the app keeps its ``History`` (admin.py reads it).
HISTORY: web.AppKey[History] = web.AppKey("history", History)


def history_loop(
    history: History, runtime: Runtime
) -> Callable[[web.Application], AsyncIterator[None]]:
    """The ``cleanup_ctx`` entry that owns the sampling task."""

    async def owned(app: web.Application) -> AsyncIterator[None]:
        task = asyncio.create_task(history.run(runtime))
        yield
        await stop(task)

    return owned


def read_totals(runtime: Runtime) -> Totals:
    """The request counters and wait buckets as they are now (no copy kept by them)."""
    metrics = runtime.telemetry.metrics
    ended: dict[tuple[str, str, str], float] = {}
    for (tenant, _priority, outcome, reason), child in metrics.requests.series():
        key = (tenant, outcome, reason)
        ended[key] = ended.get(key, 0.0) + child.value
    good = {values[0]: child.value for values, child in metrics.goodput.series()}
    waits: Buckets = {}
    for (layer, tenant), hist in metrics.wait.series():
        waits[(layer, tenant)] = tuple(hist.counts)
    return Totals(ended, good, waits, metrics.wait.bounds)


def state_point(runtime: Runtime) -> Point:
    """Queue depth and in flight per tenant label; seats, state and readings per replica."""
    labels = runtime.telemetry.labels
    dispatcher = runtime.dispatcher
    tenants: dict[str, dict[str, Any]] = {}
    for name in runtime.rules.config.tenants:
        entry = tenants.setdefault(labels(name), {"queued": 0, "inflight": 0})
        entry["queued"] += dispatcher.scheduler.depth(name)
        entry["inflight"] += dispatcher.inflight(name)
    replicas = {}
    for r in runtime.pool.replicas:
        reading = runtime.health.engine_reading(r.name)
        index = r.config.gpu_index
        gpu = runtime.gpu.snapshot.get(index) if index is not None else None
        replicas[r.name] = {
            "inflight": r.inflight,
            "limit": r.limit,
            "headroom": r.headroom,
            "state": r.state,
            "saturated": r.saturated,
            "gpu_guarded": r.gpu_guarded,
            "engine_waiting": reading.waiting if reading is not None else None,
            "engine_running": reading.running if reading is not None else None,
            "kv_cache": reading.kv_cache if reading is not None else None,
            "gpu_memory": gpu.memory_ratio if gpu is not None else None,
        }
    return {"tenants": tenants, "replicas": replicas}
