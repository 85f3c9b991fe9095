"""Admission decisions: whether a ticket may wait, and what it is told when it may not.

Every refusal of the queueing stage is decided here, in one order
(docs/REFERENCE.md, order of checks): shutting down; the tenant's queue at
its capacity (``tenant_queue_full``, or ``tenant_concurrency`` when a tenant
with no queue is at its cap); a predicted wait beyond the queue budget
(``predicted_wait_exceeds_budget``); and, for a ticket whose queue budget ran
out, ``tenant_concurrency`` when only its own cap held it back (seats were
free) or ``queue_timeout`` otherwise.

Pure functions: the dispatcher passes in what it knows (depths, caps, the
estimates of ``estimators.Waits``) and raises or fails what they return.
``Retry-After`` values come as callables so the common, unrefused path never
computes one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from proxy.errors import (
    PredictedWaitExceedsBudget,
    ProxyError,
    QueueTimeout,
    ShuttingDown,
    TenantConcurrency,
    TenantQueueFull,
)


@dataclass(frozen=True, slots=True)
class TenantLimits:
    """The part of a tenant's config the dispatcher enforces; swapped on reload."""

    max_concurrency: int | None
    queue_capacity: int
    #: Fair-share weight: the shared seats are shared across processes by it too.
    weight: float = 1.0


def shutting_down() -> ShuttingDown:
    """What every request is told once the proxy stops taking work."""
    return ShuttingDown("the proxy is shutting down", retry_after_s=1.0)


def queue_refusal(
    tenant: str,
    limits: TenantLimits,
    depth: int,
    *,
    at_cap: bool,
    free_place_s: Callable[[], float],
) -> ProxyError | None:
    """The tenant's queue has no room for one more ticket (``depth`` queued now)."""
    if depth < limits.queue_capacity:
        return None
    if limits.queue_capacity == 0 and at_cap:
        return TenantConcurrency(
            f"tenant {tenant!r} is at its concurrency limit of {limits.max_concurrency}",
            retry_after_s=free_place_s(),
        )
    return TenantQueueFull(
        f"tenant {tenant!r} has {depth} requests queued (capacity {limits.queue_capacity})",
        retry_after_s=free_place_s(),
    )


def wait_refusal(predicted_s: float | None, budget_s: float) -> ProxyError | None:
    """The predicted wait does not fit the queue budget; None (no data) never refuses."""
    if predicted_s is None or predicted_s <= budget_s:
        return None
    return PredictedWaitExceedsBudget(
        f"expected wait {predicted_s * 1000:.0f} ms exceeds the queue budget of "
        f"{budget_s * 1000:.0f} ms",
        retry_after_s=predicted_s,
    )


def expiry(
    tenant: str,
    waited_s: float,
    *,
    held_by_cap: bool,
    free_place_s: Callable[[], float],
    wait_s: Callable[[], float],
) -> ProxyError:
    """Its own cap held it back (seats were free): 429; otherwise the service: 503."""
    if held_by_cap:
        return TenantConcurrency(
            f"tenant {tenant!r} stayed at its concurrency limit for the queue budget",
            retry_after_s=free_place_s(),
        )
    return QueueTimeout(
        f"waited {waited_s * 1000.0:.0f} ms in the queue without a free seat",
        retry_after_s=wait_s(),
    )
