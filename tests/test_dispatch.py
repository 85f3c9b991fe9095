"""The dispatcher and scheduler without sockets: a fake clock and plain objects."""

from __future__ import annotations

import asyncio
import random

import pytest

from bench.false_refusals import Arrival, Scenario
from bench.false_refusals_virtual import replay
from proxy.admitted import Deadline
from proxy.clock import FakeClock
from proxy.dispatch import Dispatcher, TenantLimits
from proxy.errors import (
    PredictedWaitExceedsBudget,
    QueueTimeout,
    ShuttingDown,
    TenantConcurrency,
    TenantQueueFull,
)
from proxy.replicas import Replica, ReplicaPool, ReplicaState, Seat
from proxy.scheduler import FairScheduler, Ticket
from proxy.settings import BudgetsConfig, ReplicaConfig

WEIGHTS = {"interactive": 8.0, "standard": 3.0, "batch": 1.0}
BUDGETS = BudgetsConfig(queue_ms=1000, first_byte_ms=1000, total_ms=5000)


def make_dispatcher(
    clock: FakeClock, seats: int = 1, limits: dict[str, TenantLimits] | None = None
) -> Dispatcher:
    replica = Replica(ReplicaConfig(name="r0", url="http://127.0.0.1:1", max_concurrency=seats))
    limits = limits or {
        "a": TenantLimits(max_concurrency=None, queue_capacity=4),
        "b": TenantLimits(max_concurrency=None, queue_capacity=4),
    }
    return Dispatcher(ReplicaPool([replica]), FairScheduler(WEIGHTS), clock, limits)


def enqueue(
    d: Dispatcher,
    clock: FakeClock,
    tenant: str,
    priority: str = "standard",
    budgets: BudgetsConfig = BUDGETS,
) -> Ticket:
    return d.enqueue(tenant, priority, 10.0, Deadline.start(clock.now(), budgets))


async def test_free_seat_is_granted_at_once_and_released() -> None:
    """A lone ticket with a free seat is granted before enqueue returns."""
    clock = FakeClock()
    d = make_dispatcher(clock)
    ticket = enqueue(d, clock, "a")
    seat = await d.wait(ticket)
    assert d.inflight("a") == 1 and d.pool.total_inflight() == 1
    d.finish(ticket, seat)
    assert d.inflight("a") == 0 and d.pool.total_inflight() == 0
    assert "0 active, 0 queued" in repr(d)


async def test_queue_capacity_bounds_each_tenant() -> None:
    """Past queue_capacity the tenant is refused with tenant_queue_full; others are not."""
    clock = FakeClock()
    d = make_dispatcher(clock)
    first = enqueue(d, clock, "a")
    queued = [enqueue(d, clock, "a") for _ in range(4)]
    with pytest.raises(TenantQueueFull) as info:
        enqueue(d, clock, "a")
    assert info.value.retry_after_s is not None and info.value.retry_after_s > 0
    other = enqueue(d, clock, "b")  # tenant b has its own queue
    assert len(d.scheduler) == 5
    for ticket in [*queued, other]:
        assert ticket.future is not None
        ticket.future.cancel()
        d._abandon(ticket)
    d.finish(first, await d.wait(first))


async def test_cancelled_waiter_is_skipped_before_it_cleans_up() -> None:
    """A waiter cancelled but not yet resumed never receives a seat; the next ticket does."""
    clock = FakeClock()
    d = make_dispatcher(clock)
    holder = enqueue(d, clock, "a")
    seat = await d.wait(holder)
    gone = enqueue(d, clock, "a")
    next_ticket = enqueue(d, clock, "b")
    assert gone.future is not None
    gone.future.cancel()  # what task cancellation does before the task runs again
    d.finish(holder, seat)
    assert next_ticket.seat is not None
    d.finish(next_ticket, await d.wait(next_ticket))
    d._abandon(gone)
    assert len(d.scheduler) == 0 and d.pool.total_inflight() == 0


async def test_an_expired_ticket_is_never_granted_even_if_its_timer_is_late() -> None:
    """When a seat frees after a ticket's queue budget ended, the ticket fails instead."""
    clock = FakeClock()
    d = make_dispatcher(clock)
    holder = enqueue(d, clock, "a")
    seat = await d.wait(holder)
    late = enqueue(d, clock, "b")
    clock.advance(1.5)  # past queue_ms; the real-time timer has not fired
    d.finish(holder, seat)
    with pytest.raises(QueueTimeout):
        await d.wait(late)
    assert d.pool.total_inflight() == 0 and len(d.scheduler) == 0


async def test_queue_timer_fires_at_the_budget() -> None:
    """With the loop's own clock, a queued ticket fails when its budget ends."""
    clock = FakeClock()
    d = make_dispatcher(clock)
    holder = enqueue(d, clock, "a")
    seat = await d.wait(holder)
    budgets = BudgetsConfig(queue_ms=20, first_byte_ms=1000, total_ms=5000)
    waiting = d.enqueue("b", "standard", 1.0, Deadline.start(clock.now(), budgets))
    clock.advance(0.02)
    with pytest.raises(QueueTimeout):
        await asyncio.wait_for(d.wait(waiting), timeout=2)
    d.finish(holder, seat)


async def test_tenant_cap_holds_and_other_tenants_use_the_seats() -> None:
    """A tenant at max_concurrency waits; another tenant takes the free seat meanwhile."""
    clock = FakeClock()
    limits = {
        "a": TenantLimits(max_concurrency=1, queue_capacity=4),
        "b": TenantLimits(max_concurrency=None, queue_capacity=4),
    }
    d = make_dispatcher(clock, seats=3, limits=limits)
    a1, a2 = enqueue(d, clock, "a"), enqueue(d, clock, "a")
    b1 = enqueue(d, clock, "b")
    assert a1.seat is not None and a2.seat is None and b1.seat is not None
    assert d.inflight("a") == 1
    d.finish(a1, await d.wait(a1))
    assert a2.seat is not None
    d.finish(a2, await d.wait(a2))
    d.finish(b1, await d.wait(b1))


async def test_queue_capacity_zero_at_cap_is_tenant_concurrency() -> None:
    """With queue_capacity 0, a tenant at its cap is refused at once with 429."""
    clock = FakeClock()
    limits = {"a": TenantLimits(max_concurrency=1, queue_capacity=0)}
    d = make_dispatcher(clock, seats=2, limits=limits)
    first = enqueue(d, clock, "a")
    with pytest.raises(TenantConcurrency):
        enqueue(d, clock, "a")
    d.finish(first, await d.wait(first))


async def test_close_answers_every_queued_ticket() -> None:
    """Shutdown: each queued ticket fails with shutting_down; new ones are refused."""
    clock = FakeClock()
    d = make_dispatcher(clock)
    holder = enqueue(d, clock, "a")
    queued = [enqueue(d, clock, t) for t in ("a", "b", "b")]
    d.close()
    for ticket in queued:
        with pytest.raises(ShuttingDown, match="shutting down"):
            await d.wait(ticket)
    with pytest.raises(ShuttingDown, match="shutting down"):
        enqueue(d, clock, "a")
    d.finish(holder, await d.wait(holder))


async def _warm(d: Dispatcher, clock: FakeClock, n: int, held_s: float) -> None:
    """Serve ``n`` requests one after another, each holding its seat ``held_s``."""
    for _ in range(n):
        t = enqueue(d, clock, "a")
        seat = await d.wait(t)
        clock.advance(held_s)
        d.finish(t, seat)


async def test_prediction_fails_open_on_a_cold_proxy() -> None:
    """Before about 20 dispatches the estimator says nothing and nothing is refused."""
    clock = FakeClock()
    limits = {"a": TenantLimits(max_concurrency=None, queue_capacity=100)}
    d = make_dispatcher(clock, limits=limits)
    await _warm(d, clock, 18, held_s=1.0)
    assert d.predict_wait("a", "standard", clock.now()) is None
    holder = enqueue(d, clock, "a")
    queued = [enqueue(d, clock, "a") for _ in range(50)]  # far beyond the budget, accepted
    assert len(d.scheduler) == 50
    d.close()
    for t in queued:
        with pytest.raises(ShuttingDown, match="shutting down"):
            await d.wait(t)
    d.finish(holder, await d.wait(holder))


async def test_predicted_wait_over_the_budget_is_refused_at_once() -> None:
    """Seats turn over 10 times a second; the 11th queued request cannot start within
    1.05 s and is refused with its estimate, taking no seat and no queue place."""
    clock = FakeClock()
    limits = {"a": TenantLimits(max_concurrency=None, queue_capacity=100)}
    d = make_dispatcher(clock, limits=limits)
    await _warm(d, clock, 30, held_s=0.1)
    holder = enqueue(d, clock, "a")
    seat = await d.wait(holder)
    budgets = BudgetsConfig(queue_ms=1050, first_byte_ms=1000, total_ms=5000)
    accepted = [enqueue(d, clock, "a", budgets=budgets) for _ in range(9)]
    estimate = d.predict_wait("a", "standard", clock.now())
    assert estimate == pytest.approx(1.0, rel=0.01)
    accepted.append(enqueue(d, clock, "a", budgets=budgets))
    with pytest.raises(PredictedWaitExceedsBudget) as info:
        enqueue(d, clock, "a", budgets=budgets)
    assert info.value.retry_after_s == pytest.approx(1.1, rel=0.01)
    assert len(d.scheduler) == 10 and d.pool.total_inflight() == 1
    d.close()
    for t in accepted:
        with pytest.raises(ShuttingDown, match="shutting down"):
            await d.wait(t)
    d.finish(holder, seat)


async def test_prediction_uses_the_fair_share_of_the_flow() -> None:
    """With a second class backlogged, a batch request's estimate stretches by its share."""
    clock = FakeClock()
    limits = {
        "a": TenantLimits(max_concurrency=None, queue_capacity=100),
        "b": TenantLimits(max_concurrency=None, queue_capacity=100),
    }
    d = make_dispatcher(clock, limits=limits)
    await _warm(d, clock, 30, held_s=0.1)
    holder = enqueue(d, clock, "a")
    seat = await d.wait(holder)
    patient = BudgetsConfig(queue_ms=5000, first_byte_ms=1000, total_ms=9000)
    queued = [enqueue(d, clock, "a", "interactive", budgets=patient) for _ in range(20)]
    # batch share is 1/9 against interactive: 1 own ticket / (1/9) = 9 ahead, at 10/s
    assert d.predict_wait("b", "batch", clock.now()) == pytest.approx(0.9, rel=0.01)
    d.close()
    for t in queued:
        with pytest.raises(ShuttingDown, match="shutting down"):
            await d.wait(t)
    d.finish(holder, seat)


async def test_admitted_tickets_rarely_outlive_their_budget_under_sustained_overload() -> None:
    """An aggressor at 5x capacity beside a steady tenant: once the estimator is warm
    (it fails open for its first 20 dispatches), what it admits gets a seat within
    its queue budget (refused at once otherwise), and the steady tenant is never
    refused."""
    clock = FakeClock()
    limits = {
        "aggressor": TenantLimits(max_concurrency=None, queue_capacity=1000),
        "steady": TenantLimits(max_concurrency=None, queue_capacity=1000),
    }
    d = make_dispatcher(clock, seats=2, limits=limits)
    service_s, step_s = 0.1, 0.01  # 2 seats / 0.1 s = 20 dispatches per second
    running: list[tuple[Ticket, Seat, float]] = []
    waiting: list[Ticket] = []
    outcome = {t: {"admitted": 0, "refused": 0, "expired": 0} for t in limits}
    counted: set[int] = set()
    for step in range(3000):  # 30 simulated seconds
        clock.advance(step_s)
        now = clock.now()
        for item in [r for r in running if r[2] <= now]:
            running.remove(item)
            d.finish(item[0], item[1])
        arrivals = ["aggressor"]  # 100 per second: five times capacity
        if step % 13 == 0:
            arrivals.append("steady")  # about 7.7 per second: under its fair share of 10
        warm = step >= 300  # 3 s: long after the cold start's backlog has gone
        for tenant in arrivals:
            try:
                ticket = enqueue(d, clock, tenant)
            except PredictedWaitExceedsBudget:
                outcome[tenant]["refused"] += warm
                continue
            waiting.append(ticket)
            if warm:
                counted.add(ticket.id)
                outcome[tenant]["admitted"] += 1
        for t in list(waiting):
            if t.seat is not None:
                waiting.remove(t)
                running.append((t, t.seat, now + service_s))
            elif t.future is not None and t.future.done():
                waiting.remove(t)
                assert isinstance(t.future.exception(), QueueTimeout)
                if t.id in counted:
                    outcome[t.tenant]["expired"] += 1
    aggressor, steady = outcome["aggressor"], outcome["steady"]
    assert aggressor["refused"] > aggressor["admitted"]  # 5x capacity: most refused at once
    assert aggressor["expired"] <= 0.05 * aggressor["admitted"], aggressor
    assert steady["refused"] == 0 and steady["expired"] == 0, steady
    d.close()
    for t in waiting:
        with pytest.raises(ShuttingDown, match="shutting down"):
            await d.wait(t)
    for t, seat, _ in running:
        d.finish(t, seat)


async def test_seat_released_when_the_replica_is_done_goes_to_the_next_ticket() -> None:
    """The replica finished before the client read it all: the seat passes on at once,
    while the tenant place stays taken until the request really ends."""
    clock = FakeClock()
    d = make_dispatcher(clock)
    first = enqueue(d, clock, "a")
    waiting = enqueue(d, clock, "b")
    seat = await d.wait(first)
    assert waiting.seat is None
    clock.advance(0.25)
    d.release_seat(first, seat)
    assert waiting.seat is not None, "the freed seat went to the queued ticket"
    assert d.inflight("a") == 1, "a's place is held until its answer is delivered"
    d.finish(first, None)
    assert d.inflight("a") == 0
    d.finish(waiting, await d.wait(waiting))
    assert d.pool.total_inflight() == 0 and d.total_inflight() == 0


async def test_a_seat_comes_back_once_through_the_dispatcher() -> None:
    """Released twice (a retry's backoff, then the request's ``finally``), a seat frees
    one place and wakes one waiter; a grace release frees it only when the grace ends."""
    clock = FakeClock()
    d = make_dispatcher(clock)
    first = enqueue(d, clock, "a")
    seat = await d.wait(first)
    second, third = enqueue(d, clock, "b"), enqueue(d, clock, "b")
    d.release(seat)
    d.release(seat)
    assert seat.released and d.pool.total_inflight() == 1
    assert second.seat is not None and third.seat is None
    d.release(second.seat, delay_s=0.01)
    assert second.seat.released and third.seat is None, "held for the grace"
    await asyncio.wait_for(d.wait(third), timeout=5.0)
    assert d.pool.total_inflight() == 1
    d.finish(first, None)
    d.finish(second, None)
    d.finish(third, third.seat)
    assert d.pool.total_inflight() == 0 and d.total_inflight() == 0


def _two_replicas(clock: FakeClock, queue_capacity: int = 200) -> tuple[Dispatcher, list[Replica]]:
    replicas = [
        Replica(ReplicaConfig(name=f"r{i}", url=f"http://127.0.0.1:{i + 1}", max_concurrency=4))
        for i in range(2)
    ]
    limits = {"a": TenantLimits(max_concurrency=None, queue_capacity=queue_capacity)}
    return Dispatcher(ReplicaPool(replicas), FairScheduler(WEIGHTS), clock, limits), replicas


async def _sparse_traffic(d: Dispatcher, clock: FakeClock) -> None:
    """Three minutes, one request every 5 s: 50 ms each, but three slow (2 s) and two
    that failed at once (a connect error holds its seat a millisecond)."""
    for i in range(36):
        clock.advance(5.0)
        ticket = enqueue(d, clock, "a")
        seat = await d.wait(ticket)
        clock.advance(2.0 if i in (5, 17, 33) else 0.001 if i in (9, 30) else 0.05)
        d.finish(ticket, seat)


async def test_a_burst_after_a_quiet_period_and_a_replica_loss_is_not_refused() -> None:
    """Sparse traffic for minutes, one of two replicas lost, then 100 requests at once:
    the 4 seats left at 50 ms serve them in about 1.25 s, well inside a 5 s queue
    budget, so none is refused and every one gets its seat in time."""
    clock = FakeClock()
    d, replicas = _two_replicas(clock)
    await _sparse_traffic(d, clock)
    replicas[1].move_to(ReplicaState.EJECTED)
    budgets = BudgetsConfig(queue_ms=5000, first_byte_ms=1000, total_ms=30000)
    burst = [enqueue(d, clock, "a", budgets=budgets) for _ in range(100)]  # none refused
    estimate = d.predict_wait("a", "standard", clock.now())
    assert estimate is not None and estimate < 2.0  # 97 ahead at about 80 per second
    running = [(t, t.seat) for t in burst if t.seat is not None]
    assert len(running) == 4
    for _ in range(100):  # the seats turn over every 50 ms
        if not running:
            break
        clock.advance(0.05)
        for ticket, seat in running:
            assert seat is not None
            d.finish(ticket, seat)
        running = [(t, t.seat) for t in burst if t.seat is not None and t.granted_at == clock.now()]
    assert all(t.seat is not None for t in burst), "every ticket got a seat within its budget"
    assert clock.now() - burst[-1].enqueued_at < 5.0


async def test_retry_after_of_a_full_queue_uses_the_capacity_not_a_quiet_rate() -> None:
    """After the same quiet minutes, a full tenant queue answers Retry-After from
    the seats' turnover (one place frees in about 1/80 s), not from the two
    requests a minute the tenant sent while quiet (about 30 s)."""
    clock = FakeClock()
    d, replicas = _two_replicas(clock, queue_capacity=10)
    await _sparse_traffic(d, clock)
    replicas[1].move_to(ReplicaState.EJECTED)
    held = [enqueue(d, clock, "a") for _ in range(14)]  # 4 running, 10 queued
    with pytest.raises(TenantQueueFull) as info:
        enqueue(d, clock, "a")
    assert info.value.retry_after_s is not None and info.value.retry_after_s < 0.1
    d.close()
    for t in held[4:]:
        with pytest.raises(Exception, match="shutting down"):
            await d.wait(t)
    for t in held[:4]:
        d.finish(t, await d.wait(t))


async def test_a_twin_without_predictive_rejection_queues_what_would_be_refused() -> None:
    """The benchmark's twin (predictive_rejection=False) queues the ticket that the
    estimate refuses, so its fate can be compared with the refusal."""
    clock = FakeClock()
    replica = Replica(ReplicaConfig(name="r0", url="http://127.0.0.1:1", max_concurrency=1))
    limits = {"a": TenantLimits(max_concurrency=None, queue_capacity=100)}
    d = Dispatcher(
        ReplicaPool([replica]), FairScheduler(WEIGHTS), clock, limits, predictive_rejection=False
    )
    await _warm(d, clock, 30, held_s=0.1)
    holder = enqueue(d, clock, "a")
    budgets = BudgetsConfig(queue_ms=1050, first_byte_ms=1000, total_ms=5000)
    queued = [enqueue(d, clock, "a", budgets=budgets) for _ in range(11)]  # none refused
    estimate = d.predict_wait("a", "standard", clock.now())
    assert estimate is not None and estimate > 1.05
    assert len(d.scheduler) == 11
    d.close()
    for t in queued:
        with pytest.raises(ShuttingDown):
            await d.wait(t)
    d.finish(holder, await d.wait(holder))


async def test_a_replica_lost_under_load_refuses_only_what_could_not_be_served() -> None:
    """The false-refusal benchmark's replay on a fake clock, at a tiny scale: 0.7x of
    two replicas, 1.4x of the one left after a loss (100 ms requests). Every
    request refused on a predicted wait is one that the twin without prediction
    could not serve within its budget either, and nothing admitted times out.
    Seats that started together free together: the estimate follows that
    staircase (n over the capacity refused a few that fit)."""
    rng = random.Random("replica-loss")
    arrivals, at = [], 0.0
    while at < 10.0:
        at += rng.expovariate(56.0)
        arrivals.append(Arrival(at, 0, 10))
    scenario = Scenario("replica_loss", "", tuple(arrivals), queue_ms=1000, tenants=1,
                        kill_at_s=2.5)  # fmt: skip
    normal = replay(scenario, token_s=0.01)
    twin = replay(scenario, token_s=0.01, predictive=False)
    refused = [i for i, o in enumerate(normal) if o == "refused"]
    assert len(refused) > 0.1 * len(arrivals)  # the overload is real
    assert [i for i in refused if twin[i] == "served"] == []
    assert normal.count("timed_out") == 0


async def test_a_flow_keeps_its_share_when_busy_neighbours_are_momentarily_not_queued() -> None:
    """Three tenants at 56 per second together on 8 seats of 100 ms, then a replica is
    lost (about 40 per second left): with its neighbours' queues empty at this
    instant, a's queue drains at its fair third, neither at what their pre-loss
    rates would leave it (a fifth) nor at half of everything."""
    clock = FakeClock()
    d, replicas = _two_replicas(clock)
    d.set_limits({t: TenantLimits(max_concurrency=None, queue_capacity=100) for t in "abc"})
    running: list[tuple[Ticket, float]] = []
    for step in range(224):  # 4 s, one arrival every 1/56 s, tenants in turn
        clock.advance(1 / 56)
        for ticket, ends in [r for r in running if r[1] <= clock.now()]:
            running.remove((ticket, ends))
            d.finish(ticket, ticket.seat)
        ticket = enqueue(d, clock, "abc"[step % 3])
        assert ticket.seat is not None  # under capacity: every one starts at once
        running.append((ticket, clock.now() + 0.1))
    replicas[1].move_to(ReplicaState.EJECTED)
    rates = d.waits.drain_rates("a", "standard", clock.now())
    assert rates is not None
    mean = d.waits.seat_time.mean_s  # a seat frees at the first step after 100 ms
    assert mean is not None and 0.1 <= mean < 0.12
    assert rates[0] == pytest.approx(4 / mean / 3, rel=0.01)
    for ticket, _ in running:
        d.finish(ticket, ticket.seat)


async def test_retries_waiting_for_a_seat_count_in_the_wait_estimate() -> None:
    """A retry waiting for a seat takes it ahead of every queued ticket: the estimate
    of a new ticket grows by one seat turnover per waiting retry."""
    clock = FakeClock()
    limits = {"a": TenantLimits(max_concurrency=None, queue_capacity=100)}
    d = make_dispatcher(clock, limits=limits)
    await _warm(d, clock, 30, held_s=0.1)
    holder = enqueue(d, clock, "a")
    seat = await d.wait(holder)
    before = d.predict_wait("a", "standard", clock.now())
    retry = asyncio.ensure_future(d.reseat(frozenset(), timeout_s=5.0))
    await asyncio.sleep(0)  # the retry registers as a waiter
    after = d.predict_wait("a", "standard", clock.now())
    assert before == pytest.approx(0.1) and after == pytest.approx(0.2)
    d.finish(holder, seat)
    d.release(await retry)


async def test_a_flow_of_long_requests_is_predicted_at_its_measured_drain() -> None:
    """One seat of 0.1 s; tenants a and b both backlogged, a's tickets costing three
    times b's, so fair queuing (in tokens) gives a one dispatch in four, not the one in
    two its share of the seats suggests. A new ticket of a is predicted to wait about as
    long as it then does (the share-based estimate said half, and let it time out);
    once its backlog has ended, the drain it measured no longer counts."""
    clock = FakeClock()
    limits = {t: TenantLimits(max_concurrency=None, queue_capacity=1000) for t in "ab"}
    d = make_dispatcher(clock, limits=limits)
    await _warm(d, clock, 25, held_s=0.1)
    clock.advance(30.0)  # the warm-up's dispatch rates decay to nothing
    long_budget = BudgetsConfig(queue_ms=60_000, first_byte_ms=1000, total_ms=120_000)

    def add(tenant: str, cost: float) -> Ticket:
        return d.enqueue(tenant, "standard", cost, Deadline.start(clock.now(), long_budget))

    tickets = [add("a", 30.0)]  # takes the seat at once
    running = tickets[0]

    async def turn(top_up_a: bool) -> None:
        """The running request ends after 0.1 s; both queues are kept full."""
        nonlocal running
        while top_up_a and d.scheduler.depth("a") < 10:
            tickets.append(add("a", 30.0))
        while d.scheduler.depth("b") < 40:
            tickets.append(add("b", 10.0))
        clock.advance(0.1)
        d.finish(running, running.seat)
        running = next(t for t in tickets if t.granted_at == clock.now())

    for _ in range(40):
        await turn(top_up_a=True)
    predicted = d.predict_wait("a", "standard", clock.now())
    mine = add("a", 30.0)
    tickets.append(mine)
    for _ in range(200):
        if mine.seat is not None:
            break
        await turn(top_up_a=False)
    assert mine.granted_at is not None
    waited = mine.granted_at - mine.enqueued_at
    assert waited == pytest.approx(4.1, abs=0.25)  # 10 of a's and about 30 of b's ahead
    assert predicted is not None and 0.9 * waited <= predicted <= 1.25 * waited

    # a's backlog is measured again, then every ticket of it expires: a new ticket of a
    # starts a new backlog, judged by its share (the release after next, 0.2 s), not by
    # the drain of the one that ended (twice that).
    for _ in range(40):
        await turn(top_up_a=True)
    for ticket in [t for t in tickets if t.tenant == "a" and t.seat is None]:
        d._expire(ticket)
    assert d.scheduler.depth("a") == 0
    assert d.predict_wait("a", "standard", clock.now()) == pytest.approx(0.2)
    d.close()
