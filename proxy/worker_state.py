"""``serve --workers N``: whichever worker it reaches, ``/admin/state`` is the group's.

The N workers share one port, so the kernel hands each ``GET /admin/state``
(the status page polls it every 2 s) to any one of them, and each knows only
its own queues, tenant places and seats: a tenant's queue showed one
worker's share, and jumped to another's at the next poll. As for
``/metrics`` (``worker_metrics.py``), each worker also serves its own view on
its group socket (``GET /state``), and the worker asked reads its siblings'
there, all at once, and merges the views field by field (``merge``), each by
a rule of what it means across processes (``STATE_RULES`` and the per-entry
tables below it):

- what each worker holds of its own is summed: queued, in flight (a tenant's
  places, a replica's seats), a pool's queue, the headroom grants, and a
  tenant's ``queue_capacity`` (each worker queues up to it);
- what the group shares through Redis, or reads from the one config file, is
  one figure, not N: a tenant's ``max_concurrency`` and rate (enforced in
  Redis across the group), a replica's limit and headroom (its seats are
  counted in Redis), its models and pool, its engine's and GPU's readings:
  the answering worker's own, else the first sibling's that has one;
- token quota use, each worker's last reading of the counters in Redis: per
  window, the reading with the least left (the latest, within a window);
- health, which each worker judges by its own probes: one worker that sees
  a problem shows it (a flag any worker set, the worst ``state``, the most
  consecutive failures, a probe error);
- the retry budget: requests and retries summed, the floor
  (``min_retries_per_s``) counted once, as a single process counts it.

A sibling that does not answer within ``SIBLING_TIMEOUT_S`` is left out and
named in the answer's ``workers`` field: unlike a counter, an old view is
wrong (a queue seconds old reads as now), and the operator can tell. One
that nothing listens for (a worker killed) is left out and its socket
removed (``worker_metrics.ask``). No I/O in ``merge``; outside a group none
of this runs, and ``/admin/state`` is one process's view, as it always was.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import structlog
from aiohttp import web

from proxy.retries import BUDGET_WINDOW_S
from proxy.runtime import Runtime
from proxy.worker_metrics import Unanswered, WorkerMetrics, ask

log = structlog.get_logger(__name__)

#: A sibling that has not answered by then is left out (and named in ``workers``).
SIBLING_TIMEOUT_S = 1.0
#: The route each worker serves its own view on, on its group socket.
ROUTE = "/state"

View = dict[str, Any]
#: How one field's values, one per worker that has it (the answering worker's
#: first), make the group's.
Rule = Callable[[Sequence[Any]], Any]


def total(values: Sequence[Any]) -> Any:
    return sum(values)


def known(values: Sequence[Any]) -> Any:
    """The same thing seen by every worker: the first that knows it (None: none does)."""
    return next((v for v in values if v is not None), None)


def either(values: Sequence[Any]) -> bool:
    return any(values)


def most(values: Sequence[Any]) -> Any:
    return max(values)


def union(values: Sequence[Any]) -> list[Any]:
    return sorted({v for found in values for v in found})


#: ``Replica.state``'s words, the worst first.
STATE_ORDER = ("ejected", "starting", "draining", "serving")


def worst_state(values: Sequence[Any]) -> Any:
    return min(values, key=lambda v: STATE_ORDER.index(v) if v in STATE_ORDER else len(STATE_ORDER))


def least_left(values: Sequence[Any]) -> Any:
    """A tenant's token quota: per window the reading with the least left; the shown
    ``used`` and ``limit`` taken again from it (the day's, else the minute's)."""
    readings = [v for v in values if v is not None]
    if not readings:
        return None
    merged = dict(readings[0])
    for window in ("minute", "day"):
        found = [r[window] for r in readings if r.get(window) is not None]
        if found:
            merged[window] = min(found, key=lambda w: w["remaining"])
    shown = merged.get("day") or merged["minute"]
    merged["used"], merged["limit"] = shown["used"], shown["limit"]
    return merged


def retry_budget(values: Sequence[Any]) -> dict[str, Any]:
    """Requests and retries summed; the allowance as one process would count them all
    (``RetryBudget.allowance``: the floor once, not once per worker)."""
    requests = sum(v["requests"] for v in values)
    retries = sum(v["retries"] for v in values)
    first = values[0]
    return {
        "allowance": first["ratio"] * requests + first["floor"],
        "summary": f"<RetryBudget {retries} retries / {requests} requests in {BUDGET_WINDOW_S} s>",
    }


def _fields(entries: Sequence[Mapping[str, Any]], rules: Mapping[str, Rule]) -> View:
    """One entry of the group from each worker's (fields in the first's order).

    A field without a rule (none: ``tests/test_worker_state.py`` checks every
    field has one) is the answering worker's.
    """
    merged: View = {}
    for key in dict.fromkeys(k for entry in entries for k in entry):
        values = [entry[key] for entry in entries if key in entry]
        rule = rules.get(key)
        merged[key] = rule(values) if rule is not None else values[0]
    return merged


def per_name(rules: Mapping[str, Rule]) -> Rule:
    """A map of named entries (tenants, replicas, pools), each merged by ``rules``; an
    entry only some workers have (a reload reaching them one by one) is theirs."""

    def merged(maps: Sequence[Mapping[str, Mapping[str, Any]]]) -> View:
        names = dict.fromkeys(name for found in maps for name in found)
        return {name: _fields([m[name] for m in maps if name in m], rules) for name in names}

    return merged


TENANT_RULES: dict[str, Rule] = {
    "queued": total,
    "inflight": total,
    "weight": known,
    "max_concurrency": known,  # one cap across the group (tenant places in Redis)
    "queue_capacity": total,  # each worker's queue holds this many
    "priority": known,
    "rate_per_s": known,  # one bucket across the group
    "quota": least_left,
}
REPLICA_RULES: dict[str, Rule] = {
    "inflight": total,  # each worker's seats (its leases in Redis)
    "limit": known,  # the seats in Redis are the group's, not each worker's
    "headroom": known,
    "ejected": either,
    "draining": either,
    "warming": either,
    "starting": either,
    "state": worst_state,
    "saturated": either,
    "gpu_guarded": either,
    "consecutive_failures": most,
    "probe_error": known,
    "engine": known,
    "gpu": known,
    "models": union,
    "pool": known,
}
POOL_RULES: dict[str, Rule] = {
    "replicas": union,
    "aliases": union,
    "queued": total,
}
STATE_RULES: dict[str, Rule] = {
    "tenants": per_name(TENANT_RULES),
    "replicas": per_name(REPLICA_RULES),
    "pools": per_name(POOL_RULES),
    "retry_budget": retry_budget,
    "headroom_grants": total,
    "shutting_down": either,  # one worker draining shows
}


def merge(parts: Sequence[View]) -> View:
    """The group's ``/admin/state`` from each worker's part (``own_part``), the
    answering worker's first."""
    return _fields(parts, STATE_RULES)


def own_part(runtime: Runtime, view: Callable[[Runtime], dict[str, object]]) -> View:
    """This worker's ``/admin/state`` view, with what the retry budget's merge needs."""
    part: View = dict(view(runtime))
    budget = runtime.retry_budget
    requests, retries = budget.counts()
    part["retry_budget"] = {
        **part["retry_budget"],
        "requests": requests,
        "retries": retries,
        "ratio": budget.ratio,
        "floor": budget.min_per_s * BUDGET_WINDOW_S,
    }
    return part


def _pid(path: Path) -> int | str:
    """The worker a socket is (its file is named by its pid)."""
    try:
        return int(path.stem)
    except ValueError:
        return path.stem


class WorkerState:
    """This worker's view on its group socket, and the group's merged ``/admin/state``."""

    __slots__ = ("_runtime", "_sockets", "_view")

    def __init__(
        self,
        sockets: WorkerMetrics,
        runtime: Runtime,
        view: Callable[[Runtime], dict[str, object]],
    ) -> None:
        self._sockets = sockets
        self._runtime = runtime
        self._view = view
        sockets.serve(ROUTE, self._own)

    def __repr__(self) -> str:
        return f"<WorkerState {self._sockets.path}{ROUTE}>"

    async def _own(self, request: web.Request) -> web.Response:
        return web.json_response(own_part(self._runtime, self._view))

    async def state(self) -> View:
        """Every worker's view merged, with ``workers``: how many answered, which did not."""
        siblings = await self._sockets.siblings()
        own = own_part(self._runtime, self._view)
        found, unanswered = await ask_all(siblings, ROUTE)
        merged = merge([own, *found])
        merged["workers"] = workers_field(1 + len(found), unanswered)
        return merged


async def ask_all(siblings: Sequence[Path], route: str) -> tuple[list[View], list[int | str]]:
    """Every sibling's JSON answer to ``GET route``, all asked at once, each within
    ``SIBLING_TIMEOUT_S``: the answers, and the workers that did not answer.

    A dead sibling is in neither (``worker_metrics.ask`` removes its socket).
    """
    found = await asyncio.gather(*(_sibling(path, route) for path in siblings))
    answers, unanswered = [], []
    for path, answer in zip(siblings, found, strict=True):
        if isinstance(answer, Unanswered):
            unanswered.append(_pid(path))
        elif answer is not None:
            answers.append(answer)
    return answers, sorted(unanswered, key=str)


def workers_field(answered: int, unanswered: Sequence[int | str]) -> View:
    """An answer's ``workers``: how many workers it counts (this one included), which
    did not answer, and which worker gave it."""
    return {"answered": answered, "unanswered": list(unanswered), "served_by": os.getpid()}


async def _sibling(path: Path, route: str) -> View | Unanswered | None:
    """A sibling's answer; None for a dead one, ``Unanswered`` for one that did not answer."""
    try:
        text = await ask(path, route, SIBLING_TIMEOUT_S)
        answer = None if text is None else json.loads(text)
    except (Unanswered, ValueError) as exc:
        log.warning("worker state not read", socket=str(path), route=route, error=str(exc))
        return exc if isinstance(exc, Unanswered) else Unanswered(str(exc))
    if answer is not None and not isinstance(answer, dict):
        return Unanswered("not a JSON object")
    return answer


#: The app's ``WorkerState``; None outside a ``serve --workers`` group.
WORKER_STATE: web.AppKey[WorkerState | None] = web.AppKey("worker_state")
