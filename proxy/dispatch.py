"""The dispatcher: tickets in, seats out, seats back.

It ties the synchronous pieces together (the ``Scheduler`` that orders
tickets, the ``ReplicaPool`` that owns seats, the per-tenant in-flight
places, the ``Waits`` estimator, the ``admission`` decisions) with the only
asynchronous parts of queueing: each waiting ticket's future and its
queue-expiry timer. Who gets a free seat is decided in ``pump``, one
synchronous pass with no I/O; waking the waiters is its only side effect.

Every seat comes back through ``release`` (or ``finish``), which then pumps:
nothing below the dispatcher calls up into it, so ``pump`` is never
re-entered. Health and GPU changes call ``pump`` from the event loop, never
from inside a pass.

Invariants:
- a ticket is in exactly one of: queued, granted, expired, abandoned;
- an expired ticket is never granted (``pump`` checks the clock too, in case
  a timer fires late);
- a client that leaves frees its queue place and tenant place at once
  (``wait`` removes it in its ``CancelledError`` path).

With shared state (``shared``, ``proxy/places.py``) a local grant is not yet
a seat: ``wait`` then takes the tenant place and the replica seat across
instances, and a refusal undoes the local grant, holds the full place off
locally (a replica's ``shared_full``, a tenant blocked in the scheduler)
until ``freed`` says it may have freed, and puts the ticket back in its
queue, its scheduling charge refunded. A seat refused although free (another
tenant's fair turn there, ``Blocked.turn``) holds off only the tenant refused,
and only on that replica (``_turn_refused``). A refusal leaves the tenant
recorded as waiting in Redis; it is withdrawn once the tenant has nothing
queued here for that replica (``_stop_waiting``). The replica is checked
again after the Redis call (``_serves``): the fleet may have changed meanwhile.
"""

from __future__ import annotations

import asyncio
from collections.abc import Container, Mapping

from proxy import admission
from proxy.admission import TenantLimits
from proxy.admitted import Deadline
from proxy.clock import Clock
from proxy.errors import (
    PredictedWaitExceedsBudget,
    ProxyError,
    QueueTimeout,
    Rejected,
    ShuttingDown,
)
from proxy.estimators import RecentUsage
from proxy.models import ModelRefusal
from proxy.observe import Overflow, overflow_replica, would
from proxy.places import Blocked, PlaceKind, SharedPlaces
from proxy.pools import PoolQueues, PoolSeats
from proxy.pressure import BudgetPressure
from proxy.replicas import Replica, ReplicaName, ReplicaPool, Seat
from proxy.reseats import Reseats
from proxy.scheduler import Scheduler, Ticket
from proxy.waits import BACKLOG_SEAT_TIMES, DEFAULT_FREE_PLACE_S, Flow, Waits

__all__ = ["Dispatcher", "TenantLimits"]

#: The observed refusal that counts in the class's budget pressure (as in enforce mode).
OBSERVED_OVERLOAD = "would_" + PredictedWaitExceedsBudget.reason
#: Grants between sweeps of tenants whose recent usage decayed to nothing.
USAGE_SWEEP_EVERY = 4096


class Dispatcher:
    """Admits tickets to seats, in the order the scheduler chooses."""

    def __init__(
        self,
        pool: ReplicaPool,
        scheduler: Scheduler,
        clock: Clock,
        limits: Mapping[str, TenantLimits],
        *,
        predictive_rejection: bool = True,
    ) -> None:
        """``predictive_rejection=False`` never refuses on a predicted wait (a
        benchmark's twin proxy, which shows what the refused requests would
        have met); it is no config key."""
        self.pool = pool
        #: One queue per model pool (``pools.py``); read as a whole, it is one scheduler.
        self.scheduler = PoolQueues(scheduler)
        #: The replicas each model pool may use (``pools.py``).
        self.seats = PoolSeats(pool)
        self._clock = clock
        self._limits = dict(limits)
        self._inflight: dict[str, int] = {}
        self._predictive_rejection = predictive_rejection
        self.waits = Waits(
            pool, self.scheduler, self._flow, queue_of=self.scheduler.of, members=self.seats.members
        )
        #: Each pool's recent work per tenant (``None``: the one implicit pool): the
        #: headroom rule compares a tenant's usage with its share *within* a pool.
        self._usage: dict[str | None, RecentUsage] = {}
        self._grants = 0
        self._headroom_grants: dict[str, int] = {}
        #: The grant count at each pool's last grant from its queue: the pool served
        #: longest ago goes first, so pools sharing a replica take its seats in turn.
        self._pool_turns: dict[str | None, int] = {}
        self._high_water: dict[str, int] = {}
        #: Retries waiting for a seat: served ahead of queued tickets.
        self._reseating = Reseats(self.seats)
        self._closed: ShuttingDown | None = None
        #: Each class's share of its queue budget used lately (``pressure.py``).
        self.pressure = BudgetPressure(clock)
        #: ``mode: observe`` (``observe.py``): refusals only named, nobody waits.
        self._observing = False
        self._overflow = Overflow()
        #: Places shared with other instances (``state.backend: redis``); None: local only.
        self.shared: SharedPlaces | None = None
        #: Tenants whose shared places are all taken (held off until ``freed``).
        self._shared_blocked: set[str] = set()
        self._freed_timers: dict[tuple[PlaceKind, str], asyncio.TimerHandle] = {}
        #: Replicas that refused a tenant its fair turn on a free seat (``Blocked.turn``),
        #: avoided for its tickets until a seat there may have freed or the refusal's
        #: retry time; each (tenant, replica) has its timer.
        self._turns: dict[str, set[ReplicaName]] = {}
        self._turn_timers: dict[tuple[str, ReplicaName], asyncio.TimerHandle] = {}
        #: Of those, the tenants with no other free seat (in the pools named): blocked in
        #: the scheduler until a seat may have freed for them (``_lift_turns``) or a retry
        #: time (``_turn_over``).
        self._turn_blocked: dict[str, set[str | None]] = {}
        #: Seat calls to Redis in flight, per (tenant, model pool): the tenant still wants
        #: a seat of that pool, as if queued (``_stop_waiting``).
        self._asking: dict[tuple[str, str | None], int] = {}

    # -- configuration -----------------------------------------------------------------

    def set_limits(self, limits: Mapping[str, TenantLimits]) -> None:
        """New caps and capacities apply at once; nothing queued is evicted."""
        self._limits = dict(limits)
        for tenant in set(self._inflight) | set(self._limits):
            self.scheduler.set_blocked(tenant, self._held_back(tenant))
        self.pump()

    def set_observing(self, observing: bool) -> None:
        """``mode: observe`` on or off (reload). Turned on, every queued ticket is
        forwarded now; turned off, requests running above the seat limits finish."""
        self._observing = observing
        for tenant in list(self._inflight):
            self.scheduler.set_blocked(tenant, self._at_cap(tenant) and not observing)
        self.pump()

    @property
    def observing(self) -> bool:
        return self._observing

    def limits_for(self, tenant: str) -> TenantLimits:
        return self._limits.get(tenant) or TenantLimits(max_concurrency=None, queue_capacity=0)

    # -- observation -------------------------------------------------------------------

    def inflight(self, tenant: str) -> int:
        return self._inflight.get(tenant, 0)

    def total_inflight(self) -> int:
        return sum(self._inflight.values())

    def depth_high_water(self) -> dict[str, int]:
        """Each tenant's deepest queue since start (``admission_queue_depth_max``)."""
        return dict(self._high_water)

    def queued(self) -> int:
        return len(self.scheduler)

    def keep_tenants(self, keep: Container[str], fold_into: str) -> None:
        """Forget the since-start figures of tenants not in ``keep`` (a reload removed
        them and nothing of theirs runs), folded into ``fold_into``'s: the label their
        series count under once forgotten, so the metrics read the same. Kept, each
        tenant a reload ever removed stayed here for the process's life."""
        for tenant in [t for t in self._high_water if t not in keep and t != fold_into]:
            high = self._high_water.pop(tenant)
            self._high_water[fold_into] = max(high, self._high_water.get(fold_into, 0))
        for tenant in [t for t in self._headroom_grants if t not in keep and t != fold_into]:
            grants = self._headroom_grants.pop(tenant)
            self._headroom_grants[fold_into] = self._headroom_grants.get(fold_into, 0) + grants

    @property
    def headroom_grants(self) -> int:
        """Requests started on a headroom seat since start (``/admin/state``)."""
        return sum(self._headroom_grants.values())

    def headroom_grants_by_tenant(self) -> dict[str, int]:
        """The same per tenant (``admission_headroom_dispatches_total``)."""
        return dict(self._headroom_grants)

    def below_fair_share(
        self, tenant: str, priority: str, now: float, model: str | None = None
    ) -> bool:
        """The tenant's recent share of the work is under its weighted share.

        Its share counts the flows backlogged now plus itself, so with nobody
        else waiting it is 1.0 and a lone tenant never qualifies: headroom is
        for isolation, not extra throughput.
        """
        share = self.scheduler.share_in(model, tenant, priority)
        usage = self._usage.get(model)
        return (usage.fraction(tenant, now) if usage is not None else 0.0) < share

    def predict_wait(
        self, tenant: str, priority: str, now: float, model: str | None = None
    ) -> float | None:
        """Expected queue wait of a new ticket of this flow (in its pool) now; None: no data."""
        return self.waits.predict(tenant, priority, now, model)

    def __repr__(self) -> str:
        return (
            f"<Dispatcher {self.total_inflight()} active, {len(self.scheduler)} queued, "
            f"{self.pool!r}>"
        )

    # -- the queueing stage ------------------------------------------------------------

    def enqueue(
        self, tenant: str, priority: str, cost: float, deadline: Deadline, *, asked: object = ...
    ) -> Ticket:
        """``enqueue_in`` the one implicit pool (a deployment not routed by model)."""
        return self.enqueue_in(None, tenant, priority, cost, deadline, asked=asked)

    def enqueue_in(
        self,
        model: str | None,
        tenant: str,
        priority: str,
        cost: float,
        deadline: Deadline,
        *,
        affinity: int | None = None,
        asked: object = ...,
    ) -> Ticket:
        """Grant a seat at once, place a ticket in its tenant's queue, or refuse.

        With nobody queued in its pool, a free seat there and room under its
        cap, the ticket is granted here without touching the scheduler (the
        common, unloaded case); ``wait`` then returns without suspending.
        ``model``: the pool whose replicas it may use (``None``: every replica);
        ``affinity``: its ``prefix_affinity`` key; ``asked``: see ``Ticket.asked``.
        """
        if self._closed is not None:
            raise admission.shutting_down()
        now = self._clock.now()
        expires_at = deadline.queue_expires_at(now)
        replica = self._replica_for_immediate_start(tenant, model, affinity, cost)
        headroom = False
        if replica is None:
            replica = self._headroom_for(tenant, priority, now, model)
            headroom = replica is not None
        if replica is not None:
            ticket = Ticket(
                tenant, priority, cost, now, expires_at, model=model, affinity=affinity, asked=asked
            )
            seat = self.pool.lease(replica)
            seat.headroom = headroom
            self._grant(ticket, seat, now)
            if headroom:
                self._headroom_grants[tenant] = self._headroom_grants.get(tenant, 0) + 1
            return ticket
        if self._observing:
            observed = self._forward_observed(
                tenant, priority, cost, now, expires_at, model, affinity
            )
            if observed is not None:
                return observed
        gone = self.seats.unserved(model)  # dropped since the entrance chose it
        if gone is not None:
            raise gone.error()
        depth = self.scheduler.depth(tenant)
        refusal = admission.queue_refusal(
            tenant, self.limits_for(tenant), depth, at_cap=self._at_cap(tenant),
            free_place_s=lambda: self.waits.time_to_free_place(tenant, priority, now, model),
        )  # fmt: skip
        if refusal is None and self._predictive_rejection:
            refusal = admission.wait_refusal(
                self.predict_wait(tenant, priority, now, model), expires_at - now
            )
        if refusal is not None:
            if isinstance(refusal, PredictedWaitExceedsBudget):
                self.pressure.refused(priority, model)
            raise refusal
        loop = asyncio.get_running_loop()
        ticket = Ticket(
            tenant, priority, cost, now, expires_at, future=loop.create_future(), model=model,
            affinity=affinity, asked=asked,
        )  # fmt: skip
        self.scheduler.push(ticket)
        self.waits.queued(tenant, priority, model)
        if depth + 1 > self._high_water.get(tenant, 0):
            self._high_water[tenant] = depth + 1
        self.pump()
        if ticket.seat is None:
            ticket.timer = loop.call_later(max(0.0, expires_at - now), self._expire, ticket)
        return ticket

    async def wait(self, ticket: Ticket) -> Seat:
        """Suspend until ``ticket`` holds a seat (and its shared places); raises its
        rejection otherwise. In observe mode the shared places are not taken: nothing
        may wait or be refused there, and a full shared place would requeue it."""
        try:
            while True:
                seat = ticket.seat if ticket.seat is not None else await self._wait_local(ticket)
                if self.shared is None or self._observing or await self._take_shared(ticket, seat):
                    return seat
        finally:
            if self.shared is not None:
                self._stop_waiting(ticket.tenant)

    async def _wait_local(self, ticket: Ticket) -> Seat:
        assert ticket.future is not None
        try:
            return await ticket.future
        except asyncio.CancelledError:
            self._abandon(ticket)
            raise

    async def reseat(
        self, exclude: frozenset[ReplicaName], timeout_s: float, model: str | None = None
    ) -> Seat:
        """A seat for a retry, ahead of every queued ticket, preferring another replica.

        The retry kept its tenant place during its backoff; only the replica
        seat was given back. While another replica is dispatchable, the retry
        waits for a seat there (up to ``reseats.RESEAT_PREFERENCE_S``) rather than go
        straight back to the replica that just failed it. Raises
        ``TimeoutError`` when no seat frees in time. In observe mode a retry
        never waits: it takes an overflow seat when no seat is free.
        """
        if self._observing and self.seats.free(model) is None:
            replica = overflow_replica(self.seats, model, exclude)
            if replica is not None:
                return self.pool.lease(replica)
        deadline = self._clock.now() + timeout_s
        while True:
            seat = await self._reseating.wait(
                exclude, max(0.0, deadline - self._clock.now()), model, pump=self.pump,
                release=self.release,
            )  # fmt: skip
            if self.shared is None or self._observing:
                return seat
            replica = seat.replica
            try:
                answer = await self.shared.take_seat(replica.name, replica.limit)
            except BaseException:
                self.release(seat)
                raise
            if not isinstance(answer, Blocked):
                if self._serves(replica, model):
                    seat.lease = answer.seat
                    return seat
                seat.released = True  # the fleet changed during the call: seat back
                self._free(replica, answer.seat)
                continue
            seat.released = True
            self._hold_off(answer)
            self._free(replica)

    # -- shared places (``proxy/places.py``) -------------------------------------------

    async def _take_shared(self, ticket: Ticket, seat: Seat) -> bool:
        """The grant's places across instances: True when held; False: back in the queue."""
        assert self.shared is not None
        limits = self._limits.get(ticket.tenant)
        cap = limits.max_concurrency if limits is not None else None
        weight = limits.weight if limits is not None else 1.0
        replica = seat.replica
        seats = replica.limit + (replica.headroom if seat.headroom else 0)
        asking = (ticket.tenant, ticket.model)
        self._asking[asking] = self._asking.get(asking, 0) + 1
        try:
            answer = await self.shared.take(
                ticket.tenant, cap, replica.name, seats, weight, headroom=seat.headroom,
                backlog_s=self._backlog_s(ticket),
            )  # fmt: skip
        except BaseException:
            self._ungrant(ticket, seat)
            self.pump()
            raise
        finally:
            if self._asking[asking] == 1:
                del self._asking[asking]
            else:
                self._asking[asking] -= 1
        if answer.elsewhere is not None:
            self.waits.seen_elsewhere(replica.name, answer.elsewhere, self._clock.now())
        if not isinstance(answer, Blocked):
            if self._serves(replica, ticket.model):
                ticket.place, seat.lease = answer.place, answer.seat
                return True
            # The fleet changed during the call (discovery lost the model there, a
            # reload removed the replica): the engine would answer 404. Places back,
            # and the ticket goes where its model is served now, or gets the entrance's
            # answer (``_requeue``: 404 ``model_not_found`` when no replica lists it).
            for handle in (answer.place, answer.seat):
                if handle is not None:
                    self.shared.give_back(handle)
            self._ungrant(ticket, seat)
            self._requeue_ungranted(ticket)
            return False
        self._ungrant(ticket, seat)
        if answer.turn:
            self._turn_refused(ticket, answer)
        else:
            self._hold_off(answer, headroom=seat.headroom)
        # The knee full elsewhere turns into headroom; a turn refused does not (the knee
        # has free seats, another instance's tenant's: headroom would jump its turn).
        if (
            answer.kind == "replica"
            and not answer.turn
            and not seat.headroom
            and self._headroom_instead(ticket)
        ):
            return False  # ``wait`` takes its headroom seat's shared places next
        if answer.kind == "replica" and not answer.turn:
            self._hold_if_avoiding(ticket)  # the seat it took instead was full elsewhere
        self._requeue_ungranted(ticket)
        return False

    def _requeue_ungranted(self, ticket: Ticket) -> None:
        """``_requeue`` after ``_ungrant``, which freed the local seat without a pump:
        when the ticket's refusal is raised instead (expired, model gone, closing), the
        pump still runs, or a ticket queued behind that seat waited for the next event."""
        try:
            self._requeue(ticket)
        except BaseException:
            self.pump()
            raise

    def _serves(self, replica: Replica, model: str | None) -> bool:
        """``replica`` is still in the fleet and in ``model``'s pool: checked after the
        seat's Redis call, during which discovery or a reload may have taken it away
        (the pump checked before it)."""
        if replica.retired or self.pool.get(replica.name) is not replica:
            return False
        members = self.seats.members(model)
        return members is None or replica.name in members

    def _stop_waiting(self, tenant: str) -> None:
        """A ticket of ``tenant`` left the queue (seated, refused, expired, its client
        gone): where a refused seat recorded the tenant as waiting in Redis and it has
        nothing queued (nor a seat call in flight) for a pool of that replica any more,
        the entry goes now. Left to expire, it refused other instances' tenants their
        turn for a tenant that no longer waited (for up to ``WAITING_MS``). A tenant
        never refused costs one dict lookup."""
        assert self.shared is not None
        replicas = self.shared.waiting_at(tenant)
        if not replicas:
            return
        models = {m for m in self.scheduler.waiting_models() if self.scheduler.of(m).depth(tenant)}
        models.update(model for who, model in self._asking if who == tenant)
        done = [
            name
            for name in replicas
            if not any(
                (members := self.seats.members(m)) is None or name in members for m in models
            )
        ]
        if done:
            self.shared.stop_waiting(tenant, done)

    def _backlog_s(self, ticket: Ticket) -> float:
        """How long this process counts as backlogged for the ticket's pool, said with its
        seat call for the other instances' waits; 0: no backlog. Backlogged: the ticket
        waited in the queue, or more wait now. For ``BACKLOG_SEAT_TIMES`` mean seat times:
        a saturated process calls again only when one of its own seats frees, and a
        grant with no queue (seats freed together, closed-loop clients between two
        requests) does not end its backlog."""
        if ticket.future is None and not len(self.scheduler.of(ticket.model)):
            return 0.0
        mean = self.waits.seat_time_of(ticket.model).mean_s
        return BACKLOG_SEAT_TIMES * (mean or DEFAULT_FREE_PLACE_S)

    def _headroom_instead(self, ticket: Ticket) -> bool:
        """A regular seat refused across the instances: the knee is full, which this
        process could not see. Had it known, a tenant below its fair share with nothing
        else queued would have started on a headroom seat, as on one instance
        (``_headroom_for``); it does now instead of queueing for the knee. The ticket was
        granted with nobody queued or popped from the head of its queue, so it is its
        tenant's oldest."""
        now = self._clock.now()
        if self._closed is not None or ticket.expires_at <= now:
            return False
        replica = self._headroom_for(ticket.tenant, ticket.priority, now, ticket.model)
        if replica is None:
            return False
        seat = self.pool.lease(replica)
        seat.headroom = True
        self._grant(ticket, seat, now)
        self._headroom_grants[ticket.tenant] = self._headroom_grants.get(ticket.tenant, 0) + 1
        return True

    def _ungrant(self, ticket: Ticket, seat: Seat) -> None:
        """Undo a local grant whose shared places were not taken (no pump: the caller's)."""
        self.waits.ended(ticket.id, None)
        self._inflight[ticket.tenant] -= 1
        if not self._inflight[ticket.tenant]:
            del self._inflight[ticket.tenant]
        if not self._held_back(ticket.tenant):
            self.scheduler.set_blocked(ticket.tenant, False)
        ticket.seat, ticket.granted_at = None, None
        seat.released = True
        self.seats.affinity.ended(seat, warmed=False)
        self.pool.free(seat.replica)
        self._unhold(ticket.tenant)  # the seat is back: maybe one it does not avoid

    def _requeue(self, ticket: Ticket) -> None:
        """Back in its queue (or its refusal raised): its pop's charge refunded."""
        if ticket.future is not None:
            self.scheduler.finished(ticket, 0.0)  # popped: undo the charge of that dispatch
        if self._closed is not None:
            raise self._closed
        gone = self.seats.unserved(ticket.model)
        if gone is not None:
            raise gone.error()
        now = self._clock.now()
        if ticket.expires_at <= now:
            raise self._expiry(ticket, now)
        loop = asyncio.get_running_loop()
        ticket.future = loop.create_future()
        self.scheduler.push(ticket)
        self.pump()
        if ticket.seat is None:
            ticket.timer = loop.call_later(ticket.expires_at - now, self._expire, ticket)

    def _hold_off(self, blocked: Blocked, *, headroom: bool = False) -> None:
        """Pass over a full shared place until it may have freed (``freed``), or until the
        earliest lease there would expire unrenewed (a process that died publishes nothing).

        A replica refused for a regular seat is held off for regular seats only: its
        headroom seats may still be free across the instances; ``headroom``: the seat
        refused was one of those, so they are held off too."""
        if blocked.kind == "tenant":
            self._shared_blocked.add(blocked.name)
            self.scheduler.set_blocked(blocked.name, True)
        else:
            replica = self.pool.get(blocked.name)
            if replica is None:
                return
            replica.shared_full = True
            replica.shared_headroom_full = replica.shared_headroom_full or headroom
        key = (blocked.kind, blocked.name)
        timer = self._freed_timers.get(key)
        loop = asyncio.get_running_loop()
        when = loop.time() + max(0.001, blocked.retry_in_s)
        if timer is None or timer.when() > when:
            if timer is not None:
                timer.cancel()
            self._freed_timers[key] = loop.call_at(when, self.freed, blocked.kind, blocked.name)

    def _turn_refused(self, ticket: Ticket, blocked: Blocked) -> None:
        """Redis refused ``ticket``'s tenant a free seat of ``blocked.name``: another
        tenant, on another instance, has the earlier finish tag there. The seat is not
        full, and the other tenants of this process may be in their turn: holding the
        replica off for them all (``_hold_off``) left the seat idle up to the retry time
        while they queued. So only this tenant avoids that replica, until a seat there
        may have freed or the refusal's ``retry_in_s`` (its waiting entry in Redis lives
        as long as it asks again in time). It is blocked in the scheduler only when no
        other seat of its pool is free, or the pump would hand it the same seat again."""
        tenant, replica = ticket.tenant, ReplicaName(blocked.name)
        turns = self._turns.setdefault(tenant, set())
        turns.add(replica)
        loop = asyncio.get_running_loop()
        when = loop.time() + max(0.001, blocked.retry_in_s)
        timer = self._turn_timers.get((tenant, replica))
        if timer is None or timer.when() > when:
            if timer is not None:
                timer.cancel()
            self._turn_timers[(tenant, replica)] = loop.call_at(
                when, self._turn_over, tenant, replica
            )
        self._hold_if_avoiding(ticket)

    def _hold_if_avoiding(self, ticket: Ticket) -> None:
        """Block ``ticket``'s tenant in the scheduler while the only free seats of its
        pool are on replicas that refused it its turn: the pump would hand it one, and
        Redis refuse it again. Only a tenant with such a replica (and so a timer that
        lifts the block) is blocked."""
        turns = self._turns.get(ticket.tenant)
        if turns and self.seats.free(ticket.model, avoid=frozenset(turns)) is None:
            self._turn_blocked.setdefault(ticket.tenant, set()).add(ticket.model)
            self.scheduler.set_blocked(ticket.tenant, True)

    def _turn_over(self, tenant: str, replica: ReplicaName) -> None:
        """A turn refusal's retry time: the tenant asks that replica again."""
        self._turn_timers.pop((tenant, replica), None)
        turns = self._turns.get(tenant)
        if turns is not None:
            turns.discard(replica)
            if not turns:
                del self._turns[tenant]
        self._unhold(tenant)
        self.pump()

    def _lift_turns(self, replica: str | None) -> bool:
        """A seat of ``replica`` (None: of any) may have freed: the turns refused there
        are asked again, and each tenant held for want of another seat is let go where
        ``_unhold`` says (refused again, it is held again). Called once the seat is back
        in the local pool. Returns whether anything changed."""
        changed = False
        for (tenant, name), timer in list(self._turn_timers.items()):
            if replica is None or name == replica:
                timer.cancel()
                del self._turn_timers[(tenant, name)]
                turns = self._turns.get(tenant)
                if turns is not None:
                    turns.discard(name)
                    if not turns:
                        del self._turns[tenant]
                changed = True
        for tenant in list(self._turn_blocked):
            changed = self._unhold(tenant, replica) or changed
        return changed

    def _unhold(self, tenant: str, replica: str | None = None) -> bool:
        """Let a tenant held by ``_hold_if_avoiding`` go back in the scheduler when it
        avoids nothing any more or a seat it does not avoid is free now, in the pool it
        was held for or one where it waits. Otherwise it stays held: let go, the pump
        handed it the free seat it avoids and Redis refused it again (one round trip per
        held tenant for every release heard in the fleet). It still avoids a replica
        then, whose timer (``_turn_over``) comes back here. ``replica``: only a seat of
        that one may have freed since (``_lift_turns``). True: let go."""
        models = self._turn_blocked.get(tenant)
        if models is None or (
            self._turns.get(tenant) and not self._free_for(tenant, models, replica)
        ):
            return False
        del self._turn_blocked[tenant]
        self.scheduler.set_blocked(tenant, self._at_cap(tenant))
        return True

    def _free_for(self, tenant: str, models: set[str | None], replica: str | None = None) -> bool:
        """A seat ``tenant`` does not avoid is free in one of ``models`` or of the pools
        where it has tickets queued; ``replica``: on that one (the only one whose seat
        may have freed: every release asks, for every held tenant, so it must be cheap)."""
        avoid = self._avoided(tenant)
        if replica is not None:
            one = self.pool.get(replica)
            if one is None or not one.has_free_seat or one.name in avoid:
                return False
        waits = {m for m in self.scheduler.waiting_models() if self.scheduler.of(m).depth(tenant)}
        if replica is None:
            return any(self.seats.free(m, avoid=avoid) is not None for m in models | waits)
        return any(
            (members := self.seats.members(m)) is None or replica in members for m in models | waits
        )

    def freed(self, kind: PlaceKind | None, name: str | None) -> None:
        """A shared place may have freed (``kind`` ``name``; None: any): try again now."""
        changed = False
        if kind is None or kind == "tenant":
            tenants = set(self._shared_blocked) if name is None else {name}
            for tenant in tenants & self._shared_blocked:
                self._shared_blocked.discard(tenant)
                self.scheduler.set_blocked(tenant, self._held_back(tenant))
                changed = True
        if kind is None or kind == "replica":
            for replica in self.pool.replicas:
                held_off = replica.shared_full or replica.shared_headroom_full
                if held_off and (name is None or replica.name == name):
                    replica.shared_full = replica.shared_headroom_full = False
                    changed = True
            changed = self._lift_turns(name) or changed
        for key in [k for k in self._freed_timers if kind is None or k == (kind, name)]:
            self._freed_timers.pop(key).cancel()
        if changed:
            self.pump()

    # -- seats and places back ---------------------------------------------------------

    def release(self, seat: Seat, delay_s: float = 0.0) -> None:
        """Give a seat back now, or after ``delay_s`` (a cancelled request's grace).

        Idempotent. Engines notice a closed connection late, so a cancelled
        request's seat stays taken a little while; it counts as released at
        once for the caller, which must not release it again.
        """
        if seat.released:
            return
        seat.released = True
        self.seats.affinity.ended(seat)
        lease, seat.lease = seat.lease, None
        if delay_s > 0:
            asyncio.get_running_loop().call_later(delay_s, self._free, seat.replica, lease)
        else:
            self._free(seat.replica, lease)

    def _free(self, replica: Replica, lease: object | None = None) -> None:
        if lease is not None and self.shared is not None:
            self.shared.give_back(lease)
            # This process may reuse the seat it frees.
            replica.shared_full = replica.shared_headroom_full = False
        self.pool.free(replica)
        if lease is not None and self.shared is not None:
            self._lift_turns(replica.name)  # the seat is back: free for a held tenant
        self.pump()

    def finish(
        self,
        ticket: Ticket,
        seat: Seat | None,
        *,
        actual_cost: float | None = None,
        seat_grace_s: float = 0.0,
    ) -> None:
        """The request ended: free the tenant place now and the seat (maybe after grace)."""
        held = None
        if ticket.granted_at is not None and seat is not None and seat_grace_s == 0:
            held = self._clock.now() - ticket.granted_at
        self.waits.ended(ticket.id, held)
        self._overflow.ended(ticket.id)
        self._inflight[ticket.tenant] -= 1
        if not self._inflight[ticket.tenant]:
            del self._inflight[ticket.tenant]
        if ticket.place is not None and self.shared is not None:
            self.shared.give_back(ticket.place)
            ticket.place = None
            self._shared_blocked.discard(ticket.tenant)
        if not self._held_back(ticket.tenant):
            self.scheduler.set_blocked(ticket.tenant, False)
        self.scheduler.finished(ticket, ticket.cost if actual_cost is None else actual_cost)
        if seat is not None and not (seat.released or seat_grace_s > 0):
            self.release(seat)  # pumps
            return
        if seat is not None:
            self.release(seat, seat_grace_s)
        self.pump()  # the tenant place freed now even though the seat did not

    def release_seat(self, ticket: Ticket, seat: Seat) -> None:
        """The replica is done with the request before the client is: free the seat now.

        ``finish`` (called later with no seat) frees the tenant place; the seat
        time recorded here is the replica's, not the client's reading time.
        """
        held = None if ticket.granted_at is None else self._clock.now() - ticket.granted_at
        self.waits.ended(ticket.id, held)
        self._overflow.ended(ticket.id)
        self.release(seat)

    def fleet_changed(self) -> None:
        """Health, discovery or the GPU guard changed a replica: answer the waiters
        of a model no replica lists any more, then hand free seats out (``pump``)."""
        self.refuse_unserved()
        self.pump()

    def pool_now(self, ticket: Ticket) -> str | None:
        """The pool a ticket's next seat (a retry's) comes from: its own, or, for one
        admitted before the proxy routed by model, the pool its body's model names now
        (raises the entrance's refusal when none serves it)."""
        if ticket.model is not None or ticket.asked is ...:
            return ticket.model
        table = self.seats.models
        if table is None or not table.pooled:
            return None
        choice = table.select(ticket.asked, allowed=None)
        if isinstance(choice, ModelRefusal):
            raise choice.error()
        return choice.model

    def _route_unrouted(self) -> None:
        """The proxy has just started routing by model (discovery found a second model,
        a reload listed models): each ticket queued before, in the one implicit pool
        (every replica), moves to the pool its body's model names now, or gets the
        entrance's refusal (404 ``model_not_found``, 400 for no model with several
        pools). Left in the implicit pool, a request for one model was granted the
        seat of a replica serving another. A ticket whose body was not read for a
        model (a route other than inference) keeps any replica, as admitted."""
        table = self.seats.models
        if table is None or not table.pooled or not len(self.scheduler.default):
            return
        for ticket in self.scheduler.take_implicit():
            if ticket.future is None or ticket.future.done():
                continue  # its waiter left; ``_abandon`` finds it gone
            try:
                ticket.model = self.pool_now(ticket)
            except Rejected as refusal:
                self._fail(ticket, refusal)
                continue
            self.scheduler.push(ticket)

    def refuse_unserved(self) -> None:
        """404 ``model_not_found`` now for the queued tickets and waiting retries of a
        model that no replica lists any more (discovery lost it, a reload removed it).

        A new request for it is refused so at the entrance, and no seat of its pool can
        ever come, so its waiters get the same answer at once instead of waiting out
        their budgets. A pool whose replicas still list the model but are ejected or
        drained keeps its queue: they keep their models and may return.
        Tickets queued before the proxy routed by model are placed first
        (``_route_unrouted``).
        """
        self._route_unrouted()
        gone_models: set[str] = set()
        for model in self.pool_models():
            gone = self.seats.unserved(model)
            if gone is not None:
                gone_models.add(model)
                for ticket in self.scheduler.drop(model):
                    self._fail(ticket, gone.error())
        self._reseating.refuse_unserved()
        self._forget_models(gone_models)

    def pool_models(self) -> frozenset[str]:
        """The model pools this dispatcher keeps anything for (queue, fair-share and
        usage accounts, seat times): at most the models served now plus those whose
        last requests were still running at the last fleet change
        (``refuse_unserved`` forgets the rest)."""
        return frozenset(
            set(self.scheduler.depth_by_model())
            | {m for m in self._usage if m is not None}
            | {m for m in self._pool_turns if m is not None}
            | self.waits.pool_models()
        )

    def _forget_models(self, gone: set[str]) -> None:
        """Drop what is kept per model pool for models no replica lists any more.

        Adapters come and go (vLLM lists each LoRA adapter as a model), each with
        its own name: kept, their pools' accounts grew with every name the fleet
        ever served. A model that comes back starts afresh, as its queue does."""
        for model in gone:
            self._usage.pop(model, None)
            self._pool_turns.pop(model, None)
        self.waits.forget_models(gone)

    def close(self) -> None:
        """Shutting down: refuse new tickets and answer every queued one."""
        self._closed = admission.shutting_down()
        # Every blocked tenant: at its cap here, held off by its cap elsewhere
        # (shared state, maybe nothing in flight here) or by a fair turn refused.
        for tenant in set(self._inflight) | self._shared_blocked | set(self._turn_blocked):
            self.scheduler.set_blocked(tenant, False)
        while (ticket := self.scheduler.pop()) is not None:
            self._fail(ticket, self._closed)

    # -- granting ----------------------------------------------------------------------

    def pump(self) -> None:
        """Hand free seats to the retries, then to the tickets the scheduler picks.

        Runs after every change that can free a seat or a tenant place: here,
        and from health, GPU and admin changes (undrain, a replica back)."""
        if not (self._reseating or len(self.scheduler)):
            return  # nobody waits (every release when unloaded)
        self._reseating.serve()
        # Pools take turns, one grant each, the one served longest ago first: a
        # release frees one seat, and pools sharing its replica must share it.
        waiting = sorted(self.scheduler.waiting_models(), key=self._last_turn)
        while waiting:
            waiting = [model for model in waiting if self._pump_one(model)]
        if self._observing and len(self.scheduler):
            self._forward_queued()

    def _pump_one(self, model: str | None) -> bool:
        """Grant (or fail, if expired) the next ticket of one pool; False: nothing to do."""
        while True:
            if self.seats.free(model) is None:
                return False
            ticket = self.scheduler.pop_from(model)
            if ticket is None:
                return False
            if ticket.future is None or ticket.future.done():
                # Its waiter was cancelled and has not yet run ``_abandon``.
                continue
            now = self._clock.now()
            if ticket.expires_at <= now:
                self._fail(ticket, self._expiry(ticket, now))
                continue
            replica = self.seats.choose(
                model, ticket.affinity, ticket.cost, self._avoided(ticket.tenant)
            )
            assert replica is not None  # a seat of the pool was free above
            self._grant(ticket, self.pool.lease(replica), now)
            self._pool_turns[model] = self._grants
            return True

    def _avoided(self, tenant: str) -> frozenset[ReplicaName]:
        """Replicas that refused ``tenant`` its fair turn lately (``_turn_refused``)."""
        turns = self._turns.get(tenant)
        return frozenset(turns) if turns else frozenset()

    def _last_turn(self, model: str | None) -> int:
        return self._pool_turns.get(model, -1)

    def _grant(self, ticket: Ticket, seat: Seat, now: float) -> None:
        if ticket.timer is not None:
            ticket.timer.cancel()
        ticket.granted_at = now
        ticket.seat = seat
        if ticket.affinity is not None:
            self.seats.affinity.started(seat, ticket.affinity, ticket.cost)
        if ticket.observed != OBSERVED_OVERLOAD:  # counted as a refusal already
            self.pressure.waited(ticket.priority, now - ticket.enqueued_at,
                                 ticket.expires_at - ticket.enqueued_at, ticket.model)  # fmt: skip
        self.waits.started(
            ticket.id, ticket.tenant, seat.replica, now, priority=ticket.priority,
            model=ticket.model, from_queue=ticket.future is not None,
        )  # fmt: skip
        self._inflight[ticket.tenant] = self._inflight.get(ticket.tenant, 0) + 1
        if self._at_cap(ticket.tenant):
            self.scheduler.set_blocked(ticket.tenant, True)
        usage = self._usage.get(ticket.model)
        if usage is None:
            usage = self._usage[ticket.model] = RecentUsage()
        usage.record(ticket.tenant, ticket.cost, now)
        self._grants += 1
        if self._grants % USAGE_SWEEP_EVERY == 0:
            for usage in self._usage.values():
                usage.forget_idle(now)
            self.waits.forget_idle(now)
        if ticket.future is not None and not ticket.future.done():  # done: granted again
            ticket.future.set_result(seat)

    def _at_cap(self, tenant: str) -> bool:
        limits = self._limits.get(tenant)  # an unknown tenant has no cap (``limits_for``)
        cap = limits.max_concurrency if limits is not None else None
        if cap is None:
            return False
        return self._inflight.get(tenant, 0) >= cap or tenant in self._shared_blocked

    def _held_back(self, tenant: str) -> bool:
        """Blocked in the scheduler: at its cap (``_at_cap``), or held for want of a seat
        it does not avoid (``_hold_if_avoiding``, let go only by ``_unhold``: a place
        coming back does not give it a seat)."""
        return self._at_cap(tenant) or tenant in self._turn_blocked

    def _replica_for_immediate_start(
        self, tenant: str, model: str | None, affinity: int | None, cost: float
    ) -> Replica | None:
        """A free replica when the ticket may skip the queue: nobody waits in its pool,
        under its cap."""
        if (
            self.scheduler.depth_of_model(model)
            or self._reseating.waiting_in(model)
            or self._at_cap(tenant)
        ):
            return None
        return self.seats.choose(model, affinity, cost, self._avoided(tenant))

    def _headroom_for(
        self, tenant: str, priority: str, now: float, model: str | None
    ) -> Replica | None:
        """A seat above the knee for a tenant below its fair share with nothing queued.

        Its own queue must be empty (its tickets keep their order) and it must
        be under its own cap; everyone else waits for a regular seat. Never on a
        replica that just refused it its fair turn (``_turn_refused``): its knee has a
        free seat, another tenant's turn, and a headroom seat, taken outside the turn,
        would fill it.
        """
        if (
            not self.pool.offers_headroom()
            or self._at_cap(tenant)
            or self.scheduler.depth(tenant)
            or not self.below_fair_share(tenant, priority, now, model)
        ):
            return None
        return self.seats.free(model, headroom=True, avoid=self._avoided(tenant))

    # -- observe mode ------------------------------------------------------------------

    def _forward_observed(
        self, tenant: str, priority: str, cost: float, now: float, expires_at: float,
        model: str | None, affinity: int | None,
    ) -> Ticket | None:  # fmt: skip
        """Observe mode, no seat free: run the checks enforcing would, name its refusal
        on the ticket, and forward it now on an overflow seat (None: no replica serves)."""
        replica = overflow_replica(self.seats, model)
        if replica is None:
            return None
        refusal = admission.queue_refusal(
            tenant, self.limits_for(tenant), self._overflow.depth(tenant),
            at_cap=self._at_cap(tenant), free_place_s=lambda: 0.0,
        )  # fmt: skip
        if refusal is None and self._predictive_rejection:
            refusal = admission.wait_refusal(
                self.predict_wait(tenant, priority, now, model), expires_at - now
            )
        ticket = Ticket(tenant, priority, cost, now, expires_at, model=model, affinity=affinity)
        if refusal is not None:
            ticket.observed = would(refusal.reason)
        if isinstance(refusal, PredictedWaitExceedsBudget):
            self.pressure.refused(priority, model)
        self._overflow.started(ticket.id, tenant)
        self._grant(ticket, self.pool.lease(replica), now)
        return ticket

    def _forward_queued(self) -> None:
        """Observe mode was turned on: every queued ticket goes now, on overflow seats."""
        now = self._clock.now()
        for model in self.scheduler.waiting_models():
            while (replica := overflow_replica(self.seats, model)) is not None:
                for tenant in list(self._inflight):  # nobody waits for its own cap either
                    self.scheduler.set_blocked(tenant, False)
                ticket = self.scheduler.pop_from(model)
                if ticket is None:
                    break
                if ticket.future is None or ticket.future.done():
                    continue
                self._overflow.started(ticket.id, ticket.tenant)
                self._grant(ticket, self.pool.lease(replica), now)

    # -- refusals after the wait -------------------------------------------------------

    def _flow(self, tenant: str, model: str | None) -> Flow:
        cap = self.limits_for(tenant).max_concurrency
        return Flow(cap, self._at_cap(tenant), self._reseating.ahead_in(model))

    def _expiry(self, ticket: Ticket, now: float) -> ProxyError:
        tenant, priority, model = ticket.tenant, ticket.priority, ticket.model
        error = admission.expiry(
            tenant,
            now - ticket.enqueued_at,
            held_by_cap=self._at_cap(tenant) and self.seats.free(model) is not None,
            free_place_s=lambda: self.waits.time_to_free_place(tenant, priority, now, model),
            wait_s=lambda: self.waits.retry_after_queue_timeout(tenant, priority, now, model),
        )
        if isinstance(error, QueueTimeout):  # not its own cap: the fleet had no seat in time
            self.pressure.refused(priority, model)
        return error

    def _fail(self, ticket: Ticket, error: Exception) -> None:
        if ticket.timer is not None:
            ticket.timer.cancel()
        if ticket.future is not None and not ticket.future.done():
            ticket.future.set_exception(error)

    def _expire(self, ticket: Ticket) -> None:
        if self.scheduler.remove(ticket):
            self._fail(ticket, self._expiry(ticket, self._clock.now()))

    def _abandon(self, ticket: Ticket) -> None:
        """The waiter was cancelled: undo whatever state the ticket reached."""
        fut = ticket.future
        assert fut is not None
        if fut.done() and not fut.cancelled() and fut.exception() is None:
            # Granted, but the client left before it could use the seat.
            self.finish(ticket, fut.result())
            return
        if ticket.timer is not None:
            ticket.timer.cancel()
        self.scheduler.remove(ticket)
