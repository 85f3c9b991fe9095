"""Model pools in the queue: one fair scheduler per pool, behind one ``Scheduler``.

Seats stay per replica, but a ticket may only take a seat on a replica that
serves its model, so each pool gets its own queue: fair sharing holds within
a pool, and a request for an idle pool never waits behind another pool's
backlog (a single queue would hand the head ticket a seat it cannot use, or
make every other pool wait for it). ``PoolQueues`` keeps the ``Scheduler``
protocol for everything that reads the queue as a whole (depths, length,
weights, blocking a tenant at its cap), and adds ``pop_from`` and
``waiting_models`` for the dispatcher's pump, and ``drop`` for a pool whose
model no replica lists any more. Tickets with ``model is None``
(a deployment not routed by model, ``ModelTable.pooled``) use the default
scheduler: exactly the single queue of before.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from proxy.affinity import AffinityKey, HashRing
from proxy.models import ModelRefusal, ModelTable
from proxy.prefill import PrefillLedger
from proxy.replicas import Replica, ReplicaName, ReplicaPool, Seat
from proxy.scheduler import Scheduler, Ticket


class PoolQueues:
    """A ``Scheduler`` made of one scheduler per model (``None``: the implicit pool)."""

    __slots__ = ("_blocked", "_by_model", "default")

    def __init__(self, default: Scheduler) -> None:
        self.default = default
        self._by_model: dict[str, Scheduler] = {}
        self._blocked: set[str] = set()

    def __repr__(self) -> str:
        return f"<PoolQueues {len(self)} queued, {len(self._by_model)} model pools>"

    def of(self, model: str | None) -> Scheduler:
        """The queue of ``model``'s pool, made on first use with the current weights."""
        if model is None:
            return self.default
        queue = self._by_model.get(model)
        if queue is None:
            queue = self._by_model[model] = self.default.sibling()
            for tenant in self._blocked:
                queue.set_blocked(tenant, True)
        return queue

    def _kept(self, model: str | None) -> Scheduler | None:
        """The queue of ``model``'s pool, if it exists (None after ``drop``)."""
        return self.default if model is None else self._by_model.get(model)

    def waiting_models(self) -> list[str | None]:
        """Pools with a ticket queued now."""
        models: list[str | None] = [m for m, q in self._by_model.items() if len(q)]
        if len(self.default):
            models.append(None)
        return models

    def depth_by_model(self) -> dict[str, int]:
        """Tickets waiting now in each model's pool (pools seen so far, empty ones too)."""
        return {model: len(queue) for model, queue in self._by_model.items()}

    def depth_of_model(self, model: str | None) -> int:
        queue = self._kept(model)
        return len(queue) if queue is not None else 0

    def pop_from(self, model: str | None) -> Ticket | None:
        return self.of(model).pop()

    def drop(self, model: str) -> list[Ticket]:
        """Take every ticket of ``model``'s pool out and forget the pool (no replica
        lists the model any more). Tenants blocked at their cap are emptied too; a
        pool made again later (the model back) starts with fresh tags."""
        queue = self._by_model.pop(model, None)
        if queue is None:
            return []
        for tenant in self._blocked:
            queue.set_blocked(tenant, False)
        tickets: list[Ticket] = []
        while (ticket := queue.pop()) is not None:
            tickets.append(ticket)
        return tickets

    def take_implicit(self) -> list[Ticket]:
        """Take every ticket out of the implicit pool (``model is None``), in its order,
        to be placed again (the proxy started routing by model). Tenants blocked at
        their cap are let out for this and blocked again."""
        queue = self.default
        for tenant in self._blocked:
            queue.set_blocked(tenant, False)
        tickets: list[Ticket] = []
        while (ticket := queue.pop()) is not None:
            tickets.append(ticket)
        for tenant in self._blocked:
            queue.set_blocked(tenant, True)
        return tickets

    def share_in(self, model: str | None, tenant: str, priority: str) -> float:
        return self.of(model).share_of(tenant, priority)

    # -- the Scheduler protocol --------------------------------------------------------

    def push(self, ticket: Ticket) -> None:
        self.of(ticket.model).push(ticket)

    def remove(self, ticket: Ticket) -> bool:
        queue = self._kept(ticket.model)
        return queue is not None and queue.remove(ticket)

    def pop(self) -> Ticket | None:
        """The next ticket of any pool (shutdown answers every queued one)."""
        for model in self.waiting_models():
            ticket = self.of(model).pop()
            if ticket is not None:
                return ticket
        return None

    def set_blocked(self, tenant: str, blocked: bool) -> None:
        if blocked:
            self._blocked.add(tenant)
        else:
            self._blocked.discard(tenant)
        self.default.set_blocked(tenant, blocked)
        for queue in self._by_model.values():
            queue.set_blocked(tenant, blocked)

    def finished(self, ticket: Ticket, actual_cost: float) -> None:
        # A ticket that ran while its pool was dropped: the pool's fair-share
        # account went with it, and making the pool again would only leave an
        # empty queue (and its metric series) behind.
        queue = self._kept(ticket.model)
        if queue is not None:
            queue.finished(ticket, actual_cost)

    def depth(self, tenant: str) -> int:
        return self.default.depth(tenant) + sum(q.depth(tenant) for q in self._by_model.values())

    def depth_by_class(self, tenant: str, priority: str) -> int:
        return self.default.depth_by_class(tenant, priority) + sum(
            q.depth_by_class(tenant, priority) for q in self._by_model.values()
        )

    def set_class_weights(self, weights: Mapping[str, float]) -> None:
        self.default.set_class_weights(weights)
        for queue in self._by_model.values():
            queue.set_class_weights(weights)

    def set_tenant_weights(self, weights: Mapping[str, float]) -> None:
        self.default.set_tenant_weights(weights)
        for queue in self._by_model.values():
            queue.set_tenant_weights(weights)

    def share_of(self, tenant: str, priority: str) -> float:
        return self.default.share_of(tenant, priority)

    def sibling(self) -> Scheduler:
        return PoolQueues(self.default.sibling())

    def __len__(self) -> int:
        return len(self.default) + sum(len(q) for q in self._by_model.values())


class AffinityRouter:
    """``routing.policy: prefix_affinity``: a ticket's key picks its replica in the pool.

    One ``HashRing`` over every replica of the fleet (serving or not, so an
    ejection moves only that replica's keys), and a pool walks it passing over
    the replicas not its own. A replica's points depend on its name only, so
    the fleet's ring restricted to a pool's members *is* the pool's ring: the
    same replica for every key, with one ring to build per fleet change rather
    than one per pool membership (a fleet of many LoRA adapters, each on its
    own replicas, went past a cache of rings and rebuilt one, milliseconds of
    hashing, on every request). Only replicas with a free seat are eligible, and the bound of
    ``max_load_factor`` times the mean load over them spills a hot key to the
    next replica on the ring; ``None`` sends the caller to least-loaded. The
    load is the uncached prompt work in flight (``PrefillLedger``, fed by the
    dispatcher as seats are granted and given back); a request in flight that
    the ledger did not place (a retry, a request without a key) counts as a
    cold one the size of the request being placed.
    """

    __slots__ = ("_rings", "ledger", "max_load_factor")

    #: Rings kept at most: the fleet changes rarely (a reload), and a request being
    #: placed during one may still see the fleet before it.
    MAX_RINGS = 4

    def __init__(self, max_load_factor: float = 1.25) -> None:
        self.max_load_factor = max_load_factor
        self.ledger = PrefillLedger()
        self._rings: dict[frozenset[str], HashRing] = {}

    def __repr__(self) -> str:
        return f"<AffinityRouter {len(self._rings)} rings, {self.ledger!r}>"

    def choose(
        self,
        replicas: Iterable[Replica],
        members: frozenset[str] | None,
        key: AffinityKey,
        cost: float = 1.0,
        avoid: frozenset[ReplicaName] = frozenset(),
    ) -> Replica | None:
        """The replica on the ring for ``key`` (None: none eligible). ``avoid``: replicas
        not eligible (they just refused the tenant its fair turn): the key walks on to
        the next on the ring, as when its home has no free seat."""
        fleet = list(replicas)
        by_name: dict[str, Replica] = {
            r.name: r for r in fleet if members is None or r.name in members
        }
        names = frozenset(r.name for r in fleet)
        ring = self._rings.get(names)
        if ring is None:
            if len(self._rings) >= self.MAX_RINGS:
                self._rings.clear()
            ring = self._rings[names] = HashRing(names)
        ledger = self.ledger
        load = {
            name: ledger.pending(name) + max(0, r.inflight - ledger.count(name)) * cost
            for name, r in by_name.items()
        }
        chosen = ring.choose(
            key,
            load,
            eligible=lambda name: (
                name in by_name and by_name[name].has_free_seat and name not in avoid
            ),
            max_load_factor=self.max_load_factor,
            work=lambda name: ledger.work(key, cost, name),
        )
        return None if chosen is None else by_name[chosen]

    def started(self, seat: Seat, key: int, cost: float) -> None:
        """A ticket of ``key`` got ``seat``: its prompt work is pending on that replica."""
        self.ledger.started(seat, seat.replica.name, AffinityKey(key), cost)

    def ended(self, seat: Seat, *, warmed: bool = True) -> None:
        """``seat`` is given back: its work is done (``warmed``: its prompt is cached there)."""
        self.ledger.ended(seat, warmed=warmed)


class PoolSeats:
    """Where a ticket of a model pool may sit: the pool's replicas, chosen least
    loaded or, with a ``prefix_affinity`` key, on the pool's ring."""

    __slots__ = ("affinity", "models", "pool")

    def __init__(self, pool: ReplicaPool) -> None:
        self.pool = pool
        #: Which replicas serve a model now (set by ``app.py``); ``None``: one pool.
        self.models: ModelTable | None = None
        #: ``prefix_affinity`` replica choice (its bound set from ``routing``).
        self.affinity = AffinityRouter()

    def members(self, model: str | None) -> frozenset[str] | None:
        """The replicas of ``model``'s pool now (read at each pass: discovery moves
        them at once); ``None``: every replica."""
        if model is None or self.models is None:
            return None
        return self.models.pool(model)

    def unserved(self, model: str | None) -> ModelRefusal | None:
        """The entrance's ``model_not_found`` refusal when no replica lists ``model`` now
        (an adapter unloaded, a reload that removed it): no seat of its pool can ever
        come, so its waiters get what a new request for it gets. ``None`` while some
        replica lists it, even one ejected or drained (an ejected replica keeps its
        models: that is ``no_healthy_replica``, and waiting for its return)."""
        if model is None or self.models is None:
            return None
        choice = self.models.select(model, allowed=None)
        return choice if isinstance(choice, ModelRefusal) else None

    def free(
        self, model: str | None, *, headroom: bool = False,
        avoid: frozenset[ReplicaName] = frozenset(),
    ) -> Replica | None:  # fmt: skip
        """The least-loaded replica of the pool with a free (or headroom) seat, none of
        ``avoid``."""
        return self.pool.choose(avoid, strict=True, headroom=headroom, among=self.members(model))

    def choose(
        self, model: str | None, affinity: int | None, cost: float = 1.0,
        avoid: frozenset[ReplicaName] = frozenset(),
    ) -> Replica | None:  # fmt: skip
        """The replica for a ticket: by its affinity key on the ring when it has one
        and a replica fits the bound, else the least loaded. ``cost``: the ticket's
        estimate, the prompt work it brings where its prefix is not cached. ``avoid``:
        replicas that just refused its tenant the fair turn, taken only when no other
        is free."""
        members = self.members(model)
        if affinity is not None:
            replica = self.affinity.choose(
                self.pool.replicas, members, AffinityKey(affinity), cost, avoid
            )
            if replica is not None:
                return replica
        return self.pool.choose(avoid, among=members)

    def other_dispatchable(self, model: str | None, exclude: frozenset[str]) -> bool:
        """Some replica of the pool outside ``exclude`` may take work (a retry waits for it)."""
        members = self.members(model)
        return any(
            r.dispatchable and r.name not in exclude and (members is None or r.name in members)
            for r in self.pool.replicas
        )
