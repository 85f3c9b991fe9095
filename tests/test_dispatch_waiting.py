"""Shared seats and the fleet as it is after the seat's Redis call, on a real redis-server.

A tenant refused a replica seat is recorded as waiting there (``_ACQUIRE_FAIR``): its entry
holds the other instances' tenants to their fair turns. It must go as soon as the tenant
waits there no more (served elsewhere, its client gone), not at its expiry. And a seat
granted by Redis for a replica that left the ticket's pool during the call must not be
used. The scripts run on a fake clock and entries last a minute (``WAITING_MS``), so
nothing here expires by itself: every change is the one the test makes.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import pytest
from redis.asyncio import Redis

from proxy.admitted import Deadline
from proxy.clock import FakeClock
from proxy.dispatch import Dispatcher
from proxy.errors import ModelNotFound, QueueTimeout
from proxy.models import ModelTable
from proxy.replicas import Replica, Seat
from proxy.scheduler import Ticket
from proxy.settings import BudgetsConfig
from proxy.state import places as places_module
from proxy.state.leases import Full, Lease, LeaseStore, Share
from proxy.state.places import RedisPlaces
from tests.helpers import wait_for
from tests.redis_server import RedisServer
from tests.two_instances import KEYS, two_instances

pytestmark = pytest.mark.redis

BUDGETS = BudgetsConfig(queue_ms=60_000, first_byte_ms=1000, total_ms=120_000)
#: Nothing expires within a test: entries and leases go only when the test says so.
WAITING_MS = 60_000
LEASE_MS = 60_000
#: Generous bound of every wait on a condition (2 loaded cores).
BOUND_S = 10.0


@dataclass
class Setup:
    """This process (``p1``): a dispatcher on Redis with its release loop; another
    instance (``p2``): a bare store on the same Redis."""

    d: Dispatcher
    places: RedisPlaces
    clock: FakeClock
    here: LeaseStore
    other: LeaseStore
    redis: Redis

    def enqueue(self, tenant: str, model: str | None = None) -> Ticket:
        deadline = Deadline.start(self.clock.now(), BUDGETS)
        return self.d.enqueue_in(model, tenant, "standard", 10.0, deadline)

    def replica(self, name: str) -> Replica:
        replica = self.d.pool.get(name)
        assert replica is not None
        return replica

    async def elsewhere(self, tenant: str, replica: str, seats: int) -> Lease | Full:
        """The other instance asks for a seat of ``replica`` for ``tenant``."""
        share = Share(tenant, 1.0, KEYS.waiting(replica), KEYS.waiting_weights(replica),
                      WAITING_MS)  # fmt: skip
        channel = KEYS.freed_channel(f"r:{replica}")
        return await self.other.acquire(KEYS.seats(replica), seats, channel, share)

    async def waiting(self, replica: str) -> set[str]:
        """The waiting entries at ``replica`` now (``<tenant>|<owner>``)."""
        return {str(entry) for entry in await self.redis.zrange(KEYS.waiting(replica), 0, -1)}

    async def until(self, check: Callable[[], Awaitable[bool]]) -> None:
        """Poll Redis until ``check`` holds (bounded)."""
        async with asyncio.timeout(BOUND_S):
            while not await check():
                await asyncio.sleep(0.005)


@pytest.fixture
async def setup(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> AsyncIterator[Setup]:
    replicas: dict[str, int] = request.param
    monkeypatch.setattr(places_module, "WAITING_MS", WAITING_MS)
    async with two_instances(
        redis_server.url, replicas, start=9_000_000.0, lease_ms=LEASE_MS
    ) as two:
        releases = asyncio.create_task(two.places.run())
        redis = Redis.from_url(redis_server.url, decode_responses=True)
        try:
            yield Setup(two.d, two.places, two.clock, two.here, two.other, redis)
        finally:
            releases.cancel()
            with pytest.raises(asyncio.CancelledError):
                await releases
            await redis.aclose()


def _count_unwaits(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """(waiting key, tenant) of every removal this test's stores send, in order."""
    sent: list[tuple[str, str]] = []
    unwait = LeaseStore.unwait

    async def counted(store: LeaseStore, seats: str, waiting: str, tenant: str,
                      limit: int, channel: str) -> int:  # fmt: skip
        sent.append((waiting, tenant))
        return await unwait(store, seats, waiting, tenant, limit, channel)

    monkeypatch.setattr(LeaseStore, "unwait", counted)
    return sent


@pytest.mark.parametrize("setup", [{"r0": 2, "r1": 1}], indirect=True)
async def test_a_tenant_served_elsewhere_stops_waiting_where_it_was_refused(
    setup: Setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another instance's x and b hold r0's 2 seats. a, here, is refused r0 (full): its
    entry says it waits there. a is then served on r1 and has nothing else queued: its
    entry goes at once. x gives its seat back and b, asking for it, gets it: b's second
    seat (tag 2) came after a's first (tag 1) while a's entry stayed, for its whole
    ``WAITING_MS``, although a no longer waited. The seat on r1 and a tenant never
    refused (a's next request) send no removal."""
    d, sent = setup.d, _count_unwaits(monkeypatch)
    x = await setup.elsewhere("x", "r0", 2)
    assert isinstance(x, Lease) and isinstance(await setup.elsewhere("b", "r0", 2), Lease)
    r1 = setup.replica("r1")
    r1.saturated = True  # a is granted r0 here, which Redis finds full
    a = setup.enqueue("a")
    assert a.seat is not None and a.seat.replica.name == "r0"
    a_waiter = asyncio.create_task(d.wait(a))
    await wait_for(lambda: a.seat is None and d.scheduler.depth("a") == 1)
    assert await setup.waiting("r0") == {"a|p1"}
    assert not sent, "a still waits: nothing removed"
    r1.saturated = False
    d.fleet_changed()
    a_seat = await asyncio.wait_for(a_waiter, BOUND_S)
    assert a_seat.replica.name == "r1" and a_seat.lease is not None
    await setup.until(lambda: _gone(setup, "r0", "a|p1"))
    assert await setup.other.release(x)
    assert isinstance(await setup.elsewhere("b", "r0", 2), Lease), "refused for a's old entry"
    d.finish(a, a_seat)
    again = setup.enqueue("a")  # r1's seat, never refused: no removal to send
    again_seat = await d.wait(again)
    assert again_seat.replica.name == "r1" and again_seat.lease is not None
    d.finish(again, again_seat)
    assert sent == [(KEYS.waiting("r0"), "a")]
    assert not setup.places.waiting_at("a")


async def _gone(setup: Setup, replica: str, entry: str) -> bool:
    return entry not in await setup.waiting(replica)


@pytest.mark.parametrize("setup", [{"r0": 2}], indirect=True)
async def test_a_tenant_whose_client_leaves_stops_waiting_and_the_others_hear_of_it(
    setup: Setup,
) -> None:
    """x and b (another instance) hold r0's 2 seats; a, here, is refused (full) and waits.
    x's seat is given back, and b's next ask is refused: its turn comes after a's. a's
    client leaves: its queue is empty, its entry goes, and r0's channel is told as for a
    release (a seat is free and b waits), so b's instance asks again now rather than at
    its retry time; b then gets the seat."""
    d = setup.d
    x = await setup.elsewhere("x", "r0", 2)
    assert isinstance(x, Lease) and isinstance(await setup.elsewhere("b", "r0", 2), Lease)
    a = setup.enqueue("a")
    a_waiter = asyncio.create_task(d.wait(a))
    await wait_for(lambda: a.seat is None and d.scheduler.depth("a") == 1)
    assert await setup.other.release(x)
    refused = await setup.elsewhere("b", "r0", 2)
    assert isinstance(refused, Full) and refused.turn  # a's turn
    assert await setup.waiting("r0") == {"a|p1", "b|p2"}
    listener = setup.redis.pubsub()
    await listener.subscribe(KEYS.freed_channel("r:r0"))
    try:
        a_waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await a_waiter
        heard = None
        async with asyncio.timeout(BOUND_S):
            while heard is None:
                heard = await listener.get_message(ignore_subscribe_messages=True, timeout=1.0)
        assert heard["channel"] == KEYS.freed_channel("r:r0")
    finally:
        await listener.aclose()  # type: ignore[no-untyped-call]
    assert await setup.waiting("r0") == {"b|p2"}
    assert isinstance(await setup.elsewhere("b", "r0", 2), Lease)
    assert d.total_inflight() == 0 and d.pool.total_inflight() == 0


@pytest.mark.parametrize("setup", [{"r0": 1, "r1": 1}], indirect=True)
async def test_a_tenant_served_elsewhere_with_more_queued_still_waits(setup: Setup) -> None:
    """x (another instance) holds r0's one seat; a's first request, here, is refused there
    and waits, its second queued behind it. r1 frees: the first is served there, but a
    still has a request queued for the pool: its entry at r0 stays (it still waits for a
    seat there; removing it would hand its turn to others). The second's client leaving
    empties a's queue: the entry goes."""
    d = setup.d
    assert isinstance(await setup.elsewhere("x", "r0", 1), Lease)
    r1 = setup.replica("r1")
    r1.saturated = True
    first = setup.enqueue("a")
    first_waiter = asyncio.create_task(d.wait(first))
    await wait_for(lambda: first.seat is None and d.scheduler.depth("a") == 1)
    second = setup.enqueue("a")
    second_waiter = asyncio.create_task(d.wait(second))
    assert second.seat is None and d.scheduler.depth("a") == 2
    r1.saturated = False
    d.fleet_changed()
    first_seat = await asyncio.wait_for(first_waiter, BOUND_S)
    assert first_seat.replica.name == "r1" and d.scheduler.depth("a") == 1
    assert setup.places.waiting_at("a") == ("r0",) and await setup.waiting("r0") == {"a|p1"}
    second_waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await second_waiter
    await setup.until(lambda: _gone(setup, "r0", "a|p1"))
    d.finish(first, first_seat)


@dataclass
class Gate:
    """This process's seat calls to Redis, held at the door until ``opened``."""

    entered: asyncio.Event
    opened: asyncio.Event


async def _queued_behind_gets_the_seat(
    setup: Setup,
    gate: Gate,
    waiter: asyncio.Task[Seat],
    refused: type[Exception],
    model: str | None = None,
) -> None:
    """b, queued while r0's seat waits on a held seat call, gets that seat at once when
    the call's ticket is refused ``refused`` (not after its own queue budget)."""
    b = setup.enqueue("b", model)
    assert b.seat is None, "r0's seat is the held call's until it returns"
    b_waiter = asyncio.create_task(setup.d.wait(b))
    gate.opened.set()
    with pytest.raises(refused):
        await asyncio.wait_for(waiter, BOUND_S)
    b_seat = await asyncio.wait_for(b_waiter, BOUND_S)
    assert b_seat.replica.name == "r0" and b_seat.lease is not None
    setup.d.finish(b, b_seat)


def _gate(setup: Setup, monkeypatch: pytest.MonkeyPatch) -> Gate:
    gate = Gate(asyncio.Event(), asyncio.Event())
    acquire, here = LeaseStore.acquire, setup.here

    async def held(store: LeaseStore, key: str, *args: object, **kwargs: object) -> object:
        if store is here:
            gate.entered.set()
            await gate.opened.wait()
        return await acquire(store, key, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(LeaseStore, "acquire", held)
    return gate


def _pools(setup: Setup, served: dict[str, frozenset[str]]) -> ModelTable:
    table = ModelTable(dict.fromkeys(served), {})
    for replica, models in served.items():
        table.update(replica, models)
    setup.d.seats.models = table
    return table


@pytest.mark.parametrize("setup", [{"r0": 1, "r1": 1}], indirect=True)
async def test_a_model_gone_during_the_seat_call_is_answered_404(
    setup: Setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    """a's request for m is granted r0 here and asks Redis for its seat; before the answer,
    r0 stops listing m (the last replica that did). Redis grants the seat, but the request
    must not go to r0 (its engine would answer 404, passed on as upstream_status): the seat
    goes back and the client gets the entrance's 404 model_not_found."""
    d, gate = setup.d, _gate(setup, monkeypatch)
    table = _pools(setup, {"r0": frozenset({"m"}), "r1": frozenset({"n"})})
    a = setup.enqueue("a", "m")
    assert a.seat is not None and a.seat.replica.name == "r0"
    waiter = asyncio.create_task(d.wait(a))
    await asyncio.wait_for(gate.entered.wait(), BOUND_S)
    table.update("r0", frozenset({"n"}))
    d.fleet_changed()
    gate.opened.set()
    with pytest.raises(ModelNotFound):
        await asyncio.wait_for(waiter, BOUND_S)
    assert d.pool.total_inflight() == 0 and d.total_inflight() == 0
    await setup.until(lambda: _held(setup, "r0", 0))


@pytest.mark.parametrize("setup", [{"r0": 1, "r1": 1}], indirect=True)
async def test_a_model_moved_during_the_seat_call_takes_a_seat_where_it_is_now(
    setup: Setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As above, but m moves to r1 during the call: the seat of r0 goes back and the
    request takes r1's."""
    d, gate = setup.d, _gate(setup, monkeypatch)
    table = _pools(setup, {"r0": frozenset({"m"}), "r1": frozenset({"n"})})
    a = setup.enqueue("a", "m")
    assert a.seat is not None and a.seat.replica.name == "r0"
    waiter = asyncio.create_task(d.wait(a))
    await asyncio.wait_for(gate.entered.wait(), BOUND_S)
    table.update("r0", frozenset({"n"}))
    table.update("r1", frozenset({"m", "n"}))
    d.fleet_changed()
    gate.opened.set()
    seat = await asyncio.wait_for(waiter, BOUND_S)
    assert seat.replica.name == "r1" and seat.lease is not None
    await setup.until(lambda: _held(setup, "r0", 0))
    assert await setup.here.held(KEYS.seats("r1")) == 1
    d.finish(a, seat)
    assert d.pool.total_inflight() == 0


@pytest.mark.parametrize("setup", [{"r0": 1, "r1": 1}], indirect=True)
async def test_a_replica_removed_during_a_retry_seat_call_is_not_used(
    setup: Setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A retry (no tenant) is given r0's seat and asks Redis for it; a reload removes r0
    meanwhile (retired: it leaves once its seats are back). The retry does not go there:
    the seat goes back and the retry takes r1's."""
    d, gate = setup.d, _gate(setup, monkeypatch)
    setup.replica("r1").saturated = True  # the retry is handed r0
    retry = asyncio.create_task(d.reseat(frozenset(), BOUND_S))
    await asyncio.wait_for(gate.entered.wait(), BOUND_S)
    d.pool.retire("r0")
    setup.replica("r1").saturated = False
    gate.opened.set()
    seat = await asyncio.wait_for(retry, BOUND_S)
    assert seat.replica.name == "r1" and seat.lease is not None
    assert d.pool.get("r0") is None  # its last seat back: gone from the fleet
    await setup.until(lambda: _held(setup, "r0", 0))
    d.release(seat)


async def _held(setup: Setup, replica: str, seats: int) -> bool:
    return await setup.here.held(KEYS.seats(replica)) == seats


@pytest.mark.parametrize("setup", [{"r0": 1}], indirect=True)
async def test_a_seat_given_back_for_a_model_gone_goes_to_the_next_queued_ticket(
    setup: Setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    """a's request for m holds r0's one seat here and asks Redis for it; meanwhile r0 stops
    serving m and serves n, and b's request for n queues behind that seat. a gets its 404;
    the seat it gave back must go to b at once (nothing else would hand it out: b waited
    out its whole queue budget with r0 idle)."""
    d, gate = setup.d, _gate(setup, monkeypatch)
    table = _pools(setup, {"r0": frozenset({"m"})})
    a = setup.enqueue("a", "m")
    assert a.seat is not None and a.seat.replica.name == "r0"
    waiter = asyncio.create_task(d.wait(a))
    await asyncio.wait_for(gate.entered.wait(), BOUND_S)
    table.update("r0", frozenset({"n"}))
    d.fleet_changed()
    await _queued_behind_gets_the_seat(setup, gate, waiter, ModelNotFound, "n")


@pytest.mark.parametrize("setup", [{"r0": 2}], indirect=True)
async def test_a_seat_given_back_for_a_turn_refused_at_expiry_goes_to_the_next_queued_ticket(
    setup: Setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    """x waits at r0 through the other instance; a holds one of r0's 2 seats here. a's
    second request takes the other seat and asks Redis for it: not a's turn (tag 2 above
    x's 1), and its queue budget ended during the call, so it gets its queue_timeout. b,
    queued meanwhile behind that seat, must get it at once (the refusal raised before
    the requeue's pump: b waited out its budget beside the free seat)."""
    d = setup.d
    for _ in range(2):
        assert isinstance(await setup.elsewhere("y", "r0", 2), Lease)
    assert isinstance(await setup.elsewhere("x", "r0", 2), Full)  # x waits at r0
    assert await setup.redis.delete(KEYS.seats("r0")) == 1  # y's seats back
    first = setup.enqueue("a")
    first_seat = await asyncio.wait_for(d.wait(first), BOUND_S)
    gate = _gate(setup, monkeypatch)
    short = BudgetsConfig(queue_ms=1000, first_byte_ms=1000, total_ms=120_000)
    second = d.enqueue_in(None, "a", "standard", 10.0, Deadline.start(setup.clock.now(), short))
    assert second.seat is not None and second.seat.replica.name == "r0"
    waiter = asyncio.create_task(d.wait(second))
    await asyncio.wait_for(gate.entered.wait(), BOUND_S)
    setup.clock.advance(2.0)  # its 1 s budget ends; nothing in Redis (a minute) expires
    await _queued_behind_gets_the_seat(setup, gate, waiter, QueueTimeout)
    d.finish(first, first_seat)
