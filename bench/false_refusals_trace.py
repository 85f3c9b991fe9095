"""Predicted against realised queue waits, per ticket, in a live proxy (``--trace``).

A diagnostic of ``bench.false_refusals``: the proxy process it serves wraps
its ``Dispatcher`` so that every ticket writes one JSON line: the wait the
estimator predicted when it arrived (computed even when prediction is off, as
in the twin), the capacity and mean seat time behind it, the queue it saw,
and what became of it (``immediate``, ``granted`` after ``wait_s``,
``expired`` or ``refused``). Reading the twin's file shows the estimator's
error with no feedback from its own refusals.

Only the benchmark's proxy processes load this; the proxy itself has no
trace hook.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from proxy.admitted import Deadline
from proxy.dispatch import Dispatcher
from proxy.errors import ProxyError
from proxy.scheduler import Ticket


def install(path: Path) -> Callable[[], None]:
    """Wrap ``Dispatcher`` for this process: one line per ticket into ``path``.

    Returns the function that puts the dispatcher back and closes the file.
    """
    out: IO[str] = path.open("w", buffering=1)
    seen: dict[int, dict[str, Any]] = {}
    enqueue_in: Callable[..., Ticket] = Dispatcher.enqueue_in
    grant: Callable[..., None] = Dispatcher._grant
    fail: Callable[..., None] = Dispatcher._fail

    def write(record: dict[str, Any]) -> None:
        out.write(json.dumps(record) + "\n")

    def traced_enqueue(
        self: Dispatcher,
        model: str | None,
        tenant: str,
        priority: str,
        cost: float,
        deadline: Deadline,
        **kwargs: Any,
    ) -> Ticket:
        now = self._clock.now()
        waits = self.waits
        record: dict[str, Any] = {
            "t": now,
            "tenant": tenant,
            "cost": cost,
            "budget_s": deadline.queue_expires_at(now) - now,
            "predicted_s": waits.estimate(tenant, priority, now, model),
            "capacity": waits.capacity(model),
            "mean_s": waits.seat_time.mean_s,
            "queued": len(self.scheduler),
            "own": self.scheduler.depth(tenant),
            "running": self.total_inflight(),
        }
        try:
            ticket = enqueue_in(self, model, tenant, priority, cost, deadline, **kwargs)
        except ProxyError as exc:
            write(record | {"outcome": exc.reason})
            raise
        if ticket.seat is not None:
            write(record | {"outcome": "immediate", "wait_s": 0.0})
        else:
            seen[ticket.id] = record
        return ticket

    def traced_grant(self: Dispatcher, ticket: Ticket, seat: Any, now: float) -> None:
        grant(self, ticket, seat, now)
        record = seen.pop(ticket.id, None)
        if record is not None:
            write(record | {"outcome": "granted", "wait_s": now - ticket.enqueued_at})

    def traced_fail(self: Dispatcher, ticket: Ticket, error: Exception) -> None:
        fail(self, ticket, error)
        record = seen.pop(ticket.id, None)
        if record is not None:
            reason = getattr(error, "reason", type(error).__name__)
            write(record | {"outcome": reason, "wait_s": self._clock.now() - ticket.enqueued_at})

    def uninstall() -> None:
        Dispatcher.enqueue_in = enqueue_in  # type: ignore[method-assign]
        Dispatcher._grant = grant  # type: ignore[method-assign]
        Dispatcher._fail = fail  # type: ignore[method-assign]
        out.close()

    Dispatcher.enqueue_in = traced_enqueue  # type: ignore[method-assign]
    Dispatcher._grant = traced_grant  # type: ignore[method-assign]
    Dispatcher._fail = traced_fail  # type: ignore[method-assign]
    return uninstall


def summary(lines: list[dict[str, Any]]) -> dict[str, Any]:
    """How far off the predictions of queued tickets were: ratio realised/predicted."""
    queued = [r for r in lines if r["outcome"] != "immediate" and r["predicted_s"]]
    served = [r for r in queued if r["outcome"] == "granted"]
    ratios = sorted(r["wait_s"] / r["predicted_s"] for r in served if r["predicted_s"] > 0.05)
    over = [r for r in served if r["predicted_s"] > r["budget_s"]]
    under = [
        r for r in queued if r["outcome"] == "queue_timeout" and r["predicted_s"] <= r["budget_s"]
    ]

    def q(p: float) -> float | None:
        return ratios[int(p * (len(ratios) - 1))] if ratios else None

    return {
        "tickets": len(lines),
        "queued": len(queued),
        "ratio_p10_p50_p90": [q(0.1), q(0.5), q(0.9)],
        "predicted_over_budget_but_served": len(over),
        "predicted_within_budget_but_timed_out": len(under),
    }
