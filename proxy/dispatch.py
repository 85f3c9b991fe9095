"""The dispatcher: tickets in, seats out.

It ties the three synchronous pieces together (the ``Scheduler`` that orders
tickets, the ``ReplicaPool`` that owns seats, the per-tenant in-flight places)
with the only asynchronous parts of admission: each waiting ticket's future
and its queue-expiry timer. The policy decision ("which ticket, which
replica") is made in ``_pump``, one synchronous pass with no I/O; waking the
waiters is the only side effect.

Invariants:
- a ticket is in exactly one of: queued, granted, expired, abandoned;
- an expired ticket is never granted (``_pump`` checks the clock too, in case
  a timer fires late);
- a client that leaves frees its queue place and tenant place at once
  (``wait`` removes it in its ``CancelledError`` path).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Mapping
from dataclasses import dataclass

from proxy.admitted import Deadline
from proxy.clock import Clock
from proxy.errors import (
    PredictedWaitExceedsBudget,
    QueueTimeout,
    ShuttingDown,
    TenantConcurrency,
    TenantQueueFull,
)
from proxy.estimators import RecentDispatches, RecentUsage, SeatTime
from proxy.replicas import Replica, ReplicaName, ReplicaPool, Seat
from proxy.scheduler import Scheduler, Ticket

#: Retry-After when nothing is known yet about seat times.
DEFAULT_FREE_PLACE_S = 1.0
#: The wait estimator fails open until it has seen this many dispatches end
#: (their seat times), so a cold proxy never refuses on no data.
MIN_DISPATCHES_TO_PREDICT = 20
#: How long a retry waits for a seat on another replica before taking one on the
#: replica that just failed it.
RESEAT_PREFERENCE_S = 1.0
#: Grants between sweeps of tenants whose recent usage decayed to nothing.
USAGE_SWEEP_EVERY = 4096


@dataclass(frozen=True, slots=True)
class TenantLimits:
    """The part of a tenant's config the dispatcher enforces; swapped on reload."""

    max_concurrency: int | None
    queue_capacity: int


class _Reseat:
    """A retry waiting for a seat."""

    __slots__ = ("exclude", "future", "strict")

    def __init__(
        self, future: asyncio.Future[Seat], exclude: frozenset[ReplicaName], strict: bool
    ) -> None:
        self.future = future
        self.exclude = exclude
        self.strict = strict


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
        self.scheduler = scheduler
        self._clock = clock
        self._limits = dict(limits)
        self._inflight: dict[str, int] = {}
        self._predictive_rejection = predictive_rejection
        self._seat_time = SeatTime()
        #: When each running request got its seat, and where (for the release times).
        self._running: dict[int, tuple[float, Replica]] = {}
        self._recent = RecentDispatches()
        self._usage = RecentUsage()
        self._grants = 0
        self._headroom_grants: dict[str, int] = {}
        self._high_water: dict[str, int] = {}
        #: Retries waiting for a seat: served ahead of queued tickets.
        self._reseating: list[_Reseat] = []
        self._pumping = False
        self._closed: ShuttingDown | None = None
        pool.set_on_free(self._pump)

    # -- configuration -----------------------------------------------------------------

    def set_limits(self, limits: Mapping[str, TenantLimits]) -> None:
        """New caps and capacities apply at once; nothing queued is evicted."""
        self._limits = dict(limits)
        for tenant in set(self._inflight) | set(self._limits):
            self.scheduler.set_blocked(tenant, self._at_cap(tenant))
        self._pump()

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

    @property
    def headroom_grants(self) -> int:
        """Requests started on a headroom seat since start (``/admin/state``)."""
        return sum(self._headroom_grants.values())

    def headroom_grants_by_tenant(self) -> dict[str, int]:
        """The same per tenant (``admission_headroom_dispatches_total``)."""
        return dict(self._headroom_grants)

    def below_fair_share(self, tenant: str, priority: str, now: float) -> bool:
        """The tenant's recent share of the work is under its weighted share.

        Its share counts the flows backlogged now plus itself, so with nobody
        else waiting it is 1.0 and a lone tenant never qualifies: headroom is
        for isolation, not extra throughput.
        """
        return self._usage.fraction(tenant, now) < self.scheduler.share_of(tenant, priority)

    def __repr__(self) -> str:
        return (
            f"<Dispatcher {self.total_inflight()} active, {len(self.scheduler)} queued, "
            f"{self.pool!r}>"
        )

    # -- the admission path ------------------------------------------------------------

    def enqueue(self, tenant: str, priority: str, cost: float, deadline: Deadline) -> Ticket:
        """Grant a seat at once, place a ticket in its tenant's queue, or refuse.

        With nobody queued, a free seat and room under its cap, the ticket is
        granted here without touching the scheduler (the common, unloaded
        case); ``wait`` then returns without suspending.
        """
        if self._closed is not None:
            raise ShuttingDown("the proxy is shutting down", retry_after_s=1.0)
        now = self._clock.now()
        expires_at = deadline.queue_expires_at(now)
        replica = self._replica_for_immediate_start(tenant)
        headroom = False
        if replica is None:
            replica = self._headroom_for(tenant, priority, now)
            headroom = replica is not None
        if replica is not None:
            ticket = Ticket(tenant, priority, cost, now, expires_at)
            self._grant(ticket, self.pool.lease(replica), now)
            if headroom:
                self._headroom_grants[tenant] = self._headroom_grants.get(tenant, 0) + 1
            return ticket
        limits = self.limits_for(tenant)
        depth = self.scheduler.depth(tenant)
        if depth >= limits.queue_capacity:
            if limits.queue_capacity == 0 and self._at_cap(tenant):
                raise TenantConcurrency(
                    f"tenant {tenant!r} is at its concurrency limit of {limits.max_concurrency}",
                    retry_after_s=self._time_to_free_place(tenant, priority, now),
                )
            raise TenantQueueFull(
                f"tenant {tenant!r} has {depth} requests queued (capacity {limits.queue_capacity})",
                retry_after_s=self._time_to_free_place(tenant, priority, now),
            )
        estimate = self.predict_wait(tenant, priority, now) if self._predictive_rejection else None
        if estimate is not None and estimate > expires_at - now:
            raise PredictedWaitExceedsBudget(
                f"expected wait {estimate * 1000:.0f} ms exceeds the queue budget of "
                f"{(expires_at - now) * 1000:.0f} ms",
                retry_after_s=estimate,
            )
        loop = asyncio.get_running_loop()
        ticket = Ticket(tenant, priority, cost, now, expires_at, future=loop.create_future())
        self.scheduler.push(ticket)
        if depth + 1 > self._high_water.get(tenant, 0):
            self._high_water[tenant] = depth + 1
        self._pump()
        if ticket.seat is None:
            ticket.timer = loop.call_later(max(0.0, expires_at - now), self._expire, ticket)
        return ticket

    async def wait(self, ticket: Ticket) -> Seat:
        """Suspend until ``ticket`` holds a seat; raises its rejection otherwise."""
        if ticket.seat is not None:
            return ticket.seat
        assert ticket.future is not None
        try:
            return await ticket.future
        except asyncio.CancelledError:
            self._abandon(ticket)
            raise

    async def reseat(self, exclude: frozenset[ReplicaName], timeout_s: float) -> Seat:
        """A seat for a retry, ahead of every queued ticket, preferring another replica.

        The retry kept its tenant place during its backoff; only the replica
        seat was given back. While another replica is dispatchable, the retry
        waits for a seat there (up to ``RESEAT_PREFERENCE_S``) rather than go
        straight back to the replica that just failed it. Raises
        ``TimeoutError`` when no seat frees in time.
        """
        loop = asyncio.get_running_loop()
        strict = any(r.dispatchable and r.name not in exclude for r in self.pool.replicas)
        waiter = _Reseat(loop.create_future(), exclude, strict)
        self._reseating.append(waiter)
        relax = None
        if strict:
            relax = loop.call_later(min(RESEAT_PREFERENCE_S, timeout_s / 2), self._relax, waiter)
        self._pump()
        try:
            async with asyncio.timeout(timeout_s):
                return await waiter.future
        except BaseException:
            future = waiter.future
            if future.done() and not future.cancelled() and future.exception() is None:
                future.result().release()
            elif not future.done():
                future.cancel()
            with contextlib.suppress(ValueError):
                self._reseating.remove(waiter)
            raise
        finally:
            if relax is not None:
                relax.cancel()

    def _relax(self, waiter: _Reseat) -> None:
        waiter.strict = False
        self._pump()

    def finish(
        self,
        ticket: Ticket,
        seat: Seat | None,
        *,
        actual_cost: float | None = None,
        seat_grace_s: float = 0.0,
    ) -> None:
        """The request ended: free the tenant place now and the seat (maybe after grace)."""
        if ticket.granted_at is not None and seat is not None and seat_grace_s == 0:
            self._seat_time.record(self._clock.now() - ticket.granted_at)
        self._running.pop(ticket.id, None)
        self._inflight[ticket.tenant] -= 1
        if not self._inflight[ticket.tenant]:
            del self._inflight[ticket.tenant]
        if not self._at_cap(ticket.tenant):
            self.scheduler.set_blocked(ticket.tenant, False)
        self.scheduler.finished(ticket, ticket.cost if actual_cost is None else actual_cost)
        if seat is not None:
            seat.release(seat_grace_s)
        if seat is None or seat_grace_s > 0:
            self._pump()  # the tenant place freed now even though the seat did not

    def release_seat(self, ticket: Ticket, seat: Seat) -> None:
        """The replica is done with the request before the client is: free the seat now.

        ``finish`` (called later with no seat) frees the tenant place; the seat
        time recorded here is the replica's, not the client's reading time.
        """
        if ticket.granted_at is not None:
            self._seat_time.record(self._clock.now() - ticket.granted_at)
        self._running.pop(ticket.id, None)
        seat.release()

    def close(self) -> None:
        """Shutting down: refuse new tickets and answer every queued one."""
        self._closed = ShuttingDown("the proxy is shutting down", retry_after_s=1.0)
        for tenant in list(self._inflight):
            self.scheduler.set_blocked(tenant, False)
        while (ticket := self.scheduler.pop()) is not None:
            self._fail(ticket, self._closed)

    # -- internals ---------------------------------------------------------------------

    def _at_cap(self, tenant: str) -> bool:
        limits = self._limits.get(tenant)  # an unknown tenant has no cap (``limits_for``)
        cap = limits.max_concurrency if limits is not None else None
        return cap is not None and self._inflight.get(tenant, 0) >= cap

    def _replica_for_immediate_start(self, tenant: str) -> Replica | None:
        """A free replica when the ticket may skip the queue: nobody waits, under its cap."""
        if len(self.scheduler) or self._reseating or self._at_cap(tenant):
            return None
        return self.pool.choose()

    def _headroom_for(self, tenant: str, priority: str, now: float) -> Replica | None:
        """A seat above the knee for a tenant below its fair share with nothing queued.

        Its own queue must be empty (its tickets keep their order) and it must
        be under its own cap; everyone else waits for a regular seat.
        """
        if (
            not self.pool.offers_headroom()
            or self._at_cap(tenant)
            or self.scheduler.depth(tenant)
            or not self.below_fair_share(tenant, priority, now)
        ):
            return None
        return self.pool.choose(headroom=True)

    def _time_to_free_place(self, tenant: str, priority: str, now: float) -> float:
        """Expected time until the tenant's queue moves by one (Retry-After of 429s).

        One over the rate its flow drains at now (``_drain_rates``); only a
        proxy that has seen no seat time yet says ``DEFAULT_FREE_PLACE_S``.
        """
        rates = self._drain_rates(tenant, priority, now)
        return 1.0 / rates[0] if rates else DEFAULT_FREE_PLACE_S

    def _wait_estimate(self, tenant: str, priority: str, now: float) -> float:
        """The wait a new ticket of this flow expects now (Retry-After of queue_timeout)."""
        estimate = self._estimate_wait(tenant, priority, now)
        return DEFAULT_FREE_PLACE_S if estimate is None else estimate

    def _capacity(self, now: float) -> float | None:
        """Dispatches per second the serving seats sustain: seats over the mean seat time.

        What the fleet *can* serve now, whatever it was asked lately: the seats
        of replicas serving now (a lost replica's seats are gone at once; the
        rate dispatched before the loss is not), and a seat time that a quiet
        period does not change.
        """
        seats = sum(r.limit for r in self.pool.replicas if r.serving)
        mean = self._seat_time.mean_s
        if not seats or not mean:
            return None
        return seats / mean

    def _drain_rates(self, tenant: str, priority: str, now: float) -> tuple[float, float] | None:
        """Dispatches per second for this flow, and for the queue as a whole; None: no data.

        Both start from the capacity the seats give now (``_capacity``), never
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
        drains no faster than its cap turns over.
        """
        capacity = self._capacity(now)
        if capacity is None:
            return None
        share = self.scheduler.share_of(tenant, priority)
        others = self._recent.others_per_second(tenant, now)
        idle_take = max(0.0, others - (1.0 - share) * capacity)
        returning = sum(
            1 for t in self._recent.active(now) if t != tenant and not self.scheduler.depth(t)
        )
        floor = capacity / (1.0 / share + returning)
        flow = max(min(share * capacity, capacity - idle_take), floor)
        cap = self.limits_for(tenant).max_concurrency
        mean = self._seat_time.mean_s
        if cap and mean:
            flow = min(flow, cap / mean)
        return flow, max(capacity - others, floor)

    def _estimate_wait(self, tenant: str, priority: str, now: float) -> float | None:
        """Time until a new ticket of this flow gets a seat.

        It gets one when the seats have freed as many times as the work ahead
        of it takes: its place in its flow scaled by the flow's share, or
        everything queued now scaled by the queue's, whichever is sooner
        (unless its own cap holds it back: then its own seats turn over).
        """
        rates = self._drain_rates(tenant, priority, now)
        if rates is None:
            return None
        flow, whole = rates
        own = self.scheduler.depth_by_class(tenant, priority) + 1
        if self._at_cap(tenant):
            return own / flow
        capacity = self._capacity(now)
        assert capacity is not None  # known whenever the rates are
        releases = min(own * capacity / flow, (len(self.scheduler) + 1) * capacity / whole)
        # Retries waiting for a seat take one ahead of every queued ticket.
        releases += len(self._reseating)
        return self._time_to_release(max(1, math.ceil(releases - 1e-9)), now)

    def _time_to_release(self, n: int, now: float) -> float:
        """When the serving seats will have freed ``n`` times, from what they run now.

        Each busy seat frees when its request has held it the mean seat time
        (at once if it is past that), then every mean seat time; a free seat
        counts as freeing now. Seats that started together free together, so
        this is a staircase, not ``n`` over the capacity: near the budget the
        difference decides.
        """
        mean = self._seat_time.mean_s
        seats = sum(r.limit for r in self.pool.replicas if r.serving)
        if not mean or not seats:
            return 0.0
        due = sorted(
            max(0.0, mean - (now - granted_at))
            for granted_at, replica in self._running.values()
            if replica.serving
        )[:seats]
        due.extend([0.0] * (seats - len(due)))
        due.sort()
        rounds, index = divmod(n - 1, seats)
        return due[index] + rounds * mean

    def predict_wait(self, tenant: str, priority: str, now: float) -> float | None:
        """Expected queue wait of a new ticket under the fair-share rule; None: no data.

        From the capacity the flow can get now (``_drain_rates``). Fails open
        until ``MIN_DISPATCHES_TO_PREDICT`` seat times are known.
        """
        if self._seat_time.count < MIN_DISPATCHES_TO_PREDICT:
            return None
        return self._estimate_wait(tenant, priority, now)

    def pump(self) -> None:
        """Re-run dispatch after a replica became available (undrain, health)."""
        self._pump()

    def _pump(self) -> None:
        """Hand free seats to the tickets the scheduler picks, until one runs out."""
        if self._pumping or not (self._reseating or len(self.scheduler)):
            return  # already pumping, or nobody waits (every release when unloaded)
        self._pumping = True
        try:
            for waiter in list(self._reseating):
                if waiter.future.done():
                    self._reseating.remove(waiter)
                    continue
                replica = self.pool.choose(waiter.exclude, strict=waiter.strict)
                if replica is None:
                    continue
                self._reseating.remove(waiter)
                waiter.future.set_result(self.pool.lease(replica))
            while len(self.scheduler):
                replica = self.pool.choose()
                if replica is None:
                    return
                ticket = self.scheduler.pop()
                if ticket is None:
                    return
                if ticket.future is None or ticket.future.done():
                    # Its waiter was cancelled and has not yet run ``_abandon``.
                    continue
                now = self._clock.now()
                if ticket.expires_at <= now:
                    self._fail(ticket, self._timeout_for(ticket, now))
                    continue
                self._grant(ticket, self.pool.lease(replica), now)
        finally:
            self._pumping = False

    def _grant(self, ticket: Ticket, seat: Seat, now: float) -> None:
        if ticket.timer is not None:
            ticket.timer.cancel()
        ticket.granted_at = now
        ticket.seat = seat
        self._running[ticket.id] = (now, seat.replica)
        self._inflight[ticket.tenant] = self._inflight.get(ticket.tenant, 0) + 1
        if self._at_cap(ticket.tenant):
            self.scheduler.set_blocked(ticket.tenant, True)
        self._recent.record(ticket.tenant, now)
        self._usage.record(ticket.tenant, ticket.cost, now)
        self._grants += 1
        if self._grants % USAGE_SWEEP_EVERY == 0:
            self._usage.forget_idle(now)
            self._recent.forget_idle(now)
        if ticket.future is not None:
            ticket.future.set_result(seat)

    def _fail(self, ticket: Ticket, error: Exception) -> None:
        if ticket.timer is not None:
            ticket.timer.cancel()
        if ticket.future is not None and not ticket.future.done():
            ticket.future.set_exception(error)

    def _timeout_for(self, ticket: Ticket, now: float) -> Exception:
        """Its own cap held it back (seats were free): 429; otherwise the service: 503."""
        if self._at_cap(ticket.tenant) and self.pool.choose() is not None:
            return TenantConcurrency(
                f"tenant {ticket.tenant!r} stayed at its concurrency limit for the queue budget",
                retry_after_s=self._time_to_free_place(ticket.tenant, ticket.priority, now),
            )
        waited_ms = (now - ticket.enqueued_at) * 1000.0
        return QueueTimeout(
            f"waited {waited_ms:.0f} ms in the queue without a free seat",
            retry_after_s=self._wait_estimate(ticket.tenant, ticket.priority, now),
        )

    def _expire(self, ticket: Ticket) -> None:
        if self.scheduler.remove(ticket):
            self._fail(ticket, self._timeout_for(ticket, self._clock.now()))

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
