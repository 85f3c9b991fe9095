"""``mode: observe``: nothing queued or refused, every would-be refusal named and counted.

The dispatcher on a fake clock first (which checks run, on which numbers),
then the real proxy in front of a gated upstream whose requests end only when
the test opens the gate, so "running at the same time" needs no timing.
"""

from __future__ import annotations

import asyncio
import io
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from aiohttp import web
from aiohttp.test_utils import TestServer

from proxy.admitted import Deadline
from proxy.clock import FakeClock
from proxy.dispatch import Dispatcher, TenantLimits
from proxy.errors import PredictedWaitExceedsBudget
from proxy.replicas import Replica, ReplicaName, ReplicaPool
from proxy.scheduler import FairScheduler, Ticket
from proxy.settings import BudgetsConfig, ReplicaConfig, load_config
from tests.conftest import ProxyUnderTest
from tests.helpers import KEY_A, samples_by_label, wait_for

Start = Callable[..., Awaitable[ProxyUnderTest]]
ServerFactory = Callable[..., Awaitable[TestServer]]
BUDGETS = BudgetsConfig(queue_ms=1000, first_byte_ms=1000, total_ms=60000)
CHAT = "/v1/chat/completions"
AUTH = {"Authorization": f"Bearer {KEY_A}"}


def _dispatcher(clock: FakeClock, limits: TenantLimits, seats: int = 1) -> Dispatcher:
    replica = Replica(ReplicaConfig(name="r0", url="http://127.0.0.1:1", max_concurrency=seats))
    scheduler = FairScheduler({"interactive": 8.0, "standard": 3.0, "batch": 1.0})
    return Dispatcher(ReplicaPool([replica]), scheduler, clock, {"a": limits})


def _enqueue(d: Dispatcher, clock: FakeClock) -> Ticket:
    return d.enqueue("a", "standard", 10.0, Deadline.start(clock.now(), BUDGETS))


async def test_observe_forwards_everything_and_names_queue_full() -> None:
    """One seat, queue_capacity 1: the first takes the seat, the second runs above the
    limit (enforce would queue it), the third and fourth would be tenant_queue_full; all
    four run now, nothing is queued, and every seat comes back."""
    clock = FakeClock()
    d = _dispatcher(clock, TenantLimits(max_concurrency=None, queue_capacity=1))
    d.set_observing(True)
    tickets = [_enqueue(d, clock) for _ in range(4)]
    assert all(t.seat is not None for t in tickets)
    assert [t.observed for t in tickets] == [
        None, None, "would_tenant_queue_full", "would_tenant_queue_full",
    ]  # fmt: skip
    assert len(d.scheduler) == 0 and d.pool.total_inflight() == 4 and d.inflight("a") == 4
    d.finish(tickets[1], tickets[1].seat)  # two overflow left: still over the capacity
    assert _enqueue(d, clock).observed == "would_tenant_queue_full"
    assert d.pool.total_inflight() == 4
    assert "3 running above the seat limits" in repr(d._overflow)


async def test_observe_names_the_tenant_cap_and_the_predicted_wait() -> None:
    """queue_capacity 0 at its cap: would_tenant_concurrency. After 20 seat times of 2 s on
    one seat, a request with a 1 s queue budget: would_predicted_wait_exceeds_budget (the
    same request enforcing is refused; both count 1 in the class's pressure)."""
    clock = FakeClock()
    d = _dispatcher(clock, TenantLimits(max_concurrency=1, queue_capacity=0))
    d.set_observing(True)
    held = _enqueue(d, clock)
    over = _enqueue(d, clock)
    assert (held.observed, over.observed) == (None, "would_tenant_concurrency")
    d.finish(over, over.seat)
    d.finish(held, held.seat)

    d = _dispatcher(clock, TenantLimits(max_concurrency=None, queue_capacity=8))
    for _ in range(20):
        ticket = _enqueue(d, clock)
        clock.advance(2.0)
        d.finish(ticket, ticket.seat)
    busy = _enqueue(d, clock)
    with pytest.raises(PredictedWaitExceedsBudget):
        _enqueue(d, clock)
    window = d.pressure._windows["standard"]
    assert window.totals[-1] == 1  # the refusal counts 1
    samples = sum(window.totals)
    d.set_observing(True)
    observed = _enqueue(d, clock)
    assert observed.observed == "would_predicted_wait_exceeds_budget"
    assert (window.totals[-1], sum(window.totals)) == (2, samples + 1)  # its would_ form too
    assert observed.seat is not None and d.pool.total_inflight() == 2
    d.finish(observed, observed.seat)
    d.finish(busy, busy.seat)
    assert d.pool.total_inflight() == 0


async def test_switching_modes_loses_nothing_in_flight() -> None:
    """Enforce with three queued: observe forwards them at once (the tenant's own cap
    included). Back to enforce: the overflow keeps running, a new ticket queues and gets a
    seat only once the seats are under the limit again."""
    clock = FakeClock()
    d = _dispatcher(clock, TenantLimits(max_concurrency=2, queue_capacity=8))
    running = _enqueue(d, clock)
    queued = [_enqueue(d, clock) for _ in range(3)]
    assert all(t.seat is None for t in queued) and len(d.scheduler) == 3
    d.set_observing(True)
    assert all(t.seat is not None for t in queued) and len(d.scheduler) == 0
    assert [await d.wait(t) for t in queued] == [t.seat for t in queued]
    assert d.pool.total_inflight() == 4
    d.set_observing(False)
    later = _enqueue(d, clock)
    assert later.seat is None and len(d.scheduler) == 1
    for ticket in [running, *queued[:2]]:
        d.finish(ticket, ticket.seat)
        assert later.seat is None  # one seat, still taken by the last overflow request
    d.finish(queued[2], queued[2].seat)
    assert later.seat is not None
    d.finish(later, await d.wait(later))
    assert d.pool.total_inflight() == 0 and d.total_inflight() == 0


async def test_a_retry_in_observe_mode_never_waits_for_a_seat() -> None:
    """No free seat: the retry takes one above the limit at once, preferring another
    replica than the one that failed it."""
    clock = FakeClock()
    replicas = [
        Replica(ReplicaConfig(name=f"r{i}", url="http://127.0.0.1:1", max_concurrency=1))
        for i in range(2)
    ]
    limits = {"a": TenantLimits(max_concurrency=None, queue_capacity=4)}
    d = Dispatcher(ReplicaPool(replicas), FairScheduler({"standard": 1.0}), clock, limits)
    d.set_observing(True)
    holders = [_enqueue(d, clock) for _ in range(2)]
    failed_on = holders[0].seat.replica.name if holders[0].seat else None
    assert failed_on is not None
    seat = await asyncio.wait_for(d.reseat(frozenset({ReplicaName(failed_on)}), 5.0), 1.0)
    assert seat.replica.name != failed_on and seat.replica.inflight == 2
    d.release(seat)


# --------------------------------------------------------------------------- end to end


class Gate:
    """A replica whose chat requests end only when the test opens the gate."""

    def __init__(self) -> None:
        self.open = asyncio.Event()
        self.active = 0
        self.served = 0

    async def chat(self, request: web.Request) -> web.Response:
        self.active += 1
        try:
            await request.read()
            await self.open.wait()
            self.served += 1
            return web.json_response({"choices": [], "usage": {"completion_tokens": 1}})
        finally:
            self.active -= 1

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post(CHAT, self.chat)
        app.router.add_get("/health", self.health)
        return app


def _document(url: str, mode: str, **tenant: Any) -> dict[str, Any]:
    return {
        "mode": mode,
        "replicas": [{"name": "r0", "url": url, "max_concurrency": 1}],
        "warmup": {"requests": 0},
        "budgets": {"queue_ms": 20000, "first_byte_ms": 20000, "total_ms": 60000},
        "tenants": {"a": {"api_keys": [KEY_A], "queue_capacity": 1, **tenant}},
    }


def _write(path: Path, document: dict[str, Any]) -> None:
    path.write_text(yaml.safe_dump(document))


def _observed(text: str) -> dict[str, float]:
    return samples_by_label(text, "admission_observed_refusals_total", "reason")


async def test_observe_mode_refuses_nothing_and_counts_every_would_be_refusal(
    start_proxy: Start, aiohttp_server: ServerFactory, tmp_path: Path
) -> None:
    """One seat, queue_capacity 1, a rate of one request a minute (burst 1), six requests
    held at the replica together: all six are forwarded and answered 200; the second is
    would_rate_limited (first check enforcing fails), the third to sixth too (the rate
    comes first); the access lines say which and the counter adds up."""
    gate = Gate()
    server = await aiohttp_server(gate.app())
    url = str(server.make_url("")).rstrip("/")
    path = tmp_path / "proxy.yaml"
    _write(path, _document(url, "observe", rate_per_s=1 / 60))
    log = io.StringIO()
    proxy = await start_proxy(load_config(path), access_log=log)
    calls = []
    for i in range(6):
        calls.append(asyncio.ensure_future(proxy.client.post(CHAT, json={}, headers=AUTH)))
        await wait_for(lambda n=i + 1: gate.active == n)  # type: ignore[misc]
    assert proxy.runtime.pool.total_inflight() == 6 and len(proxy.runtime.dispatcher.scheduler) == 0
    gate.open.set()
    assert [r.status for r in await asyncio.gather(*calls)] == [200] * 6
    metrics = await (await proxy.client.get("/metrics")).text()
    assert _observed(metrics) == {"would_rate_limited": 5.0}
    lines = [json.loads(line) for line in log.getvalue().splitlines()]
    assert sorted(str(line["observed"]) for line in lines) == ["None"] + ["would_rate_limited"] * 5
    assert {line["outcome"] for line in lines} == {"completed"}
    proxy.assert_idle()


async def test_observe_mode_counts_queue_full_end_to_end(
    start_proxy: Start, aiohttp_server: ServerFactory, tmp_path: Path
) -> None:
    """No rate limit: of five held together, the first takes the seat, the second runs
    where enforcing would queue it, the last three would be tenant_queue_full."""
    gate = Gate()
    server = await aiohttp_server(gate.app())
    url = str(server.make_url("")).rstrip("/")
    path = tmp_path / "proxy.yaml"
    _write(path, _document(url, "observe"))
    proxy = await start_proxy(load_config(path))
    calls = []
    for i in range(5):
        calls.append(asyncio.ensure_future(proxy.client.post(CHAT, json={}, headers=AUTH)))
        await wait_for(lambda n=i + 1: gate.active == n)  # type: ignore[misc]
    state = await (await proxy.client.get("/admin/state")).json()
    assert state["replicas"]["r0"]["inflight"] == 5 and state["tenants"]["a"]["queued"] == 0
    gate.open.set()
    assert [r.status for r in await asyncio.gather(*calls)] == [200] * 5
    metrics = await (await proxy.client.get("/metrics")).text()
    assert _observed(metrics) == {"would_tenant_queue_full": 3.0}
    proxy.assert_idle()


async def test_switching_by_reload_loses_nothing_in_flight(
    start_proxy: Start, aiohttp_server: ServerFactory, tmp_path: Path
) -> None:
    """Enforce, one seat: one request runs, one waits in the queue. Reload to observe: the
    queued one is forwarded at once and two more go straight through. Reload to enforce
    while all four run: a fifth waits in the queue again. Every one is answered 200."""
    gate = Gate()
    server = await aiohttp_server(gate.app())
    url = str(server.make_url("")).rstrip("/")
    path = tmp_path / "proxy.yaml"
    _write(path, _document(url, "enforce", queue_capacity=8))
    proxy = await start_proxy(load_config(path), config_path=str(path))
    dispatcher = proxy.runtime.dispatcher
    calls = [asyncio.ensure_future(proxy.client.post(CHAT, json={}, headers=AUTH))]
    await wait_for(lambda: gate.active == 1)
    calls.append(asyncio.ensure_future(proxy.client.post(CHAT, json={}, headers=AUTH)))
    await wait_for(lambda: len(dispatcher.scheduler) == 1)

    _write(path, _document(url, "observe", queue_capacity=8))
    assert (await (await proxy.client.post("/admin/reload")).json())["result"] == "ok"
    await wait_for(lambda: gate.active == 2)
    assert len(dispatcher.scheduler) == 0
    for n in (3, 4):
        calls.append(asyncio.ensure_future(proxy.client.post(CHAT, json={}, headers=AUTH)))
        await wait_for(lambda n=n: gate.active == n)  # type: ignore[misc]

    _write(path, _document(url, "enforce", queue_capacity=8))
    assert (await (await proxy.client.post("/admin/reload")).json())["result"] == "ok"
    calls.append(asyncio.ensure_future(proxy.client.post(CHAT, json={}, headers=AUTH)))
    await wait_for(lambda: len(dispatcher.scheduler) == 1)
    assert gate.active == 4 and proxy.runtime.pool.total_inflight() == 4

    gate.open.set()
    assert [r.status for r in await asyncio.gather(*calls)] == [200] * 5
    assert gate.served == 5
    proxy.assert_idle()


async def _observing_a_day_quota_of_60(
    start_proxy: Start,
    aiohttp_server: ServerFactory,
    tmp_path: Path,
    access_log: io.StringIO | bool = True,
) -> tuple[Gate, ProxyUnderTest]:
    """A proxy in observe mode in front of an open gate; tenant a: 60 tokens a day."""
    gate = Gate()
    gate.open.set()
    server = await aiohttp_server(gate.app())
    url = str(server.make_url("")).rstrip("/")
    path = tmp_path / "proxy.yaml"
    _write(path, _document(url, "observe", token_quota={"per_day": 60}))
    return gate, await start_proxy(load_config(path), access_log=access_log)


async def test_observe_mode_forwards_a_request_over_its_token_quota(
    start_proxy: Start, aiohttp_server: ServerFactory, tmp_path: Path
) -> None:
    """A token quota of 60 a day: the first request's estimate (its prompt and 10
    tokens) is charged; the second's (100 tokens) does not fit, so enforcing would
    answer 429 token_quota_exceeded; in observe mode it is forwarded and answered
    200, counted would_token_quota_exceeded, and charged nothing."""
    log = io.StringIO()
    gate, proxy = await _observing_a_day_quota_of_60(start_proxy, aiohttp_server, tmp_path, log)
    statuses = []
    for max_tokens in (10, 100):
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens}
        async with proxy.client.post(CHAT, json=body, headers=AUTH) as resp:
            statuses.append(resp.status)
    assert statuses == [200, 200] and gate.served == 2
    metrics = await (await proxy.client.get("/metrics")).text()
    assert _observed(metrics) == {"would_token_quota_exceeded": 1.0}
    lines = [json.loads(line) for line in log.getvalue().splitlines()]
    assert [line["observed"] for line in lines] == [None, "would_token_quota_exceeded"]
    assert lines[0]["quota_charged_tokens"] > 0 and lines[1]["quota_charged_tokens"] is None
    proxy.assert_idle()


async def test_observe_mode_answers_over_quota_with_the_ratelimit_headers(
    start_proxy: Start, aiohttp_server: ServerFactory, tmp_path: Path
) -> None:
    """A token quota of 60 a day: the second request does not fit. Forwarded in observe
    mode, its answer still carries the x-ratelimit-* token headers (enforcing's 429 would),
    counting the first request's charge only."""
    _, proxy = await _observing_a_day_quota_of_60(start_proxy, aiohttp_server, tmp_path)
    remaining = []
    for max_tokens in (10, 100):
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens}
        async with proxy.client.post(CHAT, json=body, headers=AUTH) as resp:
            assert resp.status == 200
            assert resp.headers.get("x-ratelimit-limit-tokens") == "60"
            remaining.append(int(resp.headers["x-ratelimit-remaining-tokens"]))
    state = await (await proxy.client.get("/admin/state")).json()
    assert remaining[1] == state["tenants"]["a"]["quota"]["day"]["remaining"] < 60
    proxy.assert_idle()


async def test_observe_mode_charges_no_quota_to_a_request_over_its_rate(
    start_proxy: Start, aiohttp_server: ServerFactory, tmp_path: Path
) -> None:
    """A rate of one a minute and a token quota: the second request would be
    rate_limited, which enforcing refuses before charging anything. Observed, it is
    charged nothing either (the quota keeps enforcing's numbers) and its answer carries
    the request and token headers."""
    gate = Gate()
    gate.open.set()
    server = await aiohttp_server(gate.app())
    url = str(server.make_url("")).rstrip("/")
    path = tmp_path / "proxy.yaml"
    _write(path, _document(url, "observe", rate_per_s=1 / 60, token_quota={"per_day": 1000}))
    log = io.StringIO()
    proxy = await start_proxy(load_config(path), access_log=log)
    headers = []
    for _ in range(2):
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10}
        async with proxy.client.post(CHAT, json=body, headers=AUTH) as resp:
            assert resp.status == 200
            headers.append(resp.headers)
    lines = [json.loads(line) for line in log.getvalue().splitlines()]
    assert [line["observed"] for line in lines] == [None, "would_rate_limited"]
    assert lines[0]["quota_charged_tokens"] > 0 and lines[1]["quota_charged_tokens"] is None
    assert headers[1]["x-ratelimit-remaining-requests"] == "0"
    used = lines[0]["quota_actual_tokens"]
    assert headers[1]["x-ratelimit-remaining-tokens"] == str(1000 - used)
    state = await (await proxy.client.get("/admin/state")).json()
    assert state["tenants"]["a"]["quota"]["day"]["used"] == used
    proxy.assert_idle()
