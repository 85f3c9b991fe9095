"""What clients control stays bounded, and clients that leave leak nothing.

An operator runs the proxy for weeks: every value a client chooses (an API
key, ``X-Session-Id``, a prompt's prefix, a ``model`` name, ``X-Request-Id``,
``X-Priority``) arrives with a new value at every request, and clients give up
at every step of a request (queued, waiting for the first byte, mid-stream).
Each test churns thousands of such values through the real proxy in front of
simulator replicas, then asserts that what the proxy keeps is within its
documented bound, and that once idle it holds no seat, no queued ticket, no
stray task and no upstream connection beyond what keep-alive keeps.
"""

from __future__ import annotations

import asyncio
import itertools
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from proxy.runtime import Runtime
from proxy.sim import SimServer
from tests.conftest import ProxyUnderTest
from tests.helpers import KEY_A, KEY_B, make_config, running_sims, wait_for

Start = Callable[..., Awaitable[ProxyUnderTest]]
CHAT = "/v1/chat/completions"
AUTH = {"Authorization": f"Bearer {KEY_A}"}
SEATS = 2
#: Bound on waiting for the proxy to settle after a churn (2 loaded cores: generous).
SETTLE_S = 10.0
LONG = {"queue_ms": 60_000, "first_byte_ms": 60_000, "total_ms": 120_000}


@pytest.fixture
async def sims() -> AsyncIterator[list[SimServer]]:
    async with running_sims(decode_per_seq_ms=0.1) as servers:
        yield servers


def chat(content: str = "hello", **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 2, **extra}


#: 127.0.0.1 as ``/proc/net/tcp`` and ``tcp6`` write it.
LOOPBACK_V4 = "0100007F"
LOOPBACK_V4_IN_V6 = "0000000000000000FFFF00000100007F"


def upstream_connections(port: int) -> int:
    """Established TCP connections to 127.0.0.1:``port`` (``/proc/net/tcp*``): the
    proxy's and its prober's connections to a replica."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            address, remote_port = fields[2].rsplit(":", 1)
            loopback = address in (LOOPBACK_V4, LOOPBACK_V4_IN_V6)
            if fields[3] == "01" and loopback and int(remote_port, 16) == port:
                count += 1
    return count


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def stray_tasks(before: set[asyncio.Task[Any]]) -> list[asyncio.Task[Any]]:
    """Tasks started since ``before`` that still run, but a kept-alive connection's
    handler (aiohttp's ``RequestHandler.start``, bounded by the connections counted)."""
    return [
        t
        for t in asyncio.all_tasks() - before
        if t is not asyncio.current_task()
        and not t.done()
        and getattr(t.get_coro(), "__qualname__", "") != "RequestHandler.start"
    ]


async def settled(proxy: ProxyUnderTest, sims: list[SimServer], before: set[Any]) -> None:
    """Until nothing runs anywhere (proxy and replicas) and no task is left over."""
    runtime = proxy.runtime
    await wait_for(
        lambda: (
            not runtime.active
            and runtime.pool.total_inflight() == 0
            and runtime.dispatcher.total_inflight() == 0
            and len(runtime.dispatcher.scheduler) == 0
            and all(s.state.in_flight == 0 for s in sims)
            and not stray_tasks(before)
        ),
        timeout_s=SETTLE_S,
    )
    proxy.assert_idle()
    assert_no_request_state(runtime)


def assert_no_request_state(runtime: Runtime) -> None:
    """Nothing kept per request once none runs: the dispatcher's running requests (for
    seat times), the affinity ledger's placements, observe mode's overflow, the seat
    calls in flight (private maps, read here because no figure shows them)."""
    dispatcher = runtime.dispatcher
    assert not dispatcher.waits._running and not dispatcher.waits._pool_of
    assert not dispatcher.seats.affinity.ledger._placed
    assert not len(dispatcher._overflow) and not dispatcher._asking
    assert not len(dispatcher._reseating)


def series(metrics: str) -> set[tuple[str, tuple[tuple[str, str], ...]]]:
    return {
        (sample.name, tuple(sorted(sample.labels.items())))
        for family in text_string_to_metric_families(metrics)
        for sample in family.samples
    }


async def churn(send: Callable[[int], Awaitable[None]], count: int, parallel: int = 16) -> None:
    """``send(i)`` for i in 0..count-1, ``parallel`` at a time."""
    numbers = iter(range(count))

    async def worker() -> None:
        for i in numbers:
            await send(i)

    await asyncio.gather(*(worker() for _ in range(parallel)))


async def test_client_chosen_values_leave_nothing_behind(
    start_proxy: Start, sims: list[SimServer]
) -> None:
    """Thousands of distinct session ids, request ids and prompts (prefix affinity on),
    unknown API keys, unknown models and unknown priorities: the affinity ledger keeps
    at most its ``max_keys``, no metric series names any of those values and the
    series are the same after the churn as after its first round, and once idle the
    proxy holds nothing and keeps at most one upstream connection per seat."""
    config = make_config(
        [s.url for s in sims],
        seats=SEATS,
        routing={"policy": "prefix_affinity", "affinity_header": "X-Session-Id"},
        model_aliases={"mini": "sim-model"},
    )
    proxy = await start_proxy(config)
    runtime = proxy.runtime
    ledger = runtime.dispatcher.seats.affinity.ledger
    ledger.max_keys = 64  # the default 4,096, made small enough to pass quickly
    before = set(asyncio.all_tasks())
    fds = open_fds()
    url = proxy.url
    statuses: dict[int, int] = {}

    async def send(i: int) -> None:
        kind = i % 5
        headers = {"X-Request-Id": f"churn-request-{i}", "X-Session-Id": f"churn-session-{i}"}
        body = chat(f"churn-prompt-{i}", model="sim-model")
        if kind == 1:
            headers["Authorization"] = f"Bearer churn-key-{i}"  # unknown: 401
        else:
            headers.update(AUTH)
        if kind == 2:
            body["model"] = f"churn-model-{i}"  # no such model: 404
        if kind == 3:
            headers["X-Priority"] = f"churn-priority-{i}"  # no such class: 400
        async with session.post(url + CHAT, json=body, headers=headers) as resp:
            await resp.read()
            statuses[resp.status] = statuses.get(resp.status, 0) + 1

    async with aiohttp.ClientSession() as session:
        await churn(send, 200)
    await settled(proxy, sims, before)
    first = series(await (await proxy.client.get("/metrics")).text())
    async with aiohttp.ClientSession() as session:
        await churn(send, 2000)
    await settled(proxy, sims, before)
    metrics = await (await proxy.client.get("/metrics")).text()
    assert statuses == {200: 880, 401: 440, 404: 440, 400: 440}
    assert "churn-" not in metrics
    assert series(metrics) == first
    assert ledger.warm_keys() <= ledger.max_keys
    assert runtime.dispatcher.pool_models() <= {"sim-model"}
    for sim in sims:
        # The proxy's pool keeps a connection per seat used at once, the prober one.
        assert upstream_connections(sim.port) <= SEATS + 1
    assert open_fds() <= fds + 2 * len(sims) * (SEATS + 1)


async def test_clients_that_leave_at_every_step_leak_nothing(
    start_proxy: Start, sims: list[SimServer]
) -> None:
    """Forty rounds of clients that give up: while queued and while their seat waits
    for a first byte that never comes (the replicas hang), then mid-stream (after the
    first chunk). After each round every seat and queue place is back, the replicas
    run nothing (the proxy closed their requests), and at the end no task is left
    over and each replica keeps at most one connection per seat (plus the prober)."""
    config = make_config(
        [s.url for s in sims],
        seats=SEATS,
        budgets=LONG,
        health={"interval_ms": 50},
        # The seat of a request cancelled while the replica worked is held this long
        # (the grace's timer is part of what must not leak); short, for 80 rounds.
        timeouts={"cancel_grace_ms": 20},
    )
    proxy = await start_proxy(config)
    await wait_for(lambda: all(r.serving for r in proxy.runtime.pool.replicas))
    runtime = proxy.runtime
    before = set(asyncio.all_tasks())
    fds = open_fds()
    seats = SEATS * len(sims)
    url = proxy.url
    keys = itertools.cycle([KEY_A, KEY_B])
    async with aiohttp.ClientSession() as session:

        async def post(body: dict[str, Any]) -> aiohttp.ClientResponse:
            headers = {"Authorization": f"Bearer {next(keys)}"}
            return await session.post(url + CHAT, json=body, headers=headers)

        for sim in sims:
            await sim.set_faults(hang_before_first_byte_ms=-1)
        for _ in range(40):
            tasks = [asyncio.ensure_future(post(chat(stream=True))) for _ in range(seats + 4)]
            await wait_for(
                lambda: (
                    runtime.pool.total_inflight() == seats
                    and len(runtime.dispatcher.scheduler) == 4
                    and sum(s.state.in_flight for s in sims) == seats
                )
            )
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await settled(proxy, sims, before)
        for sim in sims:
            await sim.set_faults(hang_before_first_byte_ms=0)
        for _ in range(40):
            responses = [await post(chat(stream=True, max_tokens=4000)) for _ in range(seats)]
            for resp in responses:
                assert resp.status == 200
                assert await resp.content.readany()
            await wait_for(lambda: sum(s.state.in_flight for s in sims) == seats)
            for resp in responses:
                resp.close()
            await settled(proxy, sims, before)
    await settled(proxy, sims, before)
    for sim in sims:
        assert upstream_connections(sim.port) <= SEATS + 1
    assert open_fds() <= fds + 2 * len(sims) * (SEATS + 1)


async def test_clients_that_leave_in_observe_mode_leak_nothing(
    start_proxy: Start, sims: list[SimServer]
) -> None:
    """``mode: observe`` forwards what enforcing would queue on overflow seats: rounds
    of clients that leave while all of them wait for a first byte leave no overflow
    count, seat or task behind."""
    config = make_config(
        [s.url for s in sims], seats=SEATS, budgets=LONG, mode="observe",
        timeouts={"cancel_grace_ms": 20},
    )  # fmt: skip
    proxy = await start_proxy(config)
    runtime = proxy.runtime
    before = set(asyncio.all_tasks())
    sent = SEATS * len(sims) + 4
    async with aiohttp.ClientSession() as session:
        for sim in sims:
            await sim.set_faults(hang_before_first_byte_ms=-1)
        for _ in range(20):
            tasks = [
                asyncio.ensure_future(session.post(proxy.url + CHAT, json=chat(), headers=AUTH))
                for _ in range(sent)
            ]
            await wait_for(lambda: sum(s.state.in_flight for s in sims) == sent)
            assert len(runtime.dispatcher._overflow) == 4
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await settled(proxy, sims, before)


async def test_clients_that_leave_while_their_retry_waits_leak_nothing(
    start_proxy: Start, sims: list[SimServer]
) -> None:
    """r0 answers every request 503, r1 hangs: a request that failed on r0 waits, as a
    retry, for r1's one seat (held by another hanging request). Rounds of clients that
    leave then (the retry waiting, the other waiting for a first byte) leave no retry
    waiting, seat or task behind."""
    config = make_config(
        [s.url for s in sims], seats=1, budgets=LONG,
        timeouts={"cancel_grace_ms": 20},
        health={"eject_after_failures": 100_000},
        retry={"base_backoff_ms": 1, "max_backoff_ms": 2, "max_attempts": 3,
               "budget_ratio": 1.0, "min_retries_per_s": 1000},
    )  # fmt: skip
    proxy = await start_proxy(config)
    runtime = proxy.runtime
    await wait_for(lambda: all(r.serving for r in runtime.pool.replicas))
    before = set(asyncio.all_tasks())
    await sims[0].set_faults(error_rate=1.0, error_status=503)
    await sims[1].set_faults(hang_before_first_byte_ms=-1)
    async with aiohttp.ClientSession() as session:

        def post() -> asyncio.Future[aiohttp.ClientResponse]:
            return asyncio.ensure_future(session.post(proxy.url + CHAT, json=chat(), headers=AUTH))

        for _ in range(15):
            holder = post()
            await wait_for(lambda: sims[1].state.in_flight == 1)
            retrying = post()
            await wait_for(lambda: len(runtime.dispatcher._reseating) == 1)
            for task in (retrying, holder):
                task.cancel()
            await asyncio.gather(retrying, holder, return_exceptions=True)
            await settled(proxy, sims, before)
