"""The relay's timeouts after the commit point, end to end: a real proxy before a fake upstream.

``upstream.AnswerReader`` bounds every read of a streamed answer with one
timer for the whole answer, re-armed as the reads go on: a stream that keeps
flowing for many idle periods is never cut, a stall longer than ``idle_ms``
is, and the total deadline cuts a stream that is still flowing. Each ends in
one SSE error event with its reason code.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import pytest

from proxy.admitted import Deadline
from proxy.clock import MonotonicClock
from proxy.upstream import AnswerReader
from tests.conftest import ProxyUnderTest
from tests.helpers import KEY_A, make_config, sse_tokens, wait_for

Start = Callable[..., Awaitable[ProxyUnderTest]]
CHAT = "/v1/chat/completions"
AUTH = {"Authorization": f"Bearer {KEY_A}"}


async def _events(resp: aiohttp.ClientResponse) -> list[dict[str, Any]]:
    events = []
    async for line in resp.content:
        if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
            events.append(json.loads(line[6:]))
    return events


async def test_stall_after_a_flowing_stream_ends_it_with_idle_timeout(
    start_proxy: Start, upstream_url: str
) -> None:
    """Tokens 20 ms apart for longer than several idle periods, then a stall of 4x idle_ms:
    every token before the stall arrives, then one SSE error event idle_timeout."""
    proxy = await start_proxy(make_config([upstream_url], timeouts={"idle_ms": 500}))
    body = {"stream": True, "max_tokens": 60, "gap_ms": 20, "pause_after": 50, "pause_ms": 2000}
    resp = await proxy.client.post(CHAT, json=body, headers=AUTH)
    assert resp.status == 200
    events = await asyncio.wait_for(_events(resp), timeout=20)
    assert sse_tokens(events) == [f"tok{i} " for i in range(50)]
    assert events[-1]["error"]["code"] == "idle_timeout"
    await proxy.wait_idle()


async def test_stream_flowing_for_many_idle_periods_completes(
    start_proxy: Start, upstream_url: str
) -> None:
    """Tokens 20 ms apart for about 8x idle_ms: never an idle timeout, every token arrives."""
    proxy = await start_proxy(make_config([upstream_url], timeouts={"idle_ms": 200}))
    body = {"stream": True, "max_tokens": 80, "gap_ms": 20}
    resp = await proxy.client.post(CHAT, json=body, headers=AUTH)
    events = await asyncio.wait_for(_events(resp), timeout=20)
    assert sse_tokens(events) == [f"tok{i} " for i in range(80)]
    assert not any("error" in e for e in events)
    proxy.assert_idle()


async def test_total_deadline_mid_stream_ends_it_with_total_timeout(
    start_proxy: Start, upstream_url: str
) -> None:
    """A stream still flowing when total_ms runs out (idle_ms far longer): some tokens,
    then one SSE error event total_timeout."""
    config = make_config(
        [upstream_url],
        budgets={"queue_ms": 200, "first_byte_ms": 500, "total_ms": 1000},
        timeouts={"idle_ms": 10_000},
    )
    proxy = await start_proxy(config)
    body = {"stream": True, "max_tokens": 400, "gap_ms": 20}
    resp = await proxy.client.post(CHAT, json=body, headers=AUTH)
    assert resp.status == 200
    events = await asyncio.wait_for(_events(resp), timeout=20)
    assert 0 < len(sse_tokens(events)) < 400
    assert events[-1]["error"]["code"] == "total_timeout"
    await proxy.wait_idle()


async def test_a_client_leaving_as_a_read_times_out_stays_a_cancellation(
    upstream_url: str,
) -> None:
    """The reader's timer fires while it waits on a silent replica, and the client's
    disconnect cancels the handler in the same loop iteration: the relay's pattern
    (``ran_out`` after a ``CancelledError``) must let the client's cancellation go on,
    not take it back as the reader's own and carry on as a timeout."""
    clock = MonotonicClock()
    body = {"stream": True, "max_tokens": 3, "pause_after": 0, "pause_ms": 30_000}
    readers: list[AnswerReader] = []
    async with (
        aiohttp.ClientSession() as session,
        session.post(upstream_url + CHAT, json=body) as resp,
    ):

        async def relay_like() -> str:
            now = clock.now()
            deadline = Deadline(arrival=now, total_at=now + 100, queue_s=1, first_byte_s=1)
            reader = AnswerReader(resp, deadline, clock, idle_s=50)  # this task's reader
            readers.append(reader)
            try:
                while await reader.read():
                    pass
            except asyncio.CancelledError:
                if not reader.ran_out():
                    raise
                return "taken as the reader's timeout"
            finally:
                reader.close()
            return "ended"

        task = asyncio.create_task(relay_like())
        # Waiting in read() on the replica's silence (it pauses before its first token).
        await wait_for(lambda: bool(readers) and readers[0]._reading and not resp.content._buffer)
        reader = readers[0]
        handle = reader._handle
        assert handle is not None
        handle.cancel()
        reader._armed = reader._until  # this read's timer is due now
        reader._fire()
        task.cancel()  # the client left in the same iteration
        with pytest.raises(asyncio.CancelledError):
            await task
