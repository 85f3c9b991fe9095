"""Tickets and the bounded per-tenant queues they wait in.

A ``Ticket`` is a request's place in line: who it is for, which class, what it
is estimated to cost, and when it must leave the queue. Each tenant has one
FIFO per priority class (so a tenant's batch request never blocks its own
interactive one) and ``queue_capacity`` bounds the tenant's total across its
classes. Removal of any ticket is O(1) (``OrderedDict``), because a client
that leaves must free its place at once, wherever it stands in line.

No I/O and no clock reads here; ``dispatch.py`` owns the timers and futures.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from proxy.replicas import Seat

_ids = itertools.count(1)


@dataclass(eq=False, slots=True)
class Ticket:
    """One request waiting for a seat. Identity equality: each ticket is unique."""

    tenant: str
    priority: str
    cost: float
    enqueued_at: float
    expires_at: float
    future: asyncio.Future[Seat] | None = None
    timer: asyncio.TimerHandle | None = None
    id: int = field(default_factory=lambda: next(_ids))
    #: When the ticket got its seat (service time for the wait estimator), and the seat.
    granted_at: float | None = None
    seat: Seat | None = None

    def __repr__(self) -> str:
        return f"<Ticket #{self.id} {self.tenant}/{self.priority} cost={self.cost:.0f}>"


class TenantQueue:
    """The FIFOs of one tenant, one per priority class, bounded in total."""

    __slots__ = ("_by_class", "_depth", "tenant")

    def __init__(self, tenant: str) -> None:
        self.tenant = tenant
        self._by_class: dict[str, OrderedDict[int, Ticket]] = {}
        self._depth = 0

    def __len__(self) -> int:
        return self._depth

    def depth(self, priority: str) -> int:
        fifo = self._by_class.get(priority)
        return len(fifo) if fifo else 0

    def push(self, ticket: Ticket) -> None:
        self._by_class.setdefault(ticket.priority, OrderedDict())[ticket.id] = ticket
        self._depth += 1

    def remove(self, ticket: Ticket) -> bool:
        """Take ``ticket`` out wherever it stands; False when it was not here."""
        fifo = self._by_class.get(ticket.priority)
        if fifo is None or fifo.pop(ticket.id, None) is None:
            return False
        self._depth -= 1
        return True

    def head(self, priority: str) -> Ticket | None:
        fifo = self._by_class.get(priority)
        if not fifo:
            return None
        return next(iter(fifo.values()))

    def classes(self) -> list[str]:
        """Classes with at least one waiting ticket."""
        return [p for p, fifo in self._by_class.items() if fifo]

    def __repr__(self) -> str:
        parts = ", ".join(f"{p}={len(f)}" for p, f in self._by_class.items() if f)
        return f"<TenantQueue {self.tenant} {self._depth} queued ({parts})>"
