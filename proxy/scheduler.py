"""Which waiting ticket gets the next free seat: two-level weighted fair queuing.

The ``Scheduler`` protocol is the seam: the dispatcher pushes arrivals, removes
tickets that time out or are cancelled, pops the next ticket when a seat frees
up, blocks a tenant while it is at its own concurrency cap, and reports each
request's real cost when it ends. Implementations are synchronous and do no
I/O, so they are tested with plain objects and no clock at all.

``FairScheduler`` is start-time fair queuing (SFQ) applied twice, the way
Kubernetes API Priority and Fairness applies fair queuing inside a level:

- level 1 shares dispatches between priority classes by class weight;
- level 2 shares a class's dispatches between its tenants by tenant weight.

Each *flow* (one tenant in one class) and each class carries a virtual start
tag. A flow that becomes backlogged starts at ``max(V, its last finish)``, so
idle time earns no credit (no burst after a pause) and an idle flow costs
nothing (work-conserving). Dispatching a ticket of cost ``c`` from a flow of
weight ``w`` moves the flow's finish to ``start + c / w``; the next flow is the
one with the smallest start tag. Costs are tokens (prompt plus output, see
``entrance.estimate_cost``), so a tenant sending requests ten times larger
gets the same token share, not the same request share. When a request ends,
``finished`` corrects its flow's (and class's) finish tag by the difference
between the real and the estimated cost, as APF does with its guessed service
time.

Heaps hold one entry per backlogged flow and class with a version number;
entries made stale by a change of tag are skipped when they surface (lazy
deletion), so every operation is O(log n). Equal start tags go to the
heavier weight first, so a fresh interactive request is not queued behind a
batch request that arrived at the same virtual instant.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import asyncio

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
    #: The model pool it waits in (``None``: the one implicit pool, every replica).
    model: str | None = None
    #: Admitted while the proxy did not route by model: its body's ``model`` value
    #: (``None``: the body named none; ``...``: the body was not read for one). If a
    #: second model appears while it waits, it moves to that model's pool
    #: (``Dispatcher.refuse_unserved``) instead of taking any replica's seat.
    asked: object = ...
    #: ``prefix_affinity``: the hash that picks its replica (``affinity.py``).
    affinity: int | None = None
    #: ``mode: observe``: the refusal enforcing would have given it (``would_<reason>``).
    observed: str | None = None
    #: Shared state: its tenant place across instances (``proxy/places.py``).
    place: object | None = None

    def __repr__(self) -> str:
        return f"<Ticket #{self.id} {self.tenant}/{self.priority} cost={self.cost:.0f}>"


#: Weight used for a class or tenant the scheduler was not told about.
DEFAULT_WEIGHT = 1.0


class Scheduler(Protocol):
    def push(self, ticket: Ticket) -> None: ...

    def remove(self, ticket: Ticket) -> bool: ...

    def pop(self) -> Ticket | None:
        """Take the next ticket of an unblocked tenant, or None."""
        ...

    def set_blocked(self, tenant: str, blocked: bool) -> None:
        """A blocked tenant (at its own cap) keeps its queue but is passed over."""
        ...

    def finished(self, ticket: Ticket, actual_cost: float) -> None:
        """The request behind ``ticket`` ended; its real cost corrects the charge."""
        ...

    def depth(self, tenant: str) -> int: ...

    def depth_by_class(self, tenant: str, priority: str) -> int: ...

    def set_class_weights(self, weights: Mapping[str, float]) -> None: ...

    def set_tenant_weights(self, weights: Mapping[str, float]) -> None: ...

    def share_of(self, tenant: str, priority: str) -> float:
        """The fraction of dispatches the flow gets now if it is (or becomes) backlogged."""
        ...

    def __len__(self) -> int: ...

    def sibling(self) -> Scheduler:
        """An empty scheduler with the same weights (one per model pool)."""
        ...


class _Flow:
    """One tenant's FIFO in one class, with its SFQ tags."""

    __slots__ = ("cls", "finish", "start", "tenant", "tickets", "version")

    def __init__(self, tenant: str, cls: _Class) -> None:
        self.tenant = tenant
        self.cls = cls
        self.tickets: OrderedDict[int, Ticket] = OrderedDict()
        self.start = 0.0
        self.finish = 0.0
        self.version = 0


class _Class:
    """One priority class: its backlogged flows in a heap, and its own SFQ tags."""

    __slots__ = ("active", "finish", "heap", "name", "start", "version", "virtual", "weight_sum")

    def __init__(self, name: str) -> None:
        self.name = name
        self.heap: list[tuple[float, float, int, int, _Flow]] = []
        self.active = 0  # backlogged, unblocked flows in the heap
        self.weight_sum = 0.0  # their tenant weights
        self.virtual = 0.0
        self.start = 0.0
        self.finish = 0.0
        self.version = 0


class FairScheduler:
    """Two-level start-time fair queuing over classes, then tenants."""

    __slots__ = (
        "_blocked",
        "_class_heap",
        "_class_weight_sum",
        "_class_weights",
        "_classes",
        "_depth",
        "_flows",
        "_seq",
        "_size",
        "_tenant_weights",
        "_virtual",
    )

    def __init__(
        self,
        class_weights: Mapping[str, float],
        tenant_weights: Mapping[str, float] | None = None,
    ) -> None:
        self._class_weights = dict(class_weights)
        self._tenant_weights = dict(tenant_weights or {})
        self._classes: dict[str, _Class] = {}
        self._flows: dict[tuple[str, str], _Flow] = {}
        self._depth: dict[str, int] = {}
        self._blocked: set[str] = set()
        self._class_heap: list[tuple[float, float, int, int, _Class]] = []
        self._virtual = 0.0
        self._class_weight_sum = 0.0  # weights of classes with an active flow
        self._seq = itertools.count()
        self._size = 0

    # -- observation -------------------------------------------------------------------

    def __len__(self) -> int:
        return self._size

    def depth(self, tenant: str) -> int:
        return self._depth.get(tenant, 0)

    def depth_by_class(self, tenant: str, priority: str) -> int:
        flow = self._flows.get((tenant, priority))
        return len(flow.tickets) if flow else 0

    def share_of(self, tenant: str, priority: str) -> float:
        """Class share among active classes times tenant share inside the class. O(1)."""
        cls = self._classes.get(priority)
        flow = self._flows.get((tenant, priority))
        own_class, own_tenant = self._class_weight(priority), self._tenant_weight(tenant)
        class_active = cls is not None and cls.active > 0
        flow_active = flow is not None and bool(flow.tickets) and tenant not in self._blocked
        class_total = self._class_weight_sum + (0.0 if class_active else own_class)
        tenant_total = (cls.weight_sum if cls is not None else 0.0) + (
            0.0 if flow_active else own_tenant
        )
        return (own_class / class_total) * (own_tenant / tenant_total)

    def __repr__(self) -> str:
        return (
            f"<FairScheduler {self._size} queued, {len(self._depth)} tenants, "
            f"{len(self._blocked)} blocked>"
        )

    def sibling(self) -> FairScheduler:
        return FairScheduler(self._class_weights, self._tenant_weights)

    # -- configuration -----------------------------------------------------------------

    def set_class_weights(self, weights: Mapping[str, float]) -> None:
        self._class_weights = dict(weights)
        self._recount_weights()

    def set_tenant_weights(self, weights: Mapping[str, float]) -> None:
        self._tenant_weights = dict(weights)
        self._recount_weights()

    def _recount_weights(self) -> None:
        """After a reload: rebuild the active weight sums (O(flows), rare)."""
        for cls in self._classes.values():
            cls.weight_sum = 0.0
        for flow in self._flows.values():
            if flow.tickets and flow.tenant not in self._blocked:
                flow.cls.weight_sum += self._tenant_weight(flow.tenant)
        self._class_weight_sum = sum(
            self._class_weight(c.name) for c in self._classes.values() if c.active
        )

    def _class_weight(self, name: str) -> float:
        return self._class_weights.get(name, DEFAULT_WEIGHT)

    def _tenant_weight(self, name: str) -> float:
        return self._tenant_weights.get(name, DEFAULT_WEIGHT)

    # -- arrivals and departures -------------------------------------------------------

    def push(self, ticket: Ticket) -> None:
        key = (ticket.tenant, ticket.priority)
        flow = self._flows.get(key)
        if flow is None:
            cls = self._classes.get(ticket.priority)
            if cls is None:
                cls = self._classes[ticket.priority] = _Class(ticket.priority)
            flow = self._flows[key] = _Flow(ticket.tenant, cls)
        flow.tickets[ticket.id] = ticket
        self._size += 1
        self._depth[ticket.tenant] = self._depth.get(ticket.tenant, 0) + 1
        if len(flow.tickets) == 1 and ticket.tenant not in self._blocked:
            self._activate(flow)

    def remove(self, ticket: Ticket) -> bool:
        flow = self._flows.get((ticket.tenant, ticket.priority))
        if flow is None or flow.tickets.pop(ticket.id, None) is None:
            return False
        self._took(ticket.tenant)
        if not flow.tickets:
            if ticket.tenant in self._blocked:  # not active: only forget it
                if flow.finish <= flow.cls.virtual:
                    del self._flows[(flow.tenant, flow.cls.name)]
            else:
                self._deactivate(flow)
        return True

    def pop(self) -> Ticket | None:
        cls = self._top_class()
        if cls is None:
            return None
        flow = self._top_flow(cls)
        assert flow is not None  # an active class has an active flow
        _, ticket = flow.tickets.popitem(last=False)
        self._took(ticket.tenant)
        cost = ticket.cost
        # Level 2: the flow inside its class.
        cls.virtual = max(cls.virtual, flow.start)
        flow.finish = flow.start + cost / self._tenant_weight(flow.tenant)
        if flow.tickets:
            flow.start = flow.finish
            self._push_flow(flow)
        else:
            self._deactivate(flow)
        # Level 1: the class among classes.
        self._virtual = max(self._virtual, cls.start)
        cls.finish = cls.start + cost / self._class_weight(cls.name)
        if cls.active:
            cls.start = cls.finish
            self._push_class(cls)
        return ticket

    def finished(self, ticket: Ticket, actual_cost: float) -> None:
        """Correct the charge: tags after this ticket move by (actual - estimated) / weight.

        In a continuously backlogged flow every later tag is the sum of the
        costs before it, so the current start tag moves by the same amount
        (never below the class's virtual time: no credit beyond an idle start).
        """
        delta = actual_cost - ticket.cost
        if not delta:
            return
        flow = self._flows.get((ticket.tenant, ticket.priority))
        if flow is not None:
            shift = delta / self._tenant_weight(flow.tenant)
            flow.finish += shift
            if flow.tickets and flow.tenant not in self._blocked:
                flow.start = max(flow.cls.virtual, flow.start + shift)
                self._push_flow(flow)
        cls = self._classes.get(ticket.priority)
        if cls is not None:
            shift = delta / self._class_weight(cls.name)
            cls.finish += shift
            if cls.active:
                cls.start = max(self._virtual, cls.start + shift)
                self._push_class(cls)

    def set_blocked(self, tenant: str, blocked: bool) -> None:
        if blocked == (tenant in self._blocked):
            return
        flows = [f for c in self._classes.values()
                 if (f := self._flows.get((tenant, c.name))) is not None and f.tickets]  # fmt: skip
        if blocked:
            self._blocked.add(tenant)
            for flow in flows:
                self._deactivate(flow)
        else:
            self._blocked.discard(tenant)
            for flow in flows:
                self._activate(flow)

    # -- heap bookkeeping --------------------------------------------------------------

    def _took(self, tenant: str) -> None:
        self._size -= 1
        left = self._depth[tenant] - 1
        if left:
            self._depth[tenant] = left
        else:
            del self._depth[tenant]

    def _activate(self, flow: _Flow) -> None:
        cls = flow.cls
        flow.start = max(cls.virtual, flow.finish)
        self._push_flow(flow)
        cls.active += 1
        cls.weight_sum += self._tenant_weight(flow.tenant)
        if cls.active == 1:
            cls.start = max(self._virtual, cls.finish)
            self._class_weight_sum += self._class_weight(cls.name)
            self._push_class(cls)

    def _deactivate(self, flow: _Flow) -> None:
        flow.version += 1  # its heap entry is stale now
        cls = flow.cls
        cls.active -= 1
        cls.weight_sum -= self._tenant_weight(flow.tenant)
        if cls.active == 0:
            cls.version += 1
            cls.weight_sum = 0.0  # no float drift across idle periods
            self._class_weight_sum -= self._class_weight(cls.name)
            if not any(c.active for c in self._classes.values()):
                self._class_weight_sum = 0.0
        # An empty flow is kept only while its finish tag is ahead of the class:
        # re-entering at once must not earn a fresh start (idle earns no credit).
        if not flow.tickets and flow.finish <= cls.virtual:
            del self._flows[(flow.tenant, cls.name)]

    def _push_flow(self, flow: _Flow) -> None:
        flow.version += 1
        heapq.heappush(
            flow.cls.heap,
            (flow.start, -self._tenant_weight(flow.tenant), next(self._seq), flow.version, flow),
        )

    def _push_class(self, cls: _Class) -> None:
        cls.version += 1
        heapq.heappush(
            self._class_heap,
            (cls.start, -self._class_weight(cls.name), next(self._seq), cls.version, cls),
        )

    def _top_class(self) -> _Class | None:
        heap = self._class_heap
        while heap:
            _, _, _, version, cls = heap[0]
            if version == cls.version and cls.active:
                return cls
            heapq.heappop(heap)
        return None

    def _top_flow(self, cls: _Class) -> _Flow | None:
        heap = cls.heap
        while heap:
            _, _, _, version, flow = heapq.heappop(heap)
            if version == flow.version and flow.tickets:
                flow.version += 1  # popped: pop() pushes it again if it stays backlogged
                return flow
        return None
