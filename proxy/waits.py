"""The wait a new ticket expects, and the ``Retry-After`` of a refusal.

Both start from the capacity the serving seats give now (seats over the
mean seat time, ``estimators.SeatTime``), never from a rate measured over the
tenant's own recent past. Read by the admission decisions (``admission.py``)
through the dispatcher; fed by it when a seat is granted and given back. No
I/O and no clock reads here: callers pass ``now``.

With model pools every estimate is the pool's (``model``; ``None``: the
whole fleet): its serving seats, its own queue and the seats its replicas
run now, and its own mean seat time: a pool of a slow model (long answers,
a big model) must not make a fast pool's waits look long, nor the other way
round. The fleet's seat time (every pool's requests) serves ``model=None``.

With shared state the pool's seats are shared with other instances, and
only this instance's requests run in ``_running``: what the others hold is
seen in the seat answers the dispatcher gets anyway (``seen_elsewhere``, no
call of its own). Their seats are busy, not free, and an instance that is
backlogged there too takes its part of every seat that frees: this one gets
only ``_share_here`` of the pool's releases (docs/ARCHITECTURE.md, "Waits
across instances"). Nothing seen (one process, or idle peers): all of them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING, NamedTuple

from proxy.estimators import (
    ACTIVE_COUNT,
    RECENT_TAU_S,
    BackloggedTurnover,
    RecentDispatches,
    SeatTime,
)

if TYPE_CHECKING:
    from proxy.places import Elsewhere
    from proxy.replicas import Replica, ReplicaPool
    from proxy.scheduler import Scheduler

#: Retry-After when nothing is known yet about seat times.
DEFAULT_FREE_PLACE_S = 1.0
#: With shared state, a process with a backlog for a replica counts as backlogged there
#: for this many mean seat times after its last seat call (it calls again when one of
#: its own seats frees), and a sighting of the others' seats counts as long.
BACKLOG_SEAT_TIMES = 2.0
#: The wait estimator fails open until it has seen this many dispatches end
#: (their seat times), so a cold proxy never refuses on no data.
MIN_DISPATCHES_TO_PREDICT = 20


class Flow(NamedTuple):
    """What only the dispatcher knows about a tenant's flow right now."""

    cap: int | None
    at_cap: bool
    #: Retries waiting for a seat of the pool asked about: each takes one ahead of
    #: every queued ticket.
    reseating: int


class Waits:
    """The wait and ``Retry-After`` estimates, from the capacity the seats give now.

    It reads the pool's serving seats and the scheduler's queues but changes
    neither; what only the dispatcher knows it asks through ``flow``.
    """

    __slots__ = (
        "_elsewhere", "_flow", "_members", "_pool", "_pool_of", "_pool_seat_times", "_queue_of",
        "_recent", "_recent_on", "_running", "_scheduler", "_turnover", "seat_time",
    )  # fmt: skip

    def __init__(
        self,
        pool: ReplicaPool,
        scheduler: Scheduler,
        flow: Callable[[str, str | None], Flow],
        *,
        queue_of: Callable[[str | None], Scheduler] | None = None,
        members: Callable[[str | None], frozenset[str] | None] | None = None,
    ) -> None:
        """``queue_of`` and ``members``: a model pool's queue and replicas (``pools.py``)."""
        self._pool = pool
        self._scheduler = scheduler
        self._flow = flow
        self._queue_of = queue_of or (lambda model: scheduler)
        self._members = members or (lambda model: None)
        #: Every pool's seat times together (``model=None``, one implicit pool).
        self.seat_time = SeatTime()
        #: Each model pool's own seat times, made at its first ended request.
        self._pool_seat_times: dict[str, SeatTime] = {}
        #: The model pool of each running request that has one.
        self._pool_of: dict[int, str] = {}
        self._recent = RecentDispatches()
        #: The same per replica: a model pool counts only what others took of its own
        #: replicas' seats (a flood of another pool on other replicas takes none).
        self._recent_on: dict[str, RecentDispatches] = {}
        #: Each flow's measured drain while backlogged, keyed (model, tenant, priority).
        self._turnover = BackloggedTurnover()
        #: When each running request got its seat, and where (for the release times).
        self._running: dict[int, tuple[float, Replica]] = {}
        #: Per replica, when its seats were last seen held by other instances, and how.
        self._elsewhere: dict[str, tuple[float, Elsewhere]] = {}

    def queued(self, tenant: str, priority: str, model: str | None) -> None:
        """A ticket joined its flow's queue; the first one starts a new backlog."""
        if self._queue_of(model).depth_by_class(tenant, priority) == 1:
            self._turnover.began((model, tenant, priority))

    def started(
        self,
        ticket_id: int,
        tenant: str,
        replica: Replica,
        now: float,
        *,
        priority: str = "standard",
        model: str | None = None,
        from_queue: bool = False,
    ) -> None:
        """A seat was granted: ``from_queue`` when the ticket waited in its flow's queue."""
        self._running[ticket_id] = (now, replica)
        if model is not None:
            self._pool_of[ticket_id] = model
        self._recent.record(tenant, now)
        on = self._recent_on.get(replica.name)
        if on is None:
            on = self._recent_on[replica.name] = RecentDispatches()
        on.record(tenant, now)
        backlogged = from_queue and self._queue_of(model).depth_by_class(tenant, priority) > 0
        self._turnover.dispatched((model, tenant, priority), now, still_backlogged=backlogged)

    def ended(self, ticket_id: int, held_s: float | None) -> None:
        """A seat went back; ``held_s`` is its seat time when it counts (no grace)."""
        model = self._pool_of.pop(ticket_id, None)
        if held_s is not None:
            self.seat_time.record(held_s)
            if model is not None:
                pooled = self._pool_seat_times.get(model)
                if pooled is None:
                    pooled = self._pool_seat_times[model] = SeatTime()
                pooled.record(held_s)
        self._running.pop(ticket_id, None)

    def seat_time_of(self, model: str | None) -> SeatTime:
        """The seat times of ``model``'s pool (``None``: every request's); a pool
        that has finished nothing yet has none (its estimates fail open)."""
        if model is None:
            return self.seat_time
        return self._pool_seat_times.get(model) or SeatTime()

    def pool_models(self) -> set[str]:
        """The model pools with seat times kept."""
        return set(self._pool_seat_times)

    def forget_models(self, gone: Collection[str]) -> None:
        """Forget the seat times of model pools no replica serves any more; a request
        of one still running ends counted in the fleet's seat times only."""
        if not gone:
            return
        for model in gone:
            self._pool_seat_times.pop(model, None)
        self._pool_of = {t: m for t, m in self._pool_of.items() if m not in gone}

    def seen_elsewhere(self, replica: str, elsewhere: Elsewhere, now: float) -> None:
        """A seat answer of the shared state said how other instances hold ``replica``'s
        seats now; the latest answer per replica counts, for a mean seat time."""
        if elsewhere.held or elsewhere.waiting:
            self._elsewhere[replica] = (now, elsewhere)
        else:
            self._elsewhere.pop(replica, None)

    def _held_elsewhere(self, model: str | None, now: float) -> tuple[int, int, int]:
        """Seats of the pool's serving replicas that other instances hold, as last seen:
        all of them, those of instances backlogged there, and the most instances
        backlogged on one replica. A sighting older than ``BACKLOG_SEAT_TIMES`` mean
        seat times is dropped: every seat seen has turned over since, and a backlog
        seen then has been said again or is over."""
        if not self._elsewhere:
            return 0, 0, 0
        mean = self.seat_time_of(model).mean_s
        members = self._members(model)
        held = backlogged = waiting = 0
        for replica in self._pool.replicas:
            seen = self._elsewhere.get(replica.name)
            if seen is None or not replica.serving or not mean:
                continue
            if now - seen[0] > BACKLOG_SEAT_TIMES * mean:
                continue
            if members is not None and replica.name not in members:
                continue
            held += seen[1].held
            backlogged += seen[1].backlogged
            waiting = max(waiting, seen[1].waiting)
        return held, backlogged, waiting

    def _share_here(self, model: str | None, now: float) -> float:
        """The part of the pool's seat releases this instance gets now.

        Instances with no queue there only free their seats, and a backlog here
        takes them all: 1.0. Backlogged ones take their part of every seat that
        frees: about what they hold now against what this instance holds (the
        seats' fair rule shares them by tenant, across the instances), and never
        less than an even split among the instances backlogged there (this one
        holding nothing yet: a burst just arrived, refused, still gets its turns).
        """
        _, backlogged, waiting = self._held_elsewhere(model, now)
        if not backlogged:
            return 1.0
        members = self._members(model)
        own = sum(
            1
            for _, replica in self._running.values()
            if replica.serving and (members is None or replica.name in members)
        )
        return max(own / (own + backlogged), 1.0 / (1 + waiting))

    def forget_idle(self, now: float) -> None:
        self._recent.forget_idle(now)
        for name, recent in list(self._recent_on.items()):
            recent.forget_idle(now)
            if not recent:  # nothing left (a replica a reload removed, too)
                del self._recent_on[name]
        self._turnover.forget_idle(now)
        horizon = BACKLOG_SEAT_TIMES * (self.seat_time.mean_s or 0.0)
        for name, (seen_at, _) in list(self._elsewhere.items()):
            if now - seen_at > horizon:
                del self._elsewhere[name]

    def _recent_others(self, tenant: str, now: float, model: str | None) -> tuple[float, list[str]]:
        """Dispatches per second by tenants other than ``tenant`` on the pool's replicas
        in the last seconds, and the tenants active there (``tenant`` included).

        The implicit pool (``members`` None) reads the fleet's record. A model pool
        sums its replicas' records: another pool's flood on other replicas takes none
        of its seats (counted fleet-wide, it halved a quiet pool's predicted rate),
        while a pool sharing its replicas (LoRA adapters of one base) does take them.
        """
        members = self._members(model)
        if members is None:
            return self._recent.others_per_second(tenant, now), self._recent.active(now)
        counts: dict[str, float] = {}
        for name in members:
            recent = self._recent_on.get(name)
            if recent is not None:
                recent.add_counts(now, counts)
        others = sum(count for t, count in counts.items() if t != tenant) / RECENT_TAU_S
        return others, [t for t, count in counts.items() if count >= ACTIVE_COUNT]

    def _seats(self, model: str | None) -> int:
        members = self._members(model)
        return sum(
            r.limit
            for r in self._pool.replicas
            if r.serving and (members is None or r.name in members)
        )

    def predict(
        self, tenant: str, priority: str, now: float, model: str | None = None
    ) -> float | None:
        """Expected queue wait of a new ticket under the fair-share rule; None: no data.

        Fails open until ``MIN_DISPATCHES_TO_PREDICT`` seat times are known.
        """
        if self.seat_time_of(model).count < MIN_DISPATCHES_TO_PREDICT:
            return None
        return self.estimate(tenant, priority, now, model)

    def retry_after_queue_timeout(
        self, tenant: str, priority: str, now: float, model: str | None = None
    ) -> float:
        """The wait a new ticket of this flow expects now (Retry-After of queue_timeout)."""
        estimate = self.estimate(tenant, priority, now, model)
        return DEFAULT_FREE_PLACE_S if estimate is None else estimate

    def time_to_free_place(
        self, tenant: str, priority: str, now: float, model: str | None = None
    ) -> float:
        """Expected time until the tenant's queue moves by one (Retry-After of 429s).

        One over the rate its flow drains at now (``drain_rates``); only a
        proxy that has seen no seat time yet says ``DEFAULT_FREE_PLACE_S``.
        """
        rates = self.drain_rates(tenant, priority, now, model)
        return 1.0 / rates[0] if rates else DEFAULT_FREE_PLACE_S

    def capacity(self, model: str | None = None) -> float | None:
        """Dispatches per second the serving seats sustain: seats over the mean seat time.

        What the fleet *can* serve now, whatever it was asked lately: the seats
        of replicas serving now (a lost replica's seats are gone at once; the
        rate dispatched before the loss is not), and a seat time that a quiet
        period does not change.
        """
        seats = self._seats(model)
        mean = self.seat_time_of(model).mean_s
        if not seats or not mean:
            return None
        return seats / mean

    def drain_rates(
        self, tenant: str, priority: str, now: float, model: str | None = None
    ) -> tuple[float, float] | None:
        """Dispatches per second for this flow, and for the queue as a whole; None: no data.

        Both start from the capacity the seats give now (``capacity``), never
        from a rate measured over the tenant's own recent past: after a quiet
        period that rate is a few requests a minute, and a burst that the
        seats would serve in a second was refused.

        The flow gets its fair share among the flows backlogged now (a lone
        flow: all of it), less what other tenants, not queued at this
        instant, have been taking over the last seconds beyond what the
        backlogged ones are due: fair queuing lets them keep what they use
        below their share, so a snapshot of the queues alone rated a flow far
        too fast whenever the others' queues happened to be empty. The queue
        as a whole drains at the capacity less everything the others take.
        Neither falls below the flow's share if every recently active tenant
        were backlogged too (each counted as one more flow of its weight):
        that much fair queuing guarantees it. A tenant with a concurrency cap
        drains no faster than its cap turns over, and a flow that has stayed
        backlogged for the last seconds no faster than it was measured to
        drain then (``BackloggedTurnover``): shares are in tokens, so a flow
        of long requests gets fewer dispatches than its share of the seats,
        and at 1x load the share-based rate ran ahead of the flow's real one
        often enough to let more requests time out than the old estimator.
        The measured rate only ever lowers the estimate, and only counts while
        the flow's queue has not emptied: never a rate taken over a quiet
        period.
        """
        capacity = self.capacity(model)
        if capacity is None:
            return None
        here = self._share_here(model, now)
        if here < 1.0:
            capacity *= here  # what other instances backlogged there leave this one
        scheduler = self._queue_of(model)
        share = scheduler.share_of(tenant, priority)
        others, active = self._recent_others(tenant, now, model)
        idle_take = max(0.0, others - (1.0 - share) * capacity)
        returning = sum(1 for t in active if t != tenant and not scheduler.depth(t))
        floor = capacity / (1.0 / share + returning)
        flow = max(min(share * capacity, capacity - idle_take), floor)
        cap = self._flow(tenant, model).cap
        mean = self.seat_time_of(model).mean_s
        if cap and mean:
            flow = min(flow, cap / mean)
        # Only while the flow is backlogged now: a backlog that ended by expiry or
        # cancellation left its record behind, and says nothing of a new one.
        if scheduler.depth_by_class(tenant, priority):
            measured = self._turnover.rate((model, tenant, priority), now)
            if measured is not None:
                flow = min(flow, measured)
        return flow, max(capacity - others, floor)

    def estimate(
        self, tenant: str, priority: str, now: float, model: str | None = None
    ) -> float | None:
        """Time until a new ticket of this flow gets a seat.

        It gets one when the seats have freed as many times as the work ahead
        of it takes: its place in its flow scaled by the flow's share, or
        everything queued now scaled by the queue's, whichever is sooner
        (unless its own cap holds it back: then its own seats turn over).
        Retries waiting for a seat (``reseating``) take one ahead of every
        queued ticket. The releases counted are the pool's: with other instances
        backlogged there the rates are this instance's part (``_share_here``),
        so the same work takes more of the pool's releases.
        """
        rates = self.drain_rates(tenant, priority, now, model)
        if rates is None:
            return None
        flow, whole = rates
        queue = self._queue_of(model)
        own = queue.depth_by_class(tenant, priority) + 1
        state = self._flow(tenant, model)
        if state.at_cap:
            return own / flow
        capacity = self.capacity(model)
        assert capacity is not None  # known whenever the rates are
        queued = len(queue) + 1
        reseating: float = state.reseating
        here = self._share_here(model, now)
        if here < 1.0:
            reseating /= here  # each retry's seat, too, takes this many of the pool's
        releases = min(own * capacity / flow, queued * capacity / whole) + reseating
        return self._time_to_release(max(1, math.ceil(releases - 1e-9)), now, model)

    def _time_to_release(self, n: int, now: float, model: str | None = None) -> float:
        """When the serving seats will have freed ``n`` times, from what they run now.

        Each busy seat frees when its request has held it the mean seat time
        (at once if it is past that), then every mean seat time; a free seat
        counts as freeing now. Seats that started together free together, so
        this is a staircase, not ``n`` over the capacity: near the budget the
        difference decides.
        """
        mean = self.seat_time_of(model).mean_s
        seats = self._seats(model)
        if not mean or not seats:
            return 0.0
        members = self._members(model)
        due = [
            max(0.0, mean - (now - granted_at))
            for granted_at, replica in self._running.values()
            if replica.serving and (members is None or replica.name in members)
        ]
        # Seats other instances hold are busy, not free; when each started is not
        # known: they free spread over the next mean seat time.
        elsewhere = self._held_elsewhere(model, now)[0]
        due.extend(mean * (i + 1) / (elsewhere + 1) for i in range(elsewhere))
        due = sorted(due)[:seats]
        due.extend([0.0] * (seats - len(due)))
        due.sort()
        rounds, index = divmod(n - 1, seats)
        return due[index] + rounds * mean
