"""Buckets, retry budget, instances and failure handling on a real redis-server."""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import AsyncIterator

import pytest
import redis.exceptions

from proxy.clock import FakeClock
from proxy.places import Held
from proxy.quotas import TokenBucket
from proxy.retries import RetryBudget
from proxy.settings import StateConfig
from proxy.state import client as client_module
from proxy.state.buckets import SharedBuckets
from proxy.state.client import NOW_MS, StateClient, StateDown
from proxy.state.instances import InstanceRegistry
from proxy.state.keys import StateKeys
from proxy.state.leases import Full, Lease, LeaseStore
from proxy.state.quota import Charge, QuotaLimits
from proxy.state.quota_redis import RedisTokenQuotas
from proxy.state.retry_budget import SharedRetryBudget
from proxy.state.shared import SharedState
from tests.redis_server import RedisServer

pytestmark = pytest.mark.redis

KEYS = StateKeys("admission:")


def _config(server: RedisServer, timeout_ms: int = 2000) -> StateConfig:
    return StateConfig(backend="redis", redis_url=server.url, timeout_ms=timeout_ms)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(start=1_000_000.0)


@pytest.fixture
async def timed(redis_server: RedisServer, clock: FakeClock) -> AsyncIterator[StateClient]:
    """A client whose scripts run on the test clock instead of server time."""
    client = StateClient(_config(redis_server), clock=clock)
    yield client
    await client.aclose()


async def test_bucket_answers_like_the_local_one(timed: StateClient, clock: FakeClock) -> None:
    """rate 2/s, burst 3: the same sequence of waits as proxy/quotas.py's TokenBucket."""
    shared, local = SharedBuckets(timed, KEYS), TokenBucket(2, 3, clock)
    for step in [0, 0, 0, 0, 0.25, 0.25, 0.5, 2, 0, 0, 0, 0]:
        clock.advance(step)
        assert await shared.try_take("acme", 2, 3) == pytest.approx(local.try_take())


async def test_bucket_admits_its_rate_in_total_across_clients(redis_server: RedisServer) -> None:
    """20 clients with their own pools take at once from a burst of 5 (slow refill): 5 win."""
    clients = [StateClient(_config(redis_server)) for _ in range(20)]
    try:
        waits = await asyncio.gather(
            *(SharedBuckets(c, KEYS).try_take("acme", 0.001, 5) for c in clients)
        )
        assert sum(w == 0 for w in waits) == 5
    finally:
        for c in clients:
            await c.aclose()


async def test_retry_budget_answers_like_the_local_one(
    timed: StateClient, clock: FakeClock
) -> None:
    """ratio 0.5, floor 0.1/s over 10 s: spends and refusals match proxy/retries.py's budget."""
    shared, local = SharedRetryBudget(timed, KEYS), RetryBudget(0.5, 0.1, clock)
    outcomes: list[tuple[bool, bool]] = []
    for second in range(25):
        clock.advance(1 if second else 0.5)
        for _ in range(2 if second < 5 else 0):
            await shared.record_request()
            local.record_request()
        for _ in range(3):
            wait = await shared.try_spend(0.5, 0.1)
            spent = local.try_spend()
            outcomes.append((wait == 0, spent))
            if not spent:
                assert wait == pytest.approx(local.refill_in())
    assert all(a == b for a, b in outcomes)
    assert any(s for s, _ in outcomes) and not all(s for s, _ in outcomes)


async def test_instances_count_heartbeats_until_they_stop(
    timed: StateClient, clock: FakeClock
) -> None:
    a = InstanceRegistry(timed, KEYS, "pod-a", 3000)
    b = InstanceRegistry(timed, KEYS, "pod-b", 3000)
    assert await a.heartbeat() == 1
    assert await b.heartbeat() == 2 and timed.instances == 2
    clock.advance(2)
    assert await a.heartbeat() == 2
    clock.advance(2)  # pod-b silent for 4 s > 3 s
    assert await a.heartbeat() == 1
    assert await a.leave() == 0 and timed.instances == 1


async def test_redis_down_fails_fast_then_comes_back(redis_server: RedisServer) -> None:
    """Redis killed: calls raise StateDown within a bounded time, the state goes down once;
    restarted (empty, no scripts cached): the next call reloads its script and goes up."""
    changes: list[bool] = []
    # A refused connection fails at once whatever timeout_ms is; 2 s only keeps a loaded
    # machine's slow first connect (and the reload of a script after the restart) from
    # reading as Redis down, which the test's live phases must not.
    config = StateConfig(
        backend="redis", redis_url=redis_server.url, timeout_ms=2000, on_failure="local_share"
    )
    client = StateClient(
        config, on_change=lambda up, _exc: changes.append(up), probe_interval_s=0.0
    )
    client.instances = 3
    store = LeaseStore(client, "a", 10_000)
    seats = KEYS.seats("gpu-0")
    try:
        assert await client.warm()
        lease = await store.acquire(seats, 2, "c")
        assert isinstance(lease, Lease)
        redis_server.stop()
        for _ in range(2):
            started = time.monotonic()
            with pytest.raises(StateDown) as caught:
                await store.acquire(seats, 2, "c")
            assert time.monotonic() - started < 5  # refused at once, not after a timeout
        assert caught.value.on_failure == "local_share"
        assert caught.value.local_seats(8) == 2 and caught.value.local_share(6.0) == 2.0
        assert changes == [False] and client.errors == 2 and not client.up
        redis_server.start()
        # A lease taken before the restart is simply gone: nothing double-counted.
        assert not await store.release(lease)
        assert changes == [False, True] and client.up
        assert await store.held(seats) == 0
        assert isinstance(await store.acquire(seats, 1, "c"), Lease)
        assert isinstance(await store.acquire(seats, 1, "c"), Full)
    finally:
        await client.aclose()


async def test_slow_redis_counts_as_a_failure(redis_server: RedisServer) -> None:
    """A script slower than timeout_ms raises StateDown; the reject mode says so."""
    config = StateConfig(
        backend="redis", redis_url=redis_server.url, timeout_ms=100, on_failure="reject"
    )
    client = StateClient(config)
    # Busy for one full second of server time (microseconds: not just a change of second).
    slow = """
    local function us() local t = redis.call('TIME') return t[1] * 1000000 + t[2] end
    local start = us()
    while us() - start < 1000000 do end
    """
    try:
        with pytest.raises(StateDown) as caught:
            await client.run(slow + " return 1", ["admission:{x}:slow"], [])
        assert caught.value.on_failure == "reject" and not client.up
        assert isinstance(caught.value.__cause__, (TimeoutError, redis.exceptions.TimeoutError))
    finally:
        await client.aclose()


async def test_scripts_load_again_after_the_cache_is_flushed(timed: StateClient) -> None:
    """SCRIPT FLUSH (what a restart does): the next call gets NOSCRIPT, loads, succeeds."""
    buckets = SharedBuckets(timed, KEYS)
    assert await buckets.try_take("acme", 1, 2) == 0
    await timed.redis.script_flush()
    assert await buckets.try_take("acme", 1, 2) == 0
    assert await buckets.try_take("acme", 1, 2) == pytest.approx(1.0)
    assert timed.up and timed.errors == 0


def _shas() -> list[str]:
    """Every declared script as Redis names it (the ``now_ms`` prelude included)."""
    return [
        hashlib.sha1((NOW_MS + source).encode()).hexdigest() for source in client_module._SOURCES
    ]


async def _evalsha_failures(client: StateClient) -> int:
    stats = await client.redis.info("commandstats")
    return int(stats.get("cmdstat_evalsha", {}).get("failed_calls", 0))


async def test_warm_loads_every_script_so_no_first_call_goes_cold(
    redis_server: RedisServer,
) -> None:
    """After ``warm`` every declared script is in Redis's cache, and a process's first
    calls of every kind (rate, seats with a fair turn, tenant places, quota, retry
    budget, heartbeat, releases) run at once by EVALSHA: no NOSCRIPT, no second round
    trip inside one ``timeout_ms``. A cold first call took four round trips and, on a
    loaded host, a worker just started counted Redis as down."""
    clock = FakeClock(start=2_000_000.0)
    state = SharedState(_config(redis_server), clock)
    client = state.client
    try:
        await client.redis.script_flush()
        await client.redis.config_resetstat()
        assert not any(await client.redis.script_exists(*_shas()))
        assert await client.warm()
        assert all(await client.redis.script_exists(*_shas()))
        await state.take_rate("c", 2.0, 4.0)
        held = await state.places.take("a", 2, "r0", 4, 1.0)  # a tenant place and a seat
        assert isinstance(held, Held)
        store, seats = state.places.store, KEYS.seats("r0")
        lease = await store.acquire(seats, 4, "c")
        assert isinstance(lease, Lease)
        await store.renew(seats, [lease.id])
        await store.restore(seats, [lease.id])
        assert await store.held(seats) == 2
        assert await store.release(lease)
        await store.unwait(seats, KEYS.waiting("r0"), "a", 4, "c")
        limits = QuotaLimits(per_minute=1000, per_day=None)
        charge = await state.quotas.charge("a", 10, limits)
        assert isinstance(charge, Charge)
        await state.quotas.correct(charge, 12)
        await state.quotas.remaining("a", limits)
        state.record_request()
        await state.spend_retry(RetryBudget(ratio=0.5, min_per_s=1.0, clock=clock))
        await state.registry.heartbeat()
        await state.registry.leave()
        assert await _evalsha_failures(client) == 0
        assert client.up and client.errors == 0
    finally:
        await client.aclose()


async def test_warm_gives_up_in_time_and_counts_nothing(redis_server: RedisServer) -> None:
    """Redis not there at start: ``warm`` says so within its bound, and leaves the up/down
    state and the error count to the first real call."""
    redis_server.stop()
    client = StateClient(_config(redis_server, timeout_ms=50), probe_interval_s=0.05)
    try:
        started = time.monotonic()
        assert not await client.warm(within_s=0.5)
        assert time.monotonic() - started < 5  # generous bound around within_s=0.5
        assert client.up and client.errors == 0
    finally:
        await client.aclose()


async def test_day_counter_expires_an_hour_after_its_day(
    timed: StateClient, clock: FakeClock
) -> None:
    """The per-day key lives until an hour past the UTC midnight that ends its day."""
    quotas = RedisTokenQuotas(timed, KEYS)
    assert isinstance(await quotas.charge("acme", 10, QuotaLimits(per_day=100)), Charge)
    now = clock.now()
    expected_ms = ((now // 86_400 + 1) * 86_400 - now + 3_600) * 1000
    ttl_ms = await timed.redis.pttl(KEYS.quota_day("acme"))
    assert expected_ms - 10_000 < ttl_ms <= expected_ms


async def test_a_restart_is_noticed_and_the_divisor_does_not_collapse(
    timed: StateClient,
) -> None:
    """Redis loses its state (FLUSHALL, as a restart without persistence): the next heartbeat
    reports it, and the live count stays 2 while the registry refills, not 1."""
    lost: list[bool] = []
    a = InstanceRegistry(timed, KEYS, "pod-a", 3000)
    a.on_lost = lambda: lost.append(True)
    b = InstanceRegistry(timed, KEYS, "pod-b", 3000)
    await a.heartbeat()
    assert await b.heartbeat() == 2 and timed.instances == 2
    await timed.redis.flushall()
    assert await a.heartbeat() == 1
    assert lost == [True] and timed.instances == 2


async def test_a_quota_charge_made_while_redis_was_down_is_corrected_where_it_was_made(
    redis_server: RedisServer,
) -> None:
    """local_share: a charge made in the local store while Redis is down is settled in
    that store after Redis is back, not given back to Redis (which never saw it);
    a charge made in Redis is corrected there."""
    from proxy.state.shared import SharedTokenQuotas

    config = StateConfig(
        backend="redis", redis_url=redis_server.url, timeout_ms=200, on_failure="local_share"
    )
    client = StateClient(config, probe_interval_s=0.0)
    client.instances = 2
    store = SharedTokenQuotas(client, RedisTokenQuotas(client, KEYS))
    limits = QuotaLimits(per_day=1_000)
    try:
        in_redis = await store.charge("acme", 100, limits)
        assert isinstance(in_redis, Charge)
        redis_server.stop()
        local = await store.charge("acme", 300, limits)
        assert isinstance(local, Charge)
        assert local.limits.per_day == 500  # the limit divided by the 2 instances last seen
        redis_server.start()
        left_local = await store.correct(local, 50)
        assert left_local.day == 500 - 50  # settled in the local store, at its usage
        # Redis (restarted empty) was not credited the local charge's 250 unused tokens.
        assert (await store.remaining("acme", limits)).day == 1_000
        fresh = await store.charge("acme", 200, limits)
        assert isinstance(fresh, Charge)
        assert (await store.correct(fresh, 120)).day == 1_000 - 120
    finally:
        await client.aclose()


async def test_retries_while_redis_is_down_share_the_floor(redis_server: RedisServer) -> None:
    """Redis down with local_share and 4 instances last seen: a process's retries come from
    its own budget with a quarter of min_retries_per_s (2/s over the 10 s window: 5, not
    20); a budget that is out says when it has one again."""
    redis_server.stop()
    config = StateConfig(
        backend="redis", redis_url=redis_server.url, timeout_ms=200, on_failure="local_share"
    )
    clock = FakeClock(start=1_000_000.0)
    state = SharedState(config, clock)
    state.client.instances = 4
    budget = RetryBudget(ratio=0.0, min_per_s=2.0, clock=clock)
    try:
        spent = [await state.spend_retry(budget) for _ in range(8)]
    finally:
        await state.close()
    assert spent[:5] == [0.0] * 5
    assert all(wait > 0 for wait in spent[5:])


async def test_connections_pooled_before_a_restart_do_not_fail_calls_after_it(
    redis_server: RedisServer,
) -> None:
    """Concurrent calls leave several connections in the pool; Redis restarts while they sit
    idle. Once it answers again, calls on those stale connections reconnect and succeed: no
    StateDown (503 state_unavailable under reject) while Redis is up, no error counted."""
    changes: list[bool] = []
    config = StateConfig(
        backend="redis", redis_url=redis_server.url, timeout_ms=2000, on_failure="reject"
    )
    client = StateClient(config, on_change=lambda up, _exc: changes.append(up))
    calls = 5
    try:
        await asyncio.gather(*(client.run("return 1", ["k{x}"], []) for _ in range(calls)))
        assert len(client.redis.connection_pool._available_connections) == calls
        redis_server.stop()
        redis_server.start()
        results = await asyncio.gather(
            *(client.run("return 1", ["k{x}"], []) for _ in range(calls)), return_exceptions=True
        )
        assert results == [1] * calls
        assert client.up and client.errors == 0 and changes == []
    finally:
        await client.aclose()


async def test_the_count_never_falls_below_the_floor(timed: StateClient) -> None:
    """A worker of serve --workers 2 beats before its sibling registered: the live count
    it keeps (local_share's divisor) is the group's 2, not the 1 Redis shows yet."""
    registry = InstanceRegistry(timed, KEYS, "pod-a", 3000)
    registry.floor = 2
    assert await registry.heartbeat() == 1
    assert timed.instances == 2
