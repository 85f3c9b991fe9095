"""The dispatcher with shared places (``Dispatcher.shared``), on a fake clock and a fake
``SharedPlaces`` that stands for the other instances: no sockets, no Redis."""

from __future__ import annotations

import asyncio
from collections.abc import Collection, Iterable

import pytest

from proxy.admitted import Deadline
from proxy.clock import FakeClock
from proxy.dispatch import Dispatcher, TenantLimits
from proxy.errors import ShuttingDown, StateUnavailable
from proxy.places import Blocked, Held
from proxy.replicas import Replica, ReplicaPool
from proxy.scheduler import FairScheduler, Ticket
from proxy.settings import BudgetsConfig, ReplicaConfig
from tests.helpers import wait_for

BUDGETS = BudgetsConfig(queue_ms=1000, first_byte_ms=1000, total_ms=5000)


class OtherInstances:
    """Places taken elsewhere (``held``), against the same limits; ours add to them."""

    def __init__(self) -> None:
        self.held: dict[str, int] = {}
        self.given_back: list[object] = []
        self.down = False
        self.retry_in_s = 60.0
        #: Replica seats refused as another tenant's fair turn, although free.
        self.turn_of_others = False

    def _take(self, key: str, limit: int) -> bool:
        if self.held.get(key, 0) >= limit:
            return False
        self.held[key] = self.held.get(key, 0) + 1
        return True

    async def take(
        self, tenant: str, cap: int | None, replica: str, seats: int, weight: float = 1.0,
        *, headroom: bool = False, backlog_s: float = 0.0,
    ) -> Held | Blocked:  # fmt: skip
        if self.down:
            raise StateUnavailable("down", retry_after_s=1.0)
        place = None
        if cap is not None:
            if not self._take(f"t:{tenant}", cap):
                return Blocked("tenant", tenant, self.retry_in_s)
            place = f"t:{tenant}"
        if self.turn_of_others or not self._take(f"r:{replica}", seats):
            if place is not None:
                self.held[place] -= 1
            return Blocked("replica", replica, self.retry_in_s, turn=self.turn_of_others)
        return Held(place, f"r:{replica}")

    async def take_seat(self, replica: str, seats: int) -> Held | Blocked:
        return await self.take("", None, replica, seats)

    def give_back(self, handle: object) -> None:
        assert isinstance(handle, str)
        self.held[handle] -= 1
        self.given_back.append(handle)

    def waiting_at(self, tenant: str) -> Collection[str]:
        return ()  # no fair turn kept here

    def stop_waiting(self, tenant: str, replicas: Iterable[str]) -> None:
        raise AssertionError("no tenant waits anywhere here")


def make(seats: int = 2, cap: int | None = None) -> tuple[Dispatcher, OtherInstances, FakeClock]:
    clock = FakeClock()
    replica = Replica(ReplicaConfig(name="r0", url="http://127.0.0.1:1", max_concurrency=seats))
    limits = {
        "a": TenantLimits(max_concurrency=cap, queue_capacity=8),
        "b": TenantLimits(max_concurrency=None, queue_capacity=8),
    }
    d = Dispatcher(ReplicaPool([replica]), FairScheduler({"standard": 1.0}), clock, limits)
    others = OtherInstances()
    d.shared = others
    return d, others, clock


def make_headroom(*tenants: str) -> tuple[Dispatcher, OtherInstances, FakeClock]:
    """r0 with a knee of 2 seats and 2 of headroom; ``tenants`` without caps."""
    clock = FakeClock()
    config = ReplicaConfig(name="r0", url="http://127.0.0.1:1", max_concurrency=2, headroom=2)
    limits = {t: TenantLimits(max_concurrency=None, queue_capacity=8) for t in tenants}
    d = Dispatcher(ReplicaPool([Replica(config)]), FairScheduler({"standard": 1.0}), clock, limits)
    others = OtherInstances()
    d.shared = others
    return d, others, clock


def enqueue(d: Dispatcher, clock: FakeClock, tenant: str) -> Ticket:
    return d.enqueue(tenant, "standard", 10.0, Deadline.start(clock.now(), BUDGETS))


async def test_a_seat_held_elsewhere_sends_the_ticket_back_until_it_frees() -> None:
    """Both seats of r0 are held by other instances: the locally granted ticket goes back to
    its queue, nothing stays counted here, r0 is held off; a release heard: it gets the seat."""
    d, others, clock = make(seats=2)
    others.held["r:r0"] = 2
    ticket = enqueue(d, clock, "b")
    waiter = asyncio.create_task(d.wait(ticket))
    await wait_for(lambda: d.pool.replicas[0].shared_full)
    assert d.pool.total_inflight() == 0 and d.inflight("b") == 0 and len(d.scheduler) == 1
    assert not waiter.done()
    others.held["r:r0"] = 1  # another instance gave one back; Redis published it
    d.freed("replica", "r0")
    seat = await waiter
    assert seat.lease == "r:r0" and others.held["r:r0"] == 2 and d.inflight("b") == 1
    d.finish(ticket, seat)
    assert others.given_back == ["r:r0"] and d.pool.total_inflight() == 0


async def test_a_tenant_cap_reached_elsewhere_blocks_only_that_tenant() -> None:
    """Tenant a (cap 1) holds its place on another instance: a waits, b takes the seat."""
    d, others, clock = make(seats=2, cap=1)
    others.held["t:a"] = 1
    a = enqueue(d, clock, "a")
    a_waiter = asyncio.create_task(d.wait(a))
    await wait_for(lambda: len(d.scheduler) == 1)
    b = enqueue(d, clock, "b")
    b_seat = await d.wait(b)
    assert b_seat.lease == "r:r0" and not a_waiter.done()
    others.held["t:a"] = 0
    d.freed("tenant", "a")
    a_seat = await a_waiter
    assert a.place == "t:a" and a_seat.lease == "r:r0" and others.held["r:r0"] == 2
    d.finish(a, a_seat)
    d.finish(b, b_seat)
    assert sorted(map(str, others.given_back)) == ["r:r0", "r:r0", "t:a"]
    assert others.held == {"t:a": 0, "r:r0": 0}


async def test_the_hold_off_ends_at_the_refusals_retry_time() -> None:
    """No release is ever published (the holder died): the hold ends at retry_in_s."""
    d, others, clock = make(seats=1)
    others.held["r:r0"] = 1
    others.retry_in_s = 0.05
    ticket = enqueue(d, clock, "b")
    waiter = asyncio.create_task(d.wait(ticket))
    await wait_for(lambda: d.pool.replicas[0].shared_full)
    others.held["r:r0"] = 0  # its lease expired unrenewed
    seat = await asyncio.wait_for(waiter, 5)
    assert seat.lease == "r:r0"
    d.finish(ticket, seat)


async def test_a_requeued_ticket_is_refunded_its_scheduling_charge() -> None:
    """A popped ticket sent back is not charged twice: b's tag moves by one cost, not two."""
    d, others, clock = make(seats=1)
    first = enqueue(d, clock, "a")
    first_seat = await d.wait(first)
    queued = enqueue(d, clock, "b")
    waiter = asyncio.create_task(d.wait(queued))
    others.held["r:r0"] = 2  # first's seat + one elsewhere: the next take is refused
    flow = d.scheduler.default._flows[("b", "standard")]  # type: ignore[attr-defined]
    d.finish(first, first_seat)  # pops b (charge), refused, back in the queue (refund)
    await wait_for(lambda: d.pool.replicas[0].shared_full)
    assert flow.finish == pytest.approx(0.0)
    others.held["r:r0"] = 0
    d.freed(None, None)
    seat = await waiter
    assert flow.finish == pytest.approx(10.0)
    d.finish(queued, seat)


async def test_reject_undoes_the_local_grant() -> None:
    """The shared state refuses outright (reject mode): the error reaches the caller and
    nothing stays counted locally."""
    d, others, clock = make(seats=2)
    others.down = True
    ticket = enqueue(d, clock, "b")
    with pytest.raises(StateUnavailable):
        await d.wait(ticket)
    assert d.pool.total_inflight() == 0 and d.inflight("b") == 0 and len(d.scheduler) == 0


async def test_the_knee_full_elsewhere_leaves_the_headroom_open() -> None:
    """Other instances hold every regular seat of r0 (2 of 2 + 2 headroom): the flooding
    tenant is refused there and requeued, yet a tenant below its fair share still starts
    at once on a headroom seat, taken against the knee plus the headroom; once those are
    all taken too, the headroom is held off as well until a release is heard."""
    d, others, clock = make_headroom("a", "b", "c")
    others.held["r:r0"] = 2
    flood = enqueue(d, clock, "a")
    flood_waiter = asyncio.create_task(d.wait(flood))
    replica = d.pool.replicas[0]
    await wait_for(lambda: replica.shared_full)
    assert d.scheduler.depth("a") == 1 and not flood_waiter.done()
    clock.advance(0.5)
    light = enqueue(d, clock, "b")
    assert light.seat is not None and light.seat.headroom, "b must not queue behind a"
    seat = await d.wait(light)
    assert seat.lease == "r:r0" and others.held["r:r0"] == 3 and d.headroom_grants == 1
    others.held["r:r0"] = 4  # the headroom is taken elsewhere too
    late = enqueue(d, clock, "c")
    late_waiter = asyncio.create_task(d.wait(late))
    await wait_for(lambda: replica.shared_headroom_full)
    assert d.scheduler.depth("c") == 1 and not late_waiter.done()
    others.held["r:r0"] = 1  # only b's seat is left: the other instances gave theirs back
    d.freed("replica", "r0")
    assert not (replica.shared_full or replica.shared_headroom_full)
    for ticket, waiter in ((flood, flood_waiter), (late, late_waiter)):
        d.finish(ticket, await waiter)
    d.finish(light, seat)
    assert others.held["r:r0"] == 0 and d.pool.total_inflight() == 0


async def test_a_regular_seat_refused_elsewhere_turns_into_a_headroom_seat() -> None:
    """Nobody waits here and r0 looks free, but the other instances hold its whole knee:
    the regular seat granted locally is refused, and a tenant below its fair share then
    starts on a headroom seat at once, as it would have on one instance, rather than
    wait in the queue for the knee to free."""
    d, others, clock = make_headroom("a", "b")
    earlier = [enqueue(d, clock, "a") for _ in range(2)]  # a's recent work, here
    for ticket in earlier:
        d.finish(ticket, await d.wait(ticket))
    others.held["r:r0"] = 2  # the knee is full across the instances
    ticket = enqueue(d, clock, "b")
    assert ticket.seat is not None and not ticket.seat.headroom  # locally the knee is free
    seat = await asyncio.wait_for(d.wait(ticket), 5)
    assert seat.headroom and seat.lease == "r:r0" and others.held["r:r0"] == 3
    assert d.scheduler.depth("b") == 0 and d.headroom_grants == 1
    assert d.pool.replicas[0].shared_full and not d.pool.replicas[0].shared_headroom_full
    d.finish(ticket, seat)
    assert others.held["r:r0"] == 2 and d.pool.total_inflight() == 0


async def test_a_tenant_with_more_queued_stays_off_the_headroom_when_refused() -> None:
    """As on one instance, a tenant with tickets of its own queued never takes headroom,
    even below its fair share: its popped ticket, refused the knee elsewhere, requeues."""
    d, others, clock = make_headroom("a", "b")
    replica = d.pool.replicas[0]
    for _ in range(4):  # b's recent work: a is well below its share
        for ticket in [enqueue(d, clock, "b") for _ in range(2)]:
            d.finish(ticket, await d.wait(ticket))
    running = [enqueue(d, clock, "a") for _ in range(2)]
    seats = [await d.wait(ticket) for ticket in running]
    others.held["r:r0"] = 4  # a's two and two elsewhere: the headroom too is taken
    queued = [enqueue(d, clock, "a") for _ in range(2)]
    waiters = [asyncio.create_task(d.wait(ticket)) for ticket in queued]
    await wait_for(lambda: replica.shared_headroom_full)  # a's headroom tries were refused
    await wait_for(lambda: d.scheduler.depth("a") == 2)
    assert d.below_fair_share("a", "standard", clock.now())
    headroom_grants = d.headroom_grants
    d.finish(running[0], seats[0])  # pops a's next ticket: the knee is refused, it requeues
    await wait_for(lambda: replica.shared_full and not replica.shared_headroom_full)
    await wait_for(lambda: d.scheduler.depth("a") == 2)
    assert d.headroom_grants == headroom_grants and others.held["r:r0"] == 3
    assert not any(waiter.done() for waiter in waiters)
    others.held["r:r0"] = 1  # only a's running seat is left
    d.freed("replica", "r0")
    d.finish(running[1], seats[1])
    for ticket, waiter in zip(queued, waiters, strict=True):
        d.finish(ticket, await waiter)
    assert others.held["r:r0"] == 0 and d.pool.total_inflight() == 0


async def test_closing_answers_a_tenant_held_off_by_its_cap_elsewhere() -> None:
    """Tenant a (cap 1) holds its place on another instance and nothing here: its queued
    ticket is blocked in the scheduler. Shutting down answers it at once (503
    shutting_down), not at its queue budget's end."""
    d, others, clock = make(seats=2, cap=1)
    others.held["t:a"] = 1
    a = enqueue(d, clock, "a")
    waiter = asyncio.create_task(d.wait(a))
    await wait_for(lambda: "a" in d._shared_blocked)
    assert d.inflight("a") == 0 and not waiter.done()
    d.close()
    with pytest.raises(ShuttingDown):
        await asyncio.wait_for(waiter, 5)
    assert len(d.scheduler) == 0


async def test_a_turn_refused_does_not_turn_into_a_headroom_seat() -> None:
    """The same tenant below its fair share as above, but r0's knee has free seats that
    are another instance's tenant's turn: headroom is for a full knee, so b waits for its
    turn instead of jumping it on a headroom seat."""
    d, others, clock = make_headroom("a", "b")
    earlier = [enqueue(d, clock, "a") for _ in range(2)]
    for ticket in earlier:
        d.finish(ticket, await d.wait(ticket))
    others.turn_of_others = True
    ticket = enqueue(d, clock, "b")
    waiter = asyncio.create_task(d.wait(ticket))
    await wait_for(lambda: d.scheduler.depth("b") == 1)
    assert not waiter.done() and d.headroom_grants == 0 and d.pool.total_inflight() == 0
    others.turn_of_others = False  # the other tenant took its seat; b's turn now
    d.freed("replica", "r0")
    seat = await asyncio.wait_for(waiter, 5)
    assert not seat.headroom and seat.lease == "r:r0"
    d.finish(ticket, seat)
