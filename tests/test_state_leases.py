"""Leases on a real redis-server: exact limits under races, expiry, SIGKILL, notifications."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import replace

import pytest

from proxy.clock import FakeClock
from proxy.settings import StateConfig
from proxy.state.client import StateClient, StateDown
from proxy.state.keys import StateKeys
from proxy.state.leases import Full, Lease, LeaseKeeper, LeaseStore, Seen, Share
from proxy.state.notify import FreedListener
from proxy.state.pair import Refused, Want, acquire_pair
from tests.redis_server import RedisServer

pytestmark = pytest.mark.redis

KEYS = StateKeys("admission:")
SEATS = KEYS.seats("gpu-0")
CHANNEL = KEYS.freed_channel("pool-a")


def _config(server: RedisServer, **changes: object) -> StateConfig:
    base: dict[str, object] = {"backend": "redis", "redis_url": server.url, "timeout_ms": 2000}
    return StateConfig.model_validate(base | changes)


@pytest.fixture
async def client(redis_server: RedisServer) -> AsyncIterator[StateClient]:
    client = StateClient(_config(redis_server))
    yield client
    await client.aclose()


async def test_racing_clients_never_hold_more_than_the_limit(redis_server: RedisServer) -> None:
    """40 clients, each with its own connection pool, race for 8 seats: exactly 8 win."""
    clients = [StateClient(_config(redis_server)) for _ in range(40)]
    try:
        stores = [LeaseStore(c, f"p{i}", 10_000) for i, c in enumerate(clients)]
        answers = await asyncio.gather(*(s.acquire(SEATS, 8, CHANNEL) for s in stores))
        assert sum(isinstance(a, Lease) for a in answers) == 8
        assert await stores[0].held(SEATS) == 8
        refused = [a for a in answers if isinstance(a, Full)]
        assert all(a.held == 8 and 0 < a.retry_in_s <= 10 for a in refused)
    finally:
        for c in clients:
            await c.aclose()


_HOLDER = """
import asyncio, sys
from proxy.clock import FakeClock
from proxy.settings import StateConfig
from proxy.state.client import StateClient
from proxy.state.keys import StateKeys
from proxy.state.leases import Lease, LeaseKeeper, LeaseStore

async def main() -> None:
    config = StateConfig(backend="redis", redis_url=sys.argv[1], timeout_ms=2000)
    store = LeaseStore(StateClient(config), sys.argv[2], int(sys.argv[3]))
    keeper = LeaseKeeper(store)
    seats = StateKeys("admission:").seats("gpu-0")
    won = 0
    for _ in range(8):
        lease = await store.acquire(seats, 8, "admission:freed:pool-a")
        if isinstance(lease, Lease):
            keeper.add(lease)
            won += 1
    print(won, flush=True)
    await keeper.run()

asyncio.run(main())
"""


def _holder(server: RedisServer, owner: str, lease_ms: int) -> subprocess.Popen[str]:
    args = [sys.executable, "-c", _HOLDER, server.url, owner, str(lease_ms)]
    return subprocess.Popen(args, stdout=subprocess.PIPE, text=True)


def _stop(holder: subprocess.Popen[str]) -> None:
    holder.kill()
    holder.wait(timeout=20)
    if holder.stdout is not None:
        holder.stdout.close()


async def test_separate_processes_share_the_seats_exactly(redis_server: RedisServer) -> None:
    """Three OS processes each try for all 8 seats at once: 8 won in total, 8 held."""
    holders = [_holder(redis_server, f"proc{i}", 10_000) for i in range(3)]
    try:
        wins = [int(await asyncio.to_thread(h.stdout.readline)) for h in holders if h.stdout]
        assert sum(wins) == 8
        client = StateClient(_config(redis_server))
        assert await LeaseStore(client, "probe", 10_000).held(SEATS) == 8
        await client.aclose()
    finally:
        for h in holders:
            _stop(h)


async def test_sigkilled_holder_frees_its_seats_within_lease_ms(
    redis_server: RedisServer, client: StateClient
) -> None:
    """A process renewing 8 seats is SIGKILLed: the seats stay while it lives, then free."""
    lease_ms = 1500
    holder = _holder(redis_server, "doomed", lease_ms)
    store = LeaseStore(client, "survivor", lease_ms)
    try:
        assert holder.stdout is not None
        assert int(await asyncio.to_thread(holder.stdout.readline)) == 8
        await asyncio.sleep(lease_ms * 2 / 1000)  # longer than a lease: renewals kept them
        assert isinstance(await store.acquire(SEATS, 8, CHANNEL), Full)
        os.kill(holder.pid, signal.SIGKILL)
        killed = time.monotonic()
        holder.wait(timeout=20)
    finally:
        _stop(holder)
    # The server's own expiries: no seat of the dead process outlives lease_ms from now.
    seconds, micros = await client.redis.time()
    for entry in await client.redis.zrange(SEATS, 0, -1, withscores=True):
        expiry_ms = float(entry[1])
        assert expiry_ms - (seconds * 1000 + micros / 1000) <= lease_ms
    answer = await store.acquire(SEATS, 8, CHANNEL)
    while isinstance(answer, Full) and time.monotonic() - killed < 20:
        await asyncio.sleep(max(0.01, answer.retry_in_s))
        answer = await store.acquire(SEATS, 8, CHANNEL)
    assert isinstance(answer, Lease)


async def test_lease_not_renewed_expires_and_is_reported_lost(client: StateClient) -> None:
    """On the test clock: a lease unrenewed past lease_ms frees its seat; renewal says lost."""
    clock = FakeClock(start=1_000_000.0)
    timed = StateClient(client.config, clock=clock)
    store = LeaseStore(timed, "a", 1000)
    lost: list[Lease] = []
    keeper = LeaseKeeper(store, on_lost=lost.append)
    first = await store.acquire(SEATS, 1, CHANNEL)
    assert isinstance(first, Lease)
    keeper.add(first)
    clock.advance(0.9)
    assert await keeper.renew_once() == []
    clock.advance(0.9)  # 1.8 s after the take, 0.9 s after the renewal: still held
    refused = await store.acquire(SEATS, 1, CHANNEL)
    assert isinstance(refused, Full) and refused.retry_in_s == pytest.approx(0.1)
    clock.advance(0.2)
    second = await store.acquire(SEATS, 1, CHANNEL)
    assert isinstance(second, Lease)
    assert await keeper.renew_once() == [first] and len(keeper) == 0 and lost == [first]
    assert not await store.release(first)
    assert await store.release(second)
    await timed.aclose()


async def test_release_wakes_a_subscriber(redis_server: RedisServer, client: StateClient) -> None:
    """A process listening on the pool's channel hears a release (and only a real one)."""
    heard: list[str] = []
    woke = asyncio.Event()

    def on_freed(channel: str) -> None:
        heard.append(channel)
        woke.set()

    listener = FreedListener(redis_server.url, [CHANNEL], on_freed, connect_timeout_s=5)
    task = asyncio.create_task(listener.run())
    try:
        async with asyncio.timeout(20):
            await listener.subscribed.wait()
        woke.clear()
        heard.clear()
        store = LeaseStore(client, "a", 10_000)
        lease = await store.acquire(SEATS, 1, CHANNEL)
        assert isinstance(lease, Lease)
        assert not woke.is_set()
        assert await store.release(lease)
        async with asyncio.timeout(20):
            await woke.wait()
        assert heard == [CHANNEL]
        assert not await store.release(lease)  # nothing held: nothing published
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


@pytest.mark.parametrize(("tenant_limit", "seat_limit", "refused"), [(0, 1, 0), (1, 0, 1)])
async def test_pair_takes_both_or_neither(
    client: StateClient, tenant_limit: int, seat_limit: int, refused: int
) -> None:
    """A tenant place then a seat: a refusal of either leaves no place taken."""
    store = LeaseStore(client, "a", 10_000)
    place = Want(KEYS.tenant_places("acme"), tenant_limit, KEYS.freed_channel("acme"))
    seat = Want(SEATS, seat_limit, CHANNEL)
    answer = await acquire_pair(store, place, seat)
    assert isinstance(answer, Refused) and answer.which == refused
    assert await store.held(place.key) == 0 and await store.held(SEATS) == 0
    both = await acquire_pair(store, Want(place.key, 1, place.channel), Want(SEATS, 1, CHANNEL))
    assert isinstance(both, tuple)
    assert await store.held(place.key) == 1 and await store.held(SEATS) == 1


class _SecondCallFails(LeaseStore):
    """A real store whose second acquire finds Redis gone (as if it died in between)."""

    __slots__ = ("calls",)

    def __init__(self, client: StateClient) -> None:
        super().__init__(client, "a", 10_000)
        self.calls = 0

    async def acquire(
        self, key: str, limit: int, channel: str, share: Share | None = None
    ) -> Lease | Full:
        self.calls += 1
        if self.calls == 2:
            raise StateDown("down", on_failure="reject", instances=1)
        return await super().acquire(key, limit, channel, share)


async def test_pair_compensates_when_redis_fails_in_between(client: StateClient) -> None:
    """The seat call fails (StateDown): the tenant place taken first is given back."""
    store = _SecondCallFails(client)
    place = Want(KEYS.tenant_places("acme"), 1, KEYS.freed_channel("acme"))
    with pytest.raises(StateDown):
        await acquire_pair(store, place, Want(SEATS, 1, CHANNEL))
    assert store.calls == 2
    assert await store.held(place.key) == 0


async def test_subscriber_comes_back_after_a_redis_restart(
    redis_server: RedisServer, client: StateClient
) -> None:
    """Redis restarted: the listener resubscribes by itself, first waking every waiter
    (a release may have gone by unheard), then hears releases again."""
    heard: list[str] = []
    listener = FreedListener(redis_server.url, [CHANNEL], heard.append, connect_timeout_s=5)
    task = asyncio.create_task(listener.run())
    try:
        async with asyncio.timeout(20):
            await listener.subscribed.wait()
        assert heard == [CHANNEL]  # the resync call of the first subscription
        redis_server.stop()
        async with asyncio.timeout(20):
            while listener.subscribed.is_set():
                await asyncio.sleep(0.01)
        redis_server.start()
        async with asyncio.timeout(20):
            await listener.subscribed.wait()
        assert listener.subscriptions == 2 and heard == [CHANNEL, CHANNEL]
        store = LeaseStore(client, "a", 10_000)
        lease = await store.acquire(SEATS, 1, CHANNEL)
        assert isinstance(lease, Lease) and await store.release(lease)
        async with asyncio.timeout(20):
            while len(heard) < 3:
                await asyncio.sleep(0.01)
        assert heard == [CHANNEL] * 3
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


def _share(tenant: str, weight: float = 1.0) -> Share:
    return Share(tenant, weight, KEYS.waiting("gpu-0"), KEYS.waiting_weights("gpu-0"), 400)


async def test_a_free_seat_goes_to_the_waiting_tenant_in_its_fair_turn(
    client: StateClient,
) -> None:
    """a holds 2 of 3 seats; b (same weight) was refused when they were full. A seat frees:
    a asking first is refused (its third seat before b's first) and counted waiting, b gets
    it; a waiter that stops asking counts no more after its 400 ms (nothing stays idle)."""
    clock = FakeClock(start=2_000_000.0)
    timed = StateClient(client.config, clock=clock)
    store = LeaseStore(timed, "p1", 10_000)
    a = [await store.acquire(SEATS, 3, CHANNEL, _share("a")) for _ in range(3)]
    assert all(isinstance(x, Lease) for x in a)
    full = await store.acquire(SEATS, 3, CHANNEL, _share("b"))
    assert isinstance(full, Full) and full.retry_in_s == pytest.approx(0.2)  # asked back
    freed = a[2]
    assert isinstance(freed, Lease) and await store.release(freed)
    turn = await store.acquire(SEATS, 3, CHANNEL, _share("a"))
    assert isinstance(turn, Full) and turn.held == 2
    assert isinstance(await store.acquire(SEATS, 3, CHANNEL, _share("b")), Lease)
    assert isinstance(await store.acquire(SEATS, 3, CHANNEL, _share("c")), Full)
    clock.advance(0.5)  # a's and c's waiting entries expire unrenewed
    held_a = a[0]
    assert isinstance(held_a, Lease) and await store.release(held_a)
    assert isinstance(await store.acquire(SEATS, 3, CHANNEL, _share("a")), Lease)
    await timed.aclose()


async def test_weights_set_the_fair_turn(client: StateClient) -> None:
    """b (weight 3) waits while a (weight 1) holds 1 of 4 and b 2: a's next seat would put it
    at 2 / 1 against b's 3 / 3, so the free seat is b's; b then holds 3 to a's 1."""
    clock = FakeClock(start=3_000_000.0)
    timed = StateClient(client.config, clock=clock)
    store = LeaseStore(timed, "p1", 10_000)
    assert isinstance(await store.acquire(SEATS, 4, CHANNEL, _share("a")), Lease)
    for _ in range(2):
        assert isinstance(await store.acquire(SEATS, 4, CHANNEL, _share("b", 3.0)), Lease)
    extra = await store.acquire(SEATS, 4, CHANNEL, _share("a"))
    assert isinstance(extra, Lease)
    assert isinstance(await store.acquire(SEATS, 4, CHANNEL, _share("b", 3.0)), Full)
    assert await store.release(extra)
    assert isinstance(await store.acquire(SEATS, 4, CHANNEL, _share("a")), Full)
    assert isinstance(await store.acquire(SEATS, 4, CHANNEL, _share("b", 3.0)), Lease)
    await timed.aclose()


async def test_a_seat_taken_while_redis_was_down_counts_for_its_tenant(
    client: StateClient,
) -> None:
    """Two seats a took locally (Redis down), written back by the keeper, are a's in the
    fair turn: with b waiting, a third seat for a is refused."""
    clock = FakeClock(start=4_000_000.0)
    timed = StateClient(client.config, clock=clock)
    store = LeaseStore(timed, "p1", 10_000)
    local = [store.local(SEATS, CHANNEL, _share("a")) for _ in range(2)]
    assert await store.restore(SEATS, [lease.id for lease in local]) == {x.id for x in local}
    other = await store.acquire(SEATS, 3, CHANNEL, _share("c"))
    assert isinstance(other, Lease)
    assert isinstance(await store.acquire(SEATS, 3, CHANNEL, _share("b")), Full)
    assert await store.release(other)
    assert isinstance(await store.acquire(SEATS, 3, CHANNEL, _share("a")), Full)
    assert isinstance(await store.acquire(SEATS, 3, CHANNEL, _share("b")), Lease)
    await timed.aclose()


async def test_a_headroom_seat_is_taken_outside_the_turn(client: StateClient) -> None:
    """b holds 2 of 4 seats (one of them headroom) to a's 1, and a waits: a regular seat for
    b is refused in a's turn, a headroom seat is not (b's process found it below its fair
    share of recent work; its seats held now would hand the turn to the flood)."""
    clock = FakeClock(start=5_000_000.0)
    timed = StateClient(client.config, clock=clock)
    store = LeaseStore(timed, "p1", 10_000)
    assert isinstance(await store.acquire(SEATS, 1, CHANNEL, _share("a")), Lease)
    for _ in range(2):
        assert isinstance(await store.acquire(SEATS, 4, CHANNEL, _share("b")), Lease)
    assert isinstance(await store.acquire(SEATS, 3, CHANNEL, _share("a")), Full)  # a waits
    assert isinstance(await store.acquire(SEATS, 4, CHANNEL, _share("b")), Full)
    headroom = replace(_share("b"), turn=False)
    assert isinstance(await store.acquire(SEATS, 4, CHANNEL, headroom), Lease)
    assert isinstance(await store.acquire(SEATS, 4, CHANNEL, headroom), Full)  # all 4 held
    await timed.aclose()


async def test_a_process_removes_only_its_own_waiting_entry(client: StateClient) -> None:
    """a waits at gpu-0 through two processes (each refused it: full). A seat frees and b,
    holding one, is refused its turn (a's tag is lower). p1 has nothing queued for a any
    more and removes its entry: a still waits through p2, so b is still refused, and the
    channel is told (a seat is free and others wait). Once p2's entry goes too, b's turn."""
    clock = FakeClock(start=6_000_000.0)
    timed = StateClient(client.config, clock=clock)
    p1, p2 = LeaseStore(timed, "p1", 10_000), LeaseStore(timed, "p2", 10_000)
    waiting = KEYS.waiting("gpu-0")
    x = await p1.acquire(SEATS, 2, CHANNEL, _share("x"))
    assert isinstance(x, Lease) and isinstance(
        await p1.acquire(SEATS, 2, CHANNEL, _share("b")), Lease
    )
    for store in (p1, p2):
        assert isinstance(await store.acquire(SEATS, 2, CHANNEL, _share("a")), Full)
    assert await p1.release(x)
    refused = await p1.acquire(SEATS, 2, CHANNEL, _share("b"))
    assert isinstance(refused, Full) and refused.turn
    assert await p1.unwait(SEATS, waiting, "a", 2, CHANNEL) == 2  # removed, others told
    assert await p1.unwait(SEATS, waiting, "a", 2, CHANNEL) == 0  # nothing left of p1's
    assert isinstance(await p1.acquire(SEATS, 2, CHANNEL, _share("b")), Full)  # a via p2
    assert await p2.unwait(SEATS, waiting, "a", 2, CHANNEL) == 2
    assert isinstance(await p1.acquire(SEATS, 2, CHANNEL, _share("b")), Lease)
    assert isinstance(await p2.acquire(SEATS, 2, CHANNEL, _share("c")), Full)  # full: waits
    assert await p2.unwait(SEATS, waiting, "c", 2, CHANNEL) == 1  # nobody else waits
    await timed.aclose()


async def test_a_seat_answer_counts_the_seats_other_backlogged_processes_hold(
    client: StateClient,
) -> None:
    """p1 and p2 hold one of 2 seats each. Until p2 is refused there, p1's answers count
    no backlogged process; once it is, they count its seat (and it) until its 400 ms end;
    p2's own answers never count itself."""
    clock = FakeClock(start=5_000_000.0)
    timed = StateClient(client.config, clock=clock)
    seats, waiting = KEYS.seats("gpu-9"), KEYS.waiting("gpu-9")
    share = Share("a", 1.0, waiting, KEYS.waiting_weights("gpu-9"), 400)
    one, two = LeaseStore(timed, "host:1:aa", 10_000), LeaseStore(timed, "host:2:bb", 10_000)
    first = await one.acquire(seats, 2, CHANNEL, share)
    assert isinstance(first, Lease) and first.seen == Seen(1, 0, 0)
    second = await two.acquire(seats, 2, CHANNEL, share)
    assert isinstance(second, Lease) and second.seen == Seen(2, 0, 0)
    refused = await one.acquire(seats, 2, CHANNEL, share)
    assert isinstance(refused, Full) and refused.seen == Seen(2, 0, 0)
    refused = await two.acquire(seats, 2, CHANNEL, share)  # p1 waits: its seat counts
    assert isinstance(refused, Full) and refused.seen == Seen(2, 1, 1)
    refused = await one.acquire(seats, 2, CHANNEL, share)
    assert isinstance(refused, Full) and refused.seen == Seen(2, 1, 1)
    clock.advance(0.5)  # neither asks again: neither counts as waiting any more
    assert await one.release(first)
    again = await one.acquire(seats, 2, CHANNEL, share)
    assert isinstance(again, Lease) and again.seen == Seen(2, 0, 0)
    await timed.aclose()


async def test_a_grant_with_a_backlog_counts_its_process_as_backlogged_for_that_long(
    client: StateClient,
) -> None:
    """p1 takes both seats saying it has a backlog for 1 s (never refused: it holds every
    seat it sees); p2, refused, counts both as a backlogged process's until then."""
    clock = FakeClock(start=6_000_000.0)
    timed = StateClient(client.config, clock=clock)
    seats, waiting = KEYS.seats("gpu-8"), KEYS.waiting("gpu-8")
    share = Share("a", 1.0, waiting, KEYS.waiting_weights("gpu-8"), 400)
    one, two = LeaseStore(timed, "host:1:aa", 10_000), LeaseStore(timed, "host:2:bb", 10_000)
    assert isinstance(await one.acquire(seats, 2, CHANNEL, share), Lease)
    backlogged = replace(share, backlog_ms=1000)
    second = await one.acquire(seats, 2, CHANNEL, backlogged)
    assert isinstance(second, Lease) and second.seen == Seen(2, 0, 0)
    refused = await two.acquire(seats, 2, CHANNEL, replace(share, tenant="b"))
    assert isinstance(refused, Full) and refused.seen == Seen(2, 2, 1)
    clock.advance(1.1)  # p1 did not say it again
    refused = await two.acquire(seats, 2, CHANNEL, replace(share, tenant="b"))
    assert isinstance(refused, Full) and refused.seen == Seen(2, 0, 0)
    await timed.aclose()
