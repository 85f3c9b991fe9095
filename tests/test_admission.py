"""Queues, seats and layered timeouts end to end: a real proxy before a fake upstream."""

from __future__ import annotations

import asyncio
import json
import random
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import pytest

from proxy.settings import Config
from tests.conftest import ProxyUnderTest
from tests.helpers import KEY_A, KEY_B, handshake_never_completes, make_config, wait_for
from tests.upstreams import Upstream

Start = Callable[..., Awaitable[ProxyUnderTest]]
CHAT = "/v1/chat/completions"
AUTH = {"Authorization": f"Bearer {KEY_A}"}


def one_seat(upstream_url: str, **sections: Any) -> Config:
    tenants = {
        "a": {"api_keys": [KEY_A], "queue_capacity": 2},
        "b": {"api_keys": [KEY_B], "queue_capacity": 2},
    }
    return make_config([upstream_url], seats=1, tenants=tenants, **sections)


async def test_overload_one_seat_queue_of_two(start_proxy: Start, upstream_url: str) -> None:
    """1 seat, tenant queue 2, 8 concurrent requests: 3 served, 5 refused tenant_queue_full."""
    proxy = await start_proxy(one_seat(upstream_url))

    async def call() -> tuple[int, str | None, str | None]:
        resp = await proxy.client.post(CHAT, json={"hang_ms": 300}, headers=AUTH)
        await resp.read()
        return resp.status, resp.headers.get("X-Admission-Reason"), resp.headers.get("Retry-After")

    results = await asyncio.gather(*(call() for _ in range(8)))
    served = [r for r in results if r[0] == 200]
    refused = [r for r in results if r[0] == 429]
    assert len(served) == 3 and len(refused) == 5, results
    assert all(reason == "tenant_queue_full" for _, reason, _ in refused)
    assert all(ra is not None and 1 <= int(ra) <= 60 for _, _, ra in refused)
    proxy.assert_idle()


async def test_queue_timeout_at_the_budget(start_proxy: Start, upstream_url: str) -> None:
    """A queued request behind a busy seat gets 503 queue_timeout when queue_ms ends."""
    proxy = await start_proxy(one_seat(upstream_url, budgets={"queue_ms": 300}))
    holder = asyncio.ensure_future(proxy.client.post(CHAT, json={"hang_ms": 2500}, headers=AUTH))
    await wait_for(lambda: proxy.runtime.pool.total_inflight() == 1)
    started = time.monotonic()
    resp = await proxy.client.post(CHAT, json={}, headers=AUTH)
    waited = time.monotonic() - started
    assert resp.status == 503
    assert resp.headers["X-Admission-Reason"] == "queue_timeout"
    assert 1 <= int(resp.headers["Retry-After"]) <= 60
    assert 0.3 <= waited < 1.5
    assert (await holder).status == 200
    proxy.assert_idle()


async def test_first_byte_timeout(start_proxy: Start, upstream_url: str) -> None:
    """A streaming request to a replica that hangs before the first byte: 504."""
    proxy = await start_proxy(make_config([upstream_url], budgets={"first_byte_ms": 200}))
    started = time.monotonic()
    resp = await proxy.client.post(CHAT, json={"stream": True, "hang_ms": 3000}, headers=AUTH)
    assert resp.status == 504
    assert resp.headers["X-Admission-Reason"] == "first_byte_timeout"
    assert 0.2 <= time.monotonic() - started < 1.5
    await proxy.wait_idle()


async def test_total_timeout_bounds_a_non_streaming_request(
    start_proxy: Start, upstream_url: str
) -> None:
    """Non-streaming requests are bounded by the total budget alone: 504 total_timeout."""
    proxy = await start_proxy(make_config([upstream_url]))
    headers = {**AUTH, "X-Request-Timeout-Ms": "300"}
    resp = await proxy.client.post(CHAT, json={"hang_ms": 3000}, headers=headers)
    assert resp.status == 504
    assert resp.headers["X-Admission-Reason"] == "total_timeout"
    await proxy.wait_idle()


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def test_refused_connection_is_502(start_proxy: Start) -> None:
    """A replica that refuses connections: 502 upstream_connect_error."""
    config = make_config([f"http://127.0.0.1:{_closed_port()}"], warmup={"requests": 0})
    proxy = await start_proxy(config)
    resp = await proxy.client.post(CHAT, json={}, headers=AUTH)
    assert resp.status == 502
    assert resp.headers["X-Admission-Reason"] == "upstream_connect_error"
    proxy.assert_idle()


async def _sse_events(resp: aiohttp.ClientResponse) -> list[Any]:
    events = []
    async for line in resp.content:
        if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
            events.append(json.loads(line[6:]))
    return events


async def test_streams_event_by_event(start_proxy: Start, upstream_url: str) -> None:
    """SSE arrives as events while the upstream produces them; usage counted."""
    proxy = await start_proxy(make_config([upstream_url]))
    resp = await proxy.client.post(
        CHAT, json={"stream": True, "max_tokens": 4, "gap_ms": 20}, headers=AUTH
    )
    assert resp.status == 200
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    events = await _sse_events(resp)
    contents = [e["choices"][0]["delta"].get("content") for e in events if e["choices"]]
    assert contents == ["", "tok0 ", "tok1 ", "tok2 ", "tok3 "]
    proxy.assert_idle()


async def test_stream_cut_by_replica_ends_with_an_error_event(
    start_proxy: Start, upstream_url: str
) -> None:
    """The replica drops a stream mid-way: one SSE error event, then the stream ends."""
    proxy = await start_proxy(make_config([upstream_url]))
    resp = await proxy.client.post(
        CHAT, json={"stream": True, "max_tokens": 5, "cut_after": 2}, headers=AUTH
    )
    assert resp.status == 200
    events = await asyncio.wait_for(_sse_events(resp), timeout=5)
    assert events[-1]["error"]["code"] == "upstream_protocol_error"
    assert sum(1 for e in events if "choices" in e) == 3  # role chunk + 2 tokens
    proxy.assert_idle()


async def test_idle_gap_ends_the_stream_with_idle_timeout(
    start_proxy: Start, upstream_url: str
) -> None:
    """A gap between chunks longer than idle_ms: SSE error event idle_timeout."""
    proxy = await start_proxy(make_config([upstream_url], timeouts={"idle_ms": 100}))
    resp = await proxy.client.post(
        CHAT, json={"stream": True, "max_tokens": 3, "gap_ms": 400}, headers=AUTH
    )
    events = await asyncio.wait_for(_sse_events(resp), timeout=5)
    assert events[-1]["error"]["code"] == "idle_timeout"
    await proxy.wait_idle()


async def test_disconnect_while_queued_frees_the_place_at_once(
    start_proxy: Start, upstream_url: str
) -> None:
    """A client that leaves while queued: its queue place is freed at once."""
    proxy = await start_proxy(one_seat(upstream_url))
    holder = asyncio.ensure_future(proxy.client.post(CHAT, json={"hang_ms": 800}, headers=AUTH))
    await wait_for(lambda: proxy.runtime.pool.total_inflight() == 1)
    waiter = asyncio.ensure_future(proxy.client.post(CHAT, json={}, headers=AUTH))
    await wait_for(lambda: len(proxy.runtime.dispatcher.scheduler) == 1)
    waiter.cancel()
    await wait_for(lambda: len(proxy.runtime.dispatcher.scheduler) == 0, timeout_s=1.0)
    assert proxy.runtime.dispatcher.scheduler.depth("a") == 0
    assert (await holder).status == 200
    proxy.assert_idle()


async def test_disconnect_while_streaming_closes_the_upstream(
    start_proxy: Start, upstream_url: str, upstream_state: Upstream
) -> None:
    """A client that leaves mid-stream: the upstream connection is closed, the seat freed."""
    config = make_config([upstream_url], timeouts={"cancel_grace_ms": 50})
    proxy = await start_proxy(config)
    resp = await proxy.client.post(
        CHAT, json={"stream": True, "max_tokens": 200, "gap_ms": 10}, headers=AUTH
    )
    await resp.content.readline()
    resp.close()
    await wait_for(lambda: upstream_state.aborted == 1)
    await wait_for(lambda: proxy.runtime.pool.total_inflight() == 0)
    assert upstream_state.completed == 0
    proxy.assert_idle()


async def test_counters_return_to_zero_after_random_cancellations(
    start_proxy: Start, upstream_url: str
) -> None:
    """Hundreds of requests, some cancelled, some timing out: every counter ends at zero."""
    config = make_config(
        [upstream_url],
        seats=3,
        budgets={"queue_ms": 150, "first_byte_ms": 120},
        timeouts={"cancel_grace_ms": 20, "idle_ms": 80},
        tenants={
            "a": {"api_keys": [KEY_A], "queue_capacity": 8},
            "b": {"api_keys": [KEY_B], "queue_capacity": 8, "max_concurrency": 2},
        },
    )
    proxy = await start_proxy(config)
    rng = random.Random(7)
    statuses: list[int | str] = []

    async def one(i: int) -> None:
        key = KEY_A if i % 2 else KEY_B
        body = {
            "stream": rng.random() < 0.5,
            "max_tokens": rng.randint(1, 6),
            "gap_ms": rng.choice([0, 5, 100]),
            "hang_ms": rng.choice([0, 0, 20, 200]),
        }
        task = asyncio.ensure_future(
            proxy.client.post(CHAT, json=body, headers={"Authorization": f"Bearer {key}"})
        )
        if rng.random() < 0.3:
            await asyncio.sleep(rng.random() * 0.1)
            task.cancel()
            statuses.append("cancelled")
            return
        try:
            resp = await task
            await resp.read()
            statuses.append(resp.status)
        except aiohttp.ClientPayloadError:
            statuses.append("cut")

    for start in range(0, 300, 30):
        await asyncio.gather(*(one(i) for i in range(start, start + 30)))
    await wait_for(lambda: not proxy.runtime.active and proxy.runtime.pool.total_inflight() == 0)
    proxy.assert_idle()
    assert len(statuses) == 300
    assert {200, 429, 503, 504, "cancelled"} <= set(statuses)


async def test_connect_timeout_is_504(start_proxy: Start) -> None:
    """A replica whose accept backlog is full never completes the handshake: 504."""
    with handshake_never_completes() as port:
        config = make_config(
            [f"http://127.0.0.1:{port}"], timeouts={"connect_ms": 200}, warmup={"requests": 0}
        )
        proxy = await start_proxy(config)
        started = time.monotonic()
        resp = await proxy.client.post(CHAT, json={}, headers=AUTH)
        assert resp.status == 504
        assert resp.headers["X-Admission-Reason"] == "connect_timeout"
        assert 0.2 <= time.monotonic() - started < 1.5
        proxy.assert_idle()


async def test_client_closing_after_done_frees_the_seat_at_once(
    start_proxy: Start, upstream_url: str
) -> None:
    """A client that stops reading at data: [DONE] and closes before the chunked
    terminator got the whole answer: completed, and no cancel grace on the seat."""
    config = make_config([upstream_url], timeouts={"cancel_grace_ms": 5000})
    proxy = await start_proxy(config)
    reader, writer = await asyncio.open_connection(
        proxy.client.server.host, proxy.client.server.port
    )
    body = json.dumps({"stream": True, "max_tokens": 3, "tail_ms": 500}).encode()
    writer.write(
        f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY_A}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    await writer.drain()
    seen = b""
    async with asyncio.timeout(5):
        while b"data: [DONE]" not in seen:
            seen += await reader.read(65536)
    writer.transport.abort()
    await wait_for(lambda: not proxy.runtime.active, timeout_s=2)
    await wait_for(lambda: proxy.runtime.pool.total_inflight() == 0, timeout_s=2)
    metrics = await (await proxy.client.get("/metrics")).text()
    assert 'outcome="cancelled"' not in metrics
    assert 'outcome="completed"' in metrics


async def test_a_kept_alive_connection_the_replica_dropped_is_resent_not_failed(
    start_proxy: Start, upstream_url: str, upstream_state: Upstream
) -> None:
    """The replica closes a pooled connection after a stream (as llama-server does):
    the next request on it is sent again on a new connection, in the same attempt,
    with no retry, no error and no mark against the replica."""
    proxy = await start_proxy(make_config([upstream_url], retry={"max_attempts": 1}))
    stream = {"messages": [], "max_tokens": 2, "stream": True, "stale_after": True}
    for _ in range(3):
        async with proxy.client.post(CHAT, json=stream, headers=AUTH) as first:
            assert first.status == 200
            await first.read()
        second = await proxy.client.post(CHAT, json={"messages": [], "max_tokens": 2}, headers=AUTH)
        assert second.status == 200, await second.text()
    assert upstream_state.stale_hits == 1, "a dead connection once, then no more"
    replica = proxy.runtime.pool.replicas[0]
    assert replica.failures == 0 and not replica.ejected
    # From the first drop on, streamed requests ask the replica to close instead.
    streamed = [h.get("Connection") for h in upstream_state.seen if "X-Request-Id" in h]
    assert replica.drops_kept_alive and streamed[-2] == "close" and streamed[-1] != "close"
    await wait_for(lambda: proxy.runtime.pool.total_inflight() == 0)
    proxy.assert_idle()


async def test_a_dropped_connection_is_not_resent_on_other_routes(
    start_proxy: Start, upstream_url: str, upstream_state: Upstream
) -> None:
    """Outside inference routes a repeated POST may have side effects: the failure
    stands; a GET is safe to send again."""
    config = make_config([upstream_url], retry={"max_attempts": 1}, routes=["/v1"])
    proxy = await start_proxy(config)
    stream = {"messages": [], "max_tokens": 2, "stream": True, "stale_after": True}
    async with proxy.client.post(CHAT, json=stream, headers=AUTH) as first:
        await first.read()
    other = await proxy.client.post("/v1/other", data=b"x", headers=AUTH)
    assert upstream_state.stale_hits == 1
    assert other.status == 502
    assert other.headers["X-Admission-Reason"] == "upstream_protocol_error"
    # A safe method may be repeated anywhere: a GET on a dropped connection is resent.
    async with proxy.client.post(CHAT, json=stream, headers=AUTH) as again:
        await again.read()
    listing = await proxy.client.get("/v1/other", headers=AUTH)
    assert upstream_state.stale_hits == 2 and listing.status == 200
    await wait_for(lambda: proxy.runtime.pool.total_inflight() == 0)
    proxy.assert_idle()


@pytest.mark.parametrize("path", ["/completion", "/embedding", "/v1/rerank"])
async def test_a_dropped_connection_is_resent_on_engine_routes(
    start_proxy: Start, upstream_url: str, upstream_state: Upstream, path: str
) -> None:
    """llama.cpp's own API and the embedding and rerank routes only compute, as the
    inference routes do: a request that meets a kept-alive connection the replica
    dropped (llama-server does after each of its streams, ``/completion``'s too) is
    sent again on a new one, not failed with a 502; streams then ask for ``close``."""
    proxy = await start_proxy(make_config([upstream_url], retry={"max_attempts": 1}))
    stream = {"messages": [], "max_tokens": 2, "stream": True, "stale_after": True}
    async with proxy.client.post(CHAT, json=stream, headers=AUTH) as first:
        await first.read()
    engine = await proxy.client.post(path, json={"prompt": "x", "n_predict": 2}, headers=AUTH)
    assert engine.status == 200, await engine.text()
    assert upstream_state.stale_hits == 1
    replica = proxy.runtime.pool.replicas[0]
    assert replica.failures == 0 and replica.drops_kept_alive
    await wait_for(lambda: proxy.runtime.pool.total_inflight() == 0)
    proxy.assert_idle()


async def test_cost_without_max_tokens_is_the_tenants_recent_mean_output(
    start_proxy: Start, upstream_url: str
) -> None:
    """A request naming no output limit is charged its tenant's mean output so far
    (40 tokens after answers of 40), not a constant; a tenant with no history
    yet is charged 256, and an explicit max_tokens is charged as asked."""
    proxy = await start_proxy(make_config([upstream_url]))
    dispatcher = proxy.runtime.dispatcher
    charged: list[tuple[str, float]] = []
    enqueue = dispatcher.enqueue

    def spy(tenant: str, priority: str, cost: float, deadline: Any, **named: Any) -> Any:
        charged.append((tenant, cost))
        return enqueue(tenant, priority, cost, deadline, **named)

    dispatcher.enqueue = spy  # type: ignore[method-assign]
    for _ in range(3):
        resp = await proxy.client.post(CHAT, json={"max_tokens": 40}, headers=AUTH)
        assert resp.status == 200
        await resp.read()
    no_limit = json.dumps({"messages": []}).encode()
    prompt = len(no_limit) // 4
    for key in (KEY_A, KEY_B):
        resp = await proxy.client.post(
            CHAT,
            data=no_limit,
            headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
        )
        assert resp.status == 200
        await resp.read()
    explicit = len(json.dumps({"max_tokens": 40}).encode()) // 4 + 40
    assert charged == [("a", explicit)] * 3 + [("a", prompt + 40.0), ("b", prompt + 256.0)]
    proxy.assert_idle()


async def test_a_seat_given_up_on_stays_taken_for_the_cancel_grace(
    start_proxy: Start, upstream_url: str
) -> None:
    """The proxy's own first-byte timeout closes the upstream connection, but the engine
    may go on running the attempt until it notices: the seat stays taken for
    ``cancel_grace_ms``, as after a client's leave, so the next queued request does not
    join an engine still busy with the abandoned one. Then it is back."""
    config = make_config(
        [upstream_url], seats=1,
        budgets={"first_byte_ms": 200, "queue_ms": 30_000, "total_ms": 60_000},
        timeouts={"cancel_grace_ms": 5000},
    )  # fmt: skip
    proxy = await start_proxy(config)
    resp = await proxy.client.post(CHAT, json={"stream": True, "hang_ms": 3000}, headers=AUTH)
    assert resp.status == 504 and resp.headers["X-Admission-Reason"] == "first_byte_timeout"
    await wait_for(lambda: not proxy.runtime.active)
    assert proxy.runtime.pool.total_inflight() == 1  # well within the 5 s grace
    queued = asyncio.ensure_future(proxy.client.post(CHAT, json={}, headers=AUTH))
    await wait_for(lambda: len(proxy.runtime.dispatcher.scheduler) == 1)
    resp = await queued  # granted once the grace is over
    assert resp.status == 200
    await proxy.wait_idle()
