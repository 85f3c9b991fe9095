"""A fair-turn refusal across instances, through the dispatcher, on a real redis-server.

Redis refuses a tenant a *free* seat when another tenant waiting there (on another
instance) has the earlier finish tag (``_ACQUIRE_FAIR``). That refusal concerns the
tenant refused, not the replica: the other tenants of this process whose turn it is
must still get the seat. The scripts run on a fake clock (waiting entries and leases
expire only when a test moves it), and ``WAITING_MS`` is a minute unless a test says
otherwise, so a refusal's retry timer (half of it) cannot be what hands a seat out:
each grant is made by the pass the test triggers.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest

from proxy.admitted import Deadline
from proxy.clock import FakeClock
from proxy.dispatch import Dispatcher
from proxy.models import ModelTable
from proxy.replicas import Seat
from proxy.scheduler import Ticket
from proxy.settings import BudgetsConfig
from proxy.state import places as places_module
from proxy.state.leases import Full, Lease, LeaseStore, Share
from tests.helpers import wait_for
from tests.redis_server import RedisServer
from tests.two_instances import KEYS, two_instances

pytestmark = pytest.mark.redis

BUDGETS = BudgetsConfig(queue_ms=60_000, first_byte_ms=1000, total_ms=120_000)
#: Long enough that no retry timer fires within a test (the refusal asks back in half).
WAITING_MS = 60_000
LEASE_MS = 60_000


@dataclass
class Setup:
    """This process's dispatcher on Redis, and another instance's store on the same Redis."""

    d: Dispatcher
    clock: FakeClock
    here: LeaseStore
    other: LeaseStore
    waiting_ms: int

    def enqueue(self, tenant: str) -> Ticket:
        return self.d.enqueue(tenant, "standard", 10.0, Deadline.start(self.clock.now(), BUDGETS))

    def count_asks(self, monkeypatch: pytest.MonkeyPatch) -> list[str]:
        """The seat keys this process asks Redis for from now on, in order."""
        asked: list[str] = []
        acquire, here = LeaseStore.acquire, self.here

        async def counted(store: LeaseStore, key: str, *args: object, **kwargs: object) -> object:
            if store is here:
                asked.append(key)
            return await acquire(store, key, *args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(LeaseStore, "acquire", counted)
        return asked

    async def elsewhere(self, tenant: str, replica: str, seats: int, weight: float = 1.0) -> object:
        """The other instance asks for a seat of ``replica`` for ``tenant``."""
        share = Share(tenant, weight, KEYS.waiting(replica), KEYS.waiting_weights(replica),
                      self.waiting_ms)  # fmt: skip
        channel = KEYS.freed_channel(f"r:{replica}")
        return await self.other.acquire(KEYS.seats(replica), seats, channel, share)


@pytest.fixture
async def setup(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> AsyncIterator[Setup]:
    replicas: dict[str, int] = request.param
    waiting_ms = replicas.pop("waiting_ms", WAITING_MS)
    monkeypatch.setattr(places_module, "WAITING_MS", waiting_ms)
    async with two_instances(
        redis_server.url, replicas, start=7_000_000.0, lease_ms=LEASE_MS
    ) as two:
        yield Setup(two.d, two.clock, two.here, two.other, waiting_ms)


async def _leave(ticket: Ticket, waiter: asyncio.Task[Seat]) -> None:
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter


@pytest.mark.parametrize("setup", [{"r0": 4}], indirect=True)
async def test_a_turn_refused_to_one_tenant_leaves_the_seat_to_the_others(setup: Setup) -> None:
    """r0 has 4 seats: a holds 1 here, another instance's x holds 1 and its c (refused when
    r0 was full) waits; 2 are free. a's second request is refused (its tag 2 against c's 1),
    yet b, queued here after it, takes one free seat at once (tag 1, a tie with c goes to the
    asker) and c the other: none stays idle. A release heard later gives a its turn."""
    d, seats = setup.d, KEYS.seats("r0")
    first = setup.enqueue("a")
    first_seat = await d.wait(first)
    x = [await setup.elsewhere("x", "r0", 4) for _ in range(3)]
    assert all(isinstance(lease, Lease) for lease in x)
    full = await setup.elsewhere("c", "r0", 4)
    assert isinstance(full, Full) and not full.turn  # r0 full: c waits
    for lease in x[:2]:
        assert isinstance(lease, Lease) and await setup.other.release(lease)
    assert await setup.here.held(seats) == 2
    second = setup.enqueue("a")
    assert second.seat is not None  # granted here; Redis refuses it its turn
    a_waiter = asyncio.create_task(d.wait(second))
    await wait_for(lambda: second.seat is None and d.scheduler.depth("a") == 1)
    b = setup.enqueue("b")
    assert b.seat is not None, "b must not wait for a's turn: r0 has free seats"
    b_seat = await d.wait(b)
    assert b_seat.lease is not None and await setup.here.held(seats) == 3
    assert isinstance(await setup.elsewhere("c", "r0", 4), Lease)  # c's turn: the last seat
    assert await setup.here.held(seats) == 4 and not a_waiter.done()
    x_left = x[2]
    assert isinstance(x_left, Lease) and await setup.other.release(x_left)
    d.freed("replica", "r0")  # the release's pub/sub, as the listener hears it
    second_seat = await asyncio.wait_for(a_waiter, 10)
    assert second_seat.lease is not None and await setup.here.held(seats) == 4
    for ticket, seat in ((second, second_seat), (b, b_seat), (first, first_seat)):
        d.finish(ticket, seat)
    assert d.pool.total_inflight() == 0 and d.total_inflight() == 0


@pytest.mark.parametrize("setup", [{"r0": 2, "r1": 2}], indirect=True)
async def test_a_turn_refused_on_one_replica_takes_a_free_seat_on_another(setup: Setup) -> None:
    """c (weight 2, another instance) waits on r0, where 1 of 2 seats is free; b holds 1 of
    r1's 2 here, so r0 is the least loaded. a's request, granted r0 here, is refused its turn
    there and goes to r1's free seat at once (nobody waits on r1), not back to r0."""
    d = setup.d
    x = [await setup.elsewhere("x", "r0", 2) for _ in range(2)]
    assert isinstance(await setup.elsewhere("c", "r0", 2, weight=2.0), Full)
    x_first = x[0]
    assert isinstance(x_first, Lease) and await setup.other.release(x_first)
    r0 = d.pool.get("r0")
    assert r0 is not None
    r0.saturated = True  # b's seat goes to r1
    b = setup.enqueue("b")
    b_seat = await d.wait(b)
    assert b_seat.replica.name == "r1"
    r0.saturated = False
    a = setup.enqueue("a")
    assert a.seat is not None and a.seat.replica.name == "r0"
    a_seat = await asyncio.wait_for(d.wait(a), 10)
    assert a_seat.replica.name == "r1" and a_seat.lease is not None
    assert await setup.here.held(KEYS.seats("r1")) == 2
    assert await setup.here.held(KEYS.seats("r0")) == 1  # x's; the free one is c's
    d.finish(a, a_seat)
    d.finish(b, b_seat)


@pytest.mark.parametrize("setup", [{"r0": 2, "waiting_ms": 100}], indirect=True)
async def test_a_turn_refused_is_asked_again_at_its_retry_time(setup: Setup) -> None:
    """Waiting entries last 100 ms here. a is refused its turn on r0 (c waits elsewhere) and
    no release is ever heard; c stops asking (its entry expires): a asks again at the
    refusal's retry time (50 ms) and takes the seat, with nobody to wake it."""
    d = setup.d
    first = setup.enqueue("a")
    first_seat = await d.wait(first)
    other = await setup.elsewhere("x", "r0", 2)
    assert isinstance(await setup.elsewhere("c", "r0", 2), Full)
    assert isinstance(other, Lease) and await setup.other.release(other)
    second = setup.enqueue("a")
    a_waiter = asyncio.create_task(d.wait(second))
    await wait_for(lambda: second.seat is None and d.scheduler.depth("a") == 1)
    setup.clock.advance(0.2)  # c's waiting entry (100 ms) expires unrenewed
    second_seat = await asyncio.wait_for(a_waiter, 10)
    assert second_seat.lease is not None and await setup.here.held(KEYS.seats("r0")) == 2
    d.finish(second, second_seat)
    d.finish(first, first_seat)


@pytest.mark.parametrize("setup", [{"r0": 2, "r1": 1, "r2": 2}], indirect=True)
async def test_a_release_that_cannot_seat_a_held_tenant_costs_no_redis_call(
    setup: Setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    """a is refused its turn on r0 (c, weight 2, waits there elsewhere) while r1's one seat
    is b's here: a is held. Another instance then takes and gives back seats of r2, which
    this process does not use (its engine says saturated here): each release is heard, yet
    none can seat a, so none may send a back to Redis for r0 (each did: unblocked, a took
    r0's free seat again, the one it avoids, and was refused again: one round trip per held
    tenant per release anywhere in the fleet). b's seat of r1 given back here seats a at once."""
    d = setup.d
    asked = setup.count_asks(monkeypatch)
    r0, r2 = d.pool.get("r0"), d.pool.get("r2")
    assert r0 is not None and r2 is not None
    r2.saturated = True
    r0.saturated = True  # b's seat goes to r1
    b = setup.enqueue("b")
    b_seat = await d.wait(b)
    assert b_seat.replica.name == "r1"
    r0.saturated = False
    asked.clear()
    x = [await setup.elsewhere("x", "r0", 2) for _ in range(2)]
    assert isinstance(await setup.elsewhere("c", "r0", 2, weight=2.0), Full)
    x_first = x[0]
    assert isinstance(x_first, Lease) and await setup.other.release(x_first)
    a = setup.enqueue("a")
    a_waiter = asyncio.create_task(d.wait(a))
    await wait_for(lambda: a.seat is None and d.scheduler.depth("a") == 1)
    assert asked == [KEYS.seats("r0")]  # refused its turn once; held (r1 is b's)
    for _ in range(5):
        lease = await setup.elsewhere("y", "r2", 2)
        assert isinstance(lease, Lease) and await setup.other.release(lease)
        d.freed("replica", "r2")  # the release's pub/sub, as the listener hears it
        assert a.seat is None, "a release of r2 handed a the seat of r0 it avoids"
        for _ in range(20):  # a round trip started anyway would be under way by now
            await asyncio.sleep(0)
    assert asked == [KEYS.seats("r0")], "a release of r2 sent a back to Redis for r0"
    assert not a_waiter.done() and d.scheduler.depth("a") == 1
    d.finish(b, b_seat)  # r1's seat back here: a takes it at once, not at its retry time
    a_seat = await asyncio.wait_for(a_waiter, 10)
    assert a_seat.replica.name == "r1" and a_seat.lease is not None
    assert asked == [KEYS.seats("r0"), KEYS.seats("r1")]
    d.finish(a, a_seat)


@pytest.mark.parametrize("setup", [{"r0": 2, "r1": 2}], indirect=True)
async def test_a_tenant_avoiding_a_replica_found_full_elsewhere_is_held_not_sent_back(
    setup: Setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    """a is refused its turn on r0 (c, weight 2, waits there elsewhere); r1 has a seat free
    here, but another instance holds it: Redis finds r1 full. a then has no seat left but
    the one of r0 it avoids, so it is held: it was sent back to r0 at once and refused
    again, a round trip that could not succeed (and one more for every r1 release heard
    while r1 stays full). A seat of r1 given back here seats it."""
    d = setup.d
    asked = setup.count_asks(monkeypatch)
    r0 = d.pool.get("r0")
    assert r0 is not None
    r0.saturated = True  # b's seat goes to r1
    b = setup.enqueue("b")
    b_seat = await d.wait(b)
    assert b_seat.replica.name == "r1"
    r0.saturated = False
    assert isinstance(await setup.elsewhere("y", "r1", 2), Lease)  # r1 full across instances
    x = [await setup.elsewhere("x", "r0", 2) for _ in range(2)]
    assert isinstance(await setup.elsewhere("c", "r0", 2, weight=2.0), Full)
    x_first = x[0]
    assert isinstance(x_first, Lease) and await setup.other.release(x_first)
    asked.clear()
    a = setup.enqueue("a")
    assert a.seat is not None and a.seat.replica.name == "r0"
    a_waiter = asyncio.create_task(d.wait(a))
    await wait_for(lambda: len(asked) >= 2 and a.seat is None and d.scheduler.depth("a") == 1)
    for _ in range(20):  # a round trip started anyway would be under way by now
        await asyncio.sleep(0)
    assert asked == [KEYS.seats("r0"), KEYS.seats("r1")], "sent back to the r0 it avoids"
    assert not a_waiter.done()
    d.finish(b, b_seat)  # r1's seat back here
    a_seat = await asyncio.wait_for(a_waiter, 10)
    assert a_seat.replica.name == "r1" and a_seat.lease is not None
    d.finish(a, a_seat)


@pytest.mark.parametrize("setup", [{"r0": 3, "r1": 3}], indirect=True)
async def test_a_hold_lifted_on_one_replica_stays_while_only_the_other_is_free(
    setup: Setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    """c (weight 2, another instance) waits on r0 and r1, each with 2 of 3 seats free: a is
    refused its turn on both and held. A release of r0 is heard while r0 takes no work here
    (its engine says saturated): a may ask r0 again, but r0 has no seat here and the one
    free seat it could be handed is r1's, which it still avoids: it stays held (it was
    unblocked and sent to r1, refused again). Once c took its seat of r1 and that release
    is heard, a takes r1."""
    d = setup.d
    asked = setup.count_asks(monkeypatch)
    for name in ("r0", "r1"):
        x = [await setup.elsewhere("x", name, 3) for _ in range(3)]
        assert isinstance(await setup.elsewhere("c", name, 3, weight=2.0), Full)
        for lease in x[:2]:
            assert isinstance(lease, Lease) and await setup.other.release(lease)
    a = setup.enqueue("a")
    a_waiter = asyncio.create_task(d.wait(a))
    await wait_for(lambda: len(asked) == 2 and a.seat is None and "a" in d._turn_blocked)
    assert set(asked) == {KEYS.seats("r0"), KEYS.seats("r1")}
    r0 = d.pool.get("r0")
    assert r0 is not None
    r0.saturated = True
    d.freed("replica", "r0")
    assert a.seat is None, "a was handed r1's seat, which refused it its turn"
    for _ in range(20):  # a round trip started anyway would be under way by now
        await asyncio.sleep(0)
    assert len(asked) == 2 and not a_waiter.done()
    assert isinstance(await setup.elsewhere("c", "r1", 3, weight=2.0), Lease)  # c's turn
    d.freed("replica", "r1")
    a_seat = await asyncio.wait_for(a_waiter, 10)
    assert a_seat.replica.name == "r1" and asked[2:] == [KEYS.seats("r1")]
    d.finish(a, a_seat)


@pytest.mark.parametrize("setup", [{"r0": 2, "r1": 1}], indirect=True)
async def test_a_request_of_a_held_tenant_ending_keeps_it_held_until_its_seat_is_back(
    setup: Setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    """a's first request holds r1's one seat; its second is refused its turn on r0 (c,
    weight 2, waits there elsewhere): a is held. The first one's client leaves: its tenant
    place is free at once, its seat only after the engine's grace. Until then the one free
    seat is r0's, which a avoids: a stays held (it was let go by its place coming back and
    sent to r0, refused again). The seat back after the grace seats a on r1."""
    d = setup.d
    asked = setup.count_asks(monkeypatch)
    r0 = d.pool.get("r0")
    assert r0 is not None
    r0.saturated = True  # the first request goes to r1
    first = setup.enqueue("a")
    first_seat = await d.wait(first)
    assert first_seat.replica.name == "r1"
    r0.saturated = False
    x = [await setup.elsewhere("x", "r0", 2) for _ in range(2)]
    assert isinstance(await setup.elsewhere("c", "r0", 2, weight=2.0), Full)
    x_first = x[0]
    assert isinstance(x_first, Lease) and await setup.other.release(x_first)
    asked.clear()
    second = setup.enqueue("a")
    a_waiter = asyncio.create_task(d.wait(second))
    await wait_for(lambda: second.seat is None and "a" in d._turn_blocked)
    assert asked == [KEYS.seats("r0")]
    d.finish(first, first_seat, seat_grace_s=0.05)
    assert second.seat is None, "a was handed r0's seat, which refused it its turn"
    second_seat = await asyncio.wait_for(a_waiter, 10)
    assert second_seat.replica.name == "r1" and asked == [KEYS.seats("r0"), KEYS.seats("r1")]
    d.finish(second, second_seat)


@pytest.mark.parametrize("setup", [{"r0": 2, "r1": 1}], indirect=True)
async def test_a_tenant_held_in_one_model_pool_takes_a_seat_freed_in_another(
    setup: Setup,
) -> None:
    """r0 serves model m, r1 model n. a is refused its turn on r0 (c, weight 2, waits there
    elsewhere) and held: the block is tenant-wide, so its ticket for n, queued behind its
    own request on r1, is held too. That request ending frees r1's seat: a goes back in
    the scheduler for it at once (a release that cannot seat a leaves it held; this one
    can, in a pool where it waits), not at its retry time."""
    d = setup.d
    d.seats.models = ModelTable({"r0": ("m",), "r1": ("n",)}, {})

    def enqueue(model: str) -> Ticket:
        deadline = Deadline.start(setup.clock.now(), BUDGETS)
        return d.enqueue_in(model, "a", "standard", 10.0, deadline)

    first_n = enqueue("n")
    first_n_seat = await d.wait(first_n)
    x = [await setup.elsewhere("x", "r0", 2) for _ in range(2)]
    assert isinstance(await setup.elsewhere("c", "r0", 2, weight=2.0), Full)
    x_first = x[0]
    assert isinstance(x_first, Lease) and await setup.other.release(x_first)
    on_m = enqueue("m")
    m_waiter = asyncio.create_task(d.wait(on_m))
    await wait_for(lambda: on_m.seat is None and "a" in d._turn_blocked)
    on_n = enqueue("n")
    n_waiter = asyncio.create_task(d.wait(on_n))
    assert on_n.seat is None
    d.finish(first_n, first_n_seat)
    n_seat = await asyncio.wait_for(n_waiter, 10)
    assert n_seat.replica.name == "r1" and n_seat.lease is not None
    d.finish(on_n, n_seat)
    await _leave(on_m, m_waiter)


@pytest.mark.parametrize("setup", [{"r0": 2, "r1": 4}], indirect=True)
async def test_a_headroom_seat_is_not_taken_where_the_tenant_was_refused_its_turn(
    setup: Setup,
) -> None:
    """r0 (2 seats, 2 of headroom): x holds 1 elsewhere, c (weight 2) waits there for the
    free one. r1 (4 seats): b holds 1 here, y 3 elsewhere, so it is full. a is refused its
    turn on r0, goes to r1, finds it full, and, below its fair share, takes a headroom seat
    instead: not on r0, whose knee has a free seat that is c's turn (the headroom seat is
    taken outside the turn and filled the knee: c would then find r0 full)."""
    d = setup.d
    r0 = d.pool.get("r0")
    assert r0 is not None
    r0.headroom = 2
    r0.saturated = True  # b's seat goes to r1
    b = setup.enqueue("b")
    b_seat = await d.wait(b)
    assert b_seat.replica.name == "r1"
    r0.saturated = False
    y = [await setup.elsewhere("y", "r1", 4) for _ in range(3)]
    assert all(isinstance(lease, Lease) for lease in y)
    x = [await setup.elsewhere("x", "r0", 2) for _ in range(2)]
    assert isinstance(await setup.elsewhere("c", "r0", 2, weight=2.0), Full)
    x_first = x[0]
    assert isinstance(x_first, Lease) and await setup.other.release(x_first)
    a = setup.enqueue("a")
    assert a.seat is not None and a.seat.replica.name == "r0"  # the least loaded
    a_waiter = asyncio.create_task(d.wait(a))
    await wait_for(lambda: a_waiter.done() or (a.seat is None and d.scheduler.depth("a") == 1))
    assert await setup.here.held(KEYS.seats("r0")) == 1, "a took a headroom seat of r0"
    assert isinstance(await setup.elsewhere("c", "r0", 2, weight=2.0), Lease)  # c's turn
    if a_waiter.done():
        d.finish(a, a_waiter.result())
    else:
        await _leave(a, a_waiter)
    d.finish(b, b_seat)
