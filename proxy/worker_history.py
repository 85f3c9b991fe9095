"""``serve --workers N``: ``/admin/history`` counts every worker, like ``/admin/state``.

The status page draws each tenant's waits, its requests not served by
reason and its goodput, and each replica's sparkline, from
``/admin/history``, which every worker samples on its own
(``telemetry/history.py``): whichever worker the poll reached, the page
showed that worker's share. Each worker also serves its own history on its
group socket (``GET /history``: its points, and its waits per bucket over
the window), and the worker asked merges them (``merge_points``, ``waits_of``):

- **One grid of points.** Each worker samples every ``interval_s`` on its
  own phase. Their clocks agree (``time.monotonic`` is the host's, and a
  group is one host's processes), so a point belongs to the slot
  ``floor(t / interval_s)``; the group's point for a slot is made of its
  workers' points there, and stamped with the slot's end. A slot is
  answered only once it has ended: answered early, it would lack the point
  of a worker that samples later in the slot, and the page, which asks for
  newer points only, would never see that one.
- **Within one worker**, a slot holds one point, now and then two or none
  (a sample late behind a busy loop): what ended since the previous point
  (completed, good, refused by reason) is added up, the gauges (queued, in
  flight, the replica's readings) are its latest. **Across workers** each
  field goes by ``worker_state``'s rule for the same field of
  ``/admin/state``: queued and in flight summed, readings one figure, the
  worst state.
- **Waits**: each worker's bucket counts over the window are added up, and
  p50 and p95 taken from the sum (quantiles of quantiles would be wrong).

A sibling that does not answer in time is left out of the answer and named
in its ``workers`` field; its points of that slot are not seen by the page.
No I/O in ``merge_points``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from aiohttp import web

from proxy.telemetry.history import History, waits_of
from proxy.worker_metrics import WorkerMetrics
from proxy.worker_state import (
    Rule,
    View,
    ask_all,
    either,
    known,
    per_name,
    total,
    workers_field,
    worst_state,
)

#: The route each worker serves its own history on, on its group socket.
ROUTE = "/history"

Point = dict[str, Any]


def latest(values: Sequence[Any]) -> Any:
    return values[-1]


def added(values: Sequence[Any]) -> Any:
    return sum(values)


def added_by_key(values: Sequence[Mapping[str, float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for counts in values:
        for key, count in counts.items():
            out[key] = out.get(key, 0) + count
    return out


#: Per field: its rule within one worker's slot, then across workers.
TENANT_POINT_RULES: dict[str, tuple[Rule, Rule]] = {
    "queued": (latest, total),
    "inflight": (latest, total),
    "completed": (added, total),
    "good": (added, total),
    "refused": (added_by_key, added_by_key),
}
REPLICA_POINT_RULES: dict[str, tuple[Rule, Rule]] = {
    "inflight": (latest, total),
    "limit": (latest, known),
    "headroom": (latest, known),
    "state": (latest, worst_state),
    "saturated": (latest, either),
    "gpu_guarded": (latest, either),
    "engine_waiting": (latest, known),
    "engine_running": (latest, known),
    "kv_cache": (latest, known),
    "gpu_memory": (latest, known),
}
#: A point's maps of named entries; its ``t`` is the slot's end.
POINT_RULES = {"tenants": TENANT_POINT_RULES, "replicas": REPLICA_POINT_RULES}


def _fold(points: Sequence[Point], step: int) -> Point:
    """One point of several: one worker's in a slot (``step`` 0), or the workers' (1)."""
    folded: Point = {}
    for level, rules in POINT_RULES.items():
        merge = per_name({field: pair[step] for field, pair in rules.items()})
        folded[level] = merge([point[level] for point in points if level in point])
    return folded


def merge_points(
    parts: Sequence[Sequence[Point]], interval_s: float, since: float | None, now: float
) -> list[Point]:
    """The group's points, one per slot that ended after ``since`` and by ``now``,
    from each worker's points (each list oldest first)."""
    slots: dict[int, list[list[Point]]] = {}
    for worker, points in enumerate(parts):
        for point in points:
            slot = math.floor(point["t"] / interval_s)
            end = (slot + 1) * interval_s
            if end > now or (since is not None and end <= since):
                continue
            slots.setdefault(slot, [[] for _ in parts])[worker].append(point)
    merged = []
    for slot in sorted(slots):
        point = _fold([_fold(points, 0) for points in slots[slot] if points], 1)
        point["t"] = (slot + 1) * interval_s
        merged.append(point)
    return merged


def _counts(history: History) -> list[list[Any]]:
    """The waits per bucket over the window, as JSON: ``[layer, tenant label, counts]``."""
    return [[layer, tenant, counts] for (layer, tenant), counts in history.window_counts().items()]


def _since(request: web.Request) -> float | None:
    """A sibling's ``since`` (the group's last slot end the page saw)."""
    since = request.query.get("since")
    try:
        return float(since) if since is not None else None
    except ValueError:
        raise web.HTTPBadRequest(text="since: a number") from None


class WorkerHistory:
    """This worker's history on its group socket, and the group's ``/admin/history``."""

    __slots__ = ("_history", "_sockets")

    def __init__(self, sockets: WorkerMetrics, history: History) -> None:
        self._sockets = sockets
        self._history = history
        sockets.serve(ROUTE, self._own)

    def __repr__(self) -> str:
        return f"<WorkerHistory {self._sockets.path}{ROUTE}, {self._history!r}>"

    def _part(self, since: float | None) -> View:
        """The points of the slots after ``since`` (and the one before: ``merge_points``
        picks), and the waits' bucket counts."""
        history = self._history
        after = since - history.interval_s if since is not None else None
        return {"points": history.since(after)["points"], "waits": _counts(history)}

    async def _own(self, request: web.Request) -> web.Response:
        return web.json_response(self._part(_since(request)))

    async def since(self, since: float | None) -> View:
        """``History.since``'s answer for every worker, with ``workers``."""
        siblings = await self._sockets.siblings()
        history = self._history
        answer = history.since(since)  # ``now`` before any sibling is read
        own = self._part(since)
        # Only the points the page has not seen: the first poll's 300 per worker once.
        route = ROUTE if since is None else f"{ROUTE}?since={since!r}"
        found, unanswered = await ask_all(siblings, route)
        parts = [own, *found]
        answer["points"] = merge_points(
            [part.get("points", []) for part in parts], history.interval_s, since, answer["now"]
        )
        counts: dict[tuple[str, str], list[float]] = {}
        for part in parts:
            for layer, tenant, window in part.get("waits", []):
                summed = counts.setdefault((layer, tenant), [0.0] * len(window))
                if len(summed) == len(window):
                    counts[(layer, tenant)] = [a + b for a, b in zip(summed, window, strict=True)]
        answer["waits"] = waits_of(counts, history.bounds)
        answer["workers"] = workers_field(len(parts), unanswered)
        return answer


#: The app's ``WorkerHistory``; None outside a ``serve --workers`` group.
WORKER_HISTORY: web.AppKey[WorkerHistory | None] = web.AppKey("worker_history")
