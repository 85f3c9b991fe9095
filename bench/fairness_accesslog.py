"""What the proxy's access log says about a protected flow's queue wait.

The load generator names every request (``X-Request-Id``) and the proxy logs
each one when it ends, with its ``queue_ms`` and ``total_ms``. From those the
moment each ticket was dispatched is rebuilt (``end - total + entrance +
queue``), for every tenant, which splits a protected request's queue wait in
two:

- the wait for the *first seat to free* after it arrived: no ordering policy
  can avoid this part while the seats are all busy (the proxy never preempts);
- the rest, when other tenants' tickets were dispatched ahead of it: that
  part is the scheduler's choice. ``passed_over`` counts those tickets.

The rebuilt times mix the log line's wall-clock timestamp with the proxy's
monotonic durations, so dispatches less than ``MARGIN_S`` apart are not
ordered. No I/O but reading the one file.
"""

from __future__ import annotations

import bisect
import datetime
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

from bench.common import access_log_requests

#: Dispatches closer than this to a ticket's enqueue or dispatch are not counted.
MARGIN_S = 0.002


@dataclass(frozen=True, slots=True)
class Entry:
    request_id: str
    tenant: str
    status: int
    enqueued_s: float
    queue_ms: float
    #: None when the ticket never got a seat (refused or timed out in the queue).
    dispatched_s: float | None


@dataclass(frozen=True, slots=True)
class Wait:
    """One protected request's queue wait, split."""

    queue_ms: float
    first_seat_ms: float
    passed_over: int


def read(path: Path) -> dict[str, Entry]:
    """Every request line of a proxy's stdout, by request id."""
    entries: dict[str, Entry] = {}
    if not path.exists():
        return entries
    for event in access_log_requests(path.read_text(errors="replace")):
        total, queue = event.get("total_ms"), event.get("queue_ms")
        if total is None or queue is None:
            continue
        ended = datetime.datetime.fromisoformat(event["timestamp"].replace("Z", "+00:00"))
        enqueued = ended.timestamp() - total / 1000.0 + (event.get("entrance_ms") or 0.0) / 1000.0
        dispatched = enqueued + queue / 1000.0 if event.get("replica") else None
        entries[event["request_id"]] = Entry(
            request_id=event["request_id"],
            tenant=event.get("tenant", ""),
            status=int(event.get("status", 0)),
            enqueued_s=enqueued,
            queue_ms=float(queue),
            dispatched_s=dispatched,
        )
    return entries


def waits(entries: dict[str, Entry], protected: Collection[str]) -> dict[str, Wait]:
    """The split wait of each protected request that was dispatched, by request id."""
    ids = set(protected)
    tenants = {entries[i].tenant for i in ids if i in entries}
    every = sorted(e.dispatched_s for e in entries.values() if e.dispatched_s is not None)
    others = sorted(
        e.dispatched_s
        for e in entries.values()
        if e.dispatched_s is not None and e.tenant not in tenants
    )
    split: dict[str, Wait] = {}
    for request_id in ids:
        entry = entries.get(request_id)
        if entry is None or entry.dispatched_s is None:
            continue
        start, end = entry.enqueued_s, entry.dispatched_s
        if end - start <= MARGIN_S:
            split[request_id] = Wait(entry.queue_ms, entry.queue_ms, 0)
            continue
        # The first dispatch of anyone after this ticket arrived (its own at the latest).
        k = bisect.bisect_right(every, start + MARGIN_S)
        first = min(every[k], end) if k < len(every) else end
        passed = bisect.bisect_left(others, end - MARGIN_S) - bisect.bisect_right(
            others, start + MARGIN_S
        )
        split[request_id] = Wait(entry.queue_ms, (first - start) * 1000.0, max(0, passed))
    return split
