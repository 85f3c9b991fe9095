"""Predicted waits of one instance among several sharing a replica's seats, on a fake
clock: a fake ``SharedPlaces`` stands for the other instances and answers, as Redis
does, how they hold the seats (``Elsewhere``). No sockets, no Redis."""

from __future__ import annotations

import asyncio
from collections.abc import Collection, Iterable

import pytest

from proxy.admitted import Deadline
from proxy.clock import FakeClock
from proxy.dispatch import Dispatcher, TenantLimits
from proxy.errors import PredictedWaitExceedsBudget, ShuttingDown
from proxy.places import Blocked, Elsewhere, Held
from proxy.replicas import Replica, ReplicaPool
from proxy.scheduler import FairScheduler, Ticket
from proxy.settings import BudgetsConfig, ReplicaConfig

BUDGETS = BudgetsConfig(queue_ms=1050, first_byte_ms=1000, total_ms=5000)
SEATS = 4
SEAT_S = 0.1


class Peers:
    """The other instances: ``held`` seats of r0, ``backlogged`` or not; ours add to them."""

    def __init__(self) -> None:
        self.held = 0
        self.backlogged = False
        self.ours = 0
        #: What each take of this instance said of its backlog (``backlog_s``).
        self.said: list[float] = []

    def _elsewhere(self) -> Elsewhere:
        waiting = self.backlogged and self.held > 0
        return Elsewhere(self.held, self.held if waiting else 0, int(waiting))

    async def take(
        self, tenant: str, cap: int | None, replica: str, seats: int, weight: float = 1.0,
        *, headroom: bool = False, backlog_s: float = 0.0,
    ) -> Held | Blocked:  # fmt: skip
        self.said.append(backlog_s)
        if self.held + self.ours >= seats:
            return Blocked("replica", replica, 60.0, elsewhere=self._elsewhere())
        self.ours += 1
        return Held(None, "seat", self._elsewhere())

    async def take_seat(self, replica: str, seats: int) -> Held | Blocked:
        return await self.take("", None, replica, seats)

    def give_back(self, handle: object) -> None:
        self.ours -= 1

    def waiting_at(self, tenant: str) -> Collection[str]:
        return ()  # no waiting entries here: what others hold is all these tests read

    def stop_waiting(self, tenant: str, replicas: Iterable[str]) -> None:
        raise AssertionError("no waiting entry was reported, none is withdrawn")


def make(*, shared: bool = True) -> tuple[Dispatcher, Peers, FakeClock]:
    clock = FakeClock()
    replica = Replica(ReplicaConfig(name="r0", url="http://127.0.0.1:1", max_concurrency=SEATS))
    limits = {"a": TenantLimits(max_concurrency=None, queue_capacity=100)}
    d = Dispatcher(ReplicaPool([replica]), FairScheduler({"standard": 1.0}), clock, limits)
    peers = Peers()
    if shared:
        d.shared = peers
    return d, peers, clock


def enqueue(d: Dispatcher, clock: FakeClock) -> Ticket:
    return d.enqueue("a", "standard", 10.0, Deadline.start(clock.now(), BUDGETS))


async def warm(d: Dispatcher, clock: FakeClock) -> None:
    """25 requests one after another, 0.1 s each (alone on the seats); then a quiet while."""
    for _ in range(25):
        ticket = enqueue(d, clock)
        seat = await d.wait(ticket)
        clock.advance(SEAT_S)
        d.finish(ticket, seat)
    clock.advance(30.0)


async def burst(
    d: Dispatcher, clock: FakeClock
) -> tuple[list[Ticket], list[asyncio.Future[object]], float]:
    """A burst of a, its seats asked for in the shared state as they are granted here: the
    granted ones run, the others queue until one is refused on its predicted wait.
    Returns the running tickets, the queued ones' waiters, and the refusal's Retry-After."""
    tickets: dict[Ticket, asyncio.Future[object]] = {}
    for _ in range(200):
        try:
            ticket = enqueue(d, clock)
        except PredictedWaitExceedsBudget as refusal:
            retry_after = refusal.retry_after_s
            break
        tickets[ticket] = asyncio.ensure_future(d.wait(ticket))
        await asyncio.sleep(0)  # its shared seat asked for (refused: back in the queue)
    else:
        raise AssertionError("nothing refused")
    running = [t for t, waiter in tickets.items() if waiter.done()]
    assert retry_after is not None  # every refusal says when to come back
    return running, [w for w in tickets.values() if not w.done()], retry_after


async def end(d: Dispatcher, running: list[Ticket], queued: list[asyncio.Future[object]]) -> None:
    d.close()
    for ticket in running:
        d.finish(ticket, ticket.seat)
    for waiter in queued:
        with pytest.raises(ShuttingDown):
            await waiter


async def test_backlogged_peers_holding_half_the_seats_halve_this_instances_rate() -> None:
    """4 seats of 0.1 s; another instance, backlogged there too, holds 2 of them. A burst
    here gets the other 2 (a third is refused in Redis and queues): this queue drains 2
    per 0.1 s, so the 20th queued starts at 1.0 s and the 21st (1.07 s) is refused over
    the 1.05 s budget. Counting the whole pool's seats as its own admitted 42, half of
    which would time out. Retry-After of a 429: 1 over this instance's part of the rate."""
    d, peers, clock = make()
    await warm(d, clock)
    peers.held, peers.backlogged = 2, True
    running, queued, retry_after = await burst(d, clock)
    assert len(running) == 2 and d.pool.replicas[0].shared_full
    assert len(queued) == 20
    assert retry_after == pytest.approx(SEAT_S * 10 + SEAT_S * 2 / 3)  # its seat's turn
    assert d.predict_wait("a", "standard", clock.now()) == pytest.approx(retry_after)
    assert d.waits.time_to_free_place("a", "standard", clock.now()) == pytest.approx(SEAT_S / 2)
    await end(d, running, queued)


async def test_a_lone_instance_with_idle_peers_predicts_as_one_process() -> None:
    """Peers that hold no seat change nothing: the same burst is predicted, admitted and
    refused exactly as by a proxy with no shared state."""
    answers = []
    for shared in (True, False):
        d, _, clock = make(shared=shared)
        await warm(d, clock)
        running, queued, retry_after = await burst(d, clock)
        answers.append(
            (
                len(running),
                len(queued),
                retry_after,
                d.predict_wait("a", "standard", clock.now()),
                d.waits.time_to_free_place("a", "standard", clock.now()),
            )
        )
        await end(d, running, queued)
    assert answers[0] == answers[1]
    assert answers[0][:2] == (SEATS, 40)


async def test_peers_holding_seats_with_no_queue_only_delay_the_first_seats() -> None:
    """Two seats held by peers with nothing queued: they free within a seat time and are
    this instance's after that. The rate stays the whole pool's (Retry-After of a 429 as
    alone); only the first releases come later than if the seats were free."""
    d, peers, clock = make()
    await warm(d, clock)
    peers.held = 2
    running, queued, retry_after = await burst(d, clock)
    assert len(running) == 2
    assert d.waits.time_to_free_place("a", "standard", clock.now()) == pytest.approx(SEAT_S / SEATS)
    # the 42nd release of the pool: 2 peers' seats free at 1/3 and 2/3 of a seat time,
    # then every seat each 0.1 s: the 42nd is the second of the eleventh round
    assert retry_after == pytest.approx(SEAT_S * 10 + SEAT_S * 2 / 3)
    assert len(queued) == 41
    await end(d, running, queued)


async def test_a_seat_call_says_how_long_this_instance_counts_as_backlogged() -> None:
    """The others' waits learn of this instance's backlog from its seat calls: a ticket
    granted with nobody queued says none (its refusal there says it waits); granted
    again from the queue, it says two mean seat times (a saturated instance calls again
    only when one of its own seats frees)."""
    d, peers, clock = make()
    await warm(d, clock)
    assert set(peers.said) == {0.0}
    peers.held = SEATS - 1
    first = enqueue(d, clock)
    seat = await d.wait(first)
    queued = enqueue(d, clock)
    waiter = asyncio.ensure_future(d.wait(queued))
    await asyncio.sleep(0)  # granted here, refused in Redis: back in the queue
    assert peers.said[-2:] == [0.0, 0.0] and len(d.scheduler) == 1
    clock.advance(SEAT_S)
    d.finish(first, seat)
    await asyncio.sleep(0)
    assert peers.said[-1] == pytest.approx(2 * SEAT_S)
    d.finish(queued, await waiter)
