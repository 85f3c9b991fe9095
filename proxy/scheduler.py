"""Which waiting ticket gets the next free seat.

The ``Scheduler`` protocol is the seam: the dispatcher asks ``pop`` for the
next ticket whenever a seat frees up, and tells the scheduler about arrivals,
removals (timeouts, cancellations) and finished work. Implementations are
synchronous and do no I/O, so they are tested with plain objects and a fake
clock, and they never see a socket.

``RoundRobinScheduler`` is the simple fair policy: priority classes share
dispatches by class weight (smooth weighted round robin, as in nginx, so a low
class is served regularly rather than in bursts and never starves), and inside
a class, tenants take turns. It counts requests, not tokens; the cost-aware
two-level weighted fair queuing policy replaces it behind the same protocol.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from typing import Protocol

from proxy.queues import TenantQueue, Ticket


class Scheduler(Protocol):
    def push(self, ticket: Ticket) -> None: ...

    def remove(self, ticket: Ticket) -> bool: ...

    def pop(self, eligible: Callable[[str], bool]) -> Ticket | None:
        """Take the next ticket whose tenant passes ``eligible``, or None."""
        ...

    def finished(self, ticket: Ticket, actual_cost: float) -> None:
        """The request behind ``ticket`` ended; its real cost corrects the charge."""
        ...

    def depth(self, tenant: str) -> int: ...

    def depth_by_class(self, tenant: str, priority: str) -> int: ...

    def set_class_weights(self, weights: Mapping[str, float]) -> None: ...

    def __len__(self) -> int: ...


class RoundRobinScheduler:
    """Smooth weighted round robin over classes, round robin over tenants."""

    __slots__ = ("_current", "_queues", "_rings", "_size", "_weights")

    def __init__(self, class_weights: Mapping[str, float]) -> None:
        self._weights: dict[str, float] = dict(class_weights)
        self._current: dict[str, float] = dict.fromkeys(self._weights, 0.0)
        self._queues: dict[str, TenantQueue] = {}
        # Per class: the tenants with at least one ticket of that class, in turn order.
        self._rings: dict[str, OrderedDict[str, None]] = {}
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def depth(self, tenant: str) -> int:
        queue = self._queues.get(tenant)
        return len(queue) if queue else 0

    def depth_by_class(self, tenant: str, priority: str) -> int:
        queue = self._queues.get(tenant)
        return queue.depth(priority) if queue else 0

    def set_class_weights(self, weights: Mapping[str, float]) -> None:
        self._weights = dict(weights)
        for name in self._weights:
            self._current.setdefault(name, 0.0)

    def push(self, ticket: Ticket) -> None:
        queue = self._queues.get(ticket.tenant)
        if queue is None:
            queue = self._queues[ticket.tenant] = TenantQueue(ticket.tenant)
        queue.push(ticket)
        self._rings.setdefault(ticket.priority, OrderedDict())[ticket.tenant] = None
        self._size += 1

    def remove(self, ticket: Ticket) -> bool:
        queue = self._queues.get(ticket.tenant)
        if queue is None or not queue.remove(ticket):
            return False
        self._size -= 1
        self._forget_if_empty(queue, ticket.priority)
        return True

    def finished(self, ticket: Ticket, actual_cost: float) -> None:
        """Request counting only: nothing to correct."""

    def pop(self, eligible: Callable[[str], bool]) -> Ticket | None:
        if not self._size:
            return None
        candidates = {
            cls: tenant
            for cls, ring in self._rings.items()
            if ring and (tenant := self._first_eligible(ring, eligible)) is not None
        }
        if not candidates:
            return None
        cls = self._pick_class(candidates.keys())
        tenant = candidates[cls]
        queue = self._queues[tenant]
        ticket = queue.head(cls)
        assert ticket is not None  # the ring holds only tenants with tickets of cls
        queue.remove(ticket)
        self._size -= 1
        ring = self._rings[cls]
        ring.move_to_end(tenant)  # this tenant had its turn in this class
        self._forget_if_empty(queue, cls)
        return ticket

    @staticmethod
    def _first_eligible(
        ring: OrderedDict[str, None], eligible: Callable[[str], bool]
    ) -> str | None:
        for tenant in ring:
            if eligible(tenant):
                return tenant
        return None

    def _pick_class(self, classes: Iterable[str]) -> str:
        """Smooth weighted round robin among the classes that can dispatch now."""
        total = 0.0
        best: str | None = None
        for cls in classes:
            weight = self._weights.get(cls, 1.0)
            self._current[cls] = self._current.get(cls, 0.0) + weight
            total += weight
            if best is None or self._current[cls] > self._current[best]:
                best = cls
        assert best is not None
        self._current[best] -= total
        return best

    def _forget_if_empty(self, queue: TenantQueue, priority: str) -> None:
        if queue.depth(priority) == 0:
            ring = self._rings.get(priority)
            if ring is not None:
                ring.pop(queue.tenant, None)
        if len(queue) == 0:
            del self._queues[queue.tenant]

    def __repr__(self) -> str:
        return f"<RoundRobinScheduler {self._size} queued, {len(self._queues)} tenants>"
