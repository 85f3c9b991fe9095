"""Load generators for the benchmarks: closed loop and open loop, one client session.

Both send the same small request again and again and keep the latency of each
200 answer; anything else counts as an error. They run in the benchmark's own
process, so on a small machine they compete with the servers for CPU; the
benchmarks report the generator's own CPU per request beside the servers'.

- ``closed_loop``: N clients, each sending its next request when its last one
  ends (throughput at a fixed concurrency; p50 then follows from Little's law).
- ``open_loop``: requests leave at a fixed rate whatever the answers do
  (latency below saturation, not hidden by clients that wait).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp


@dataclass(slots=True)
class Sample:
    """Latencies (seconds, sorted) of the successful requests of one run."""

    latencies: list[float]
    errors: int
    elapsed_s: float
    #: Error counts by kind: ``"status 503"`` or the exception's class name.
    error_kinds: dict[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> int:
        return len(self.latencies)

    def rps(self) -> float:
        return self.ok / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def percentile_ms(self, q: float) -> float:
        return percentile(self.latencies, q) * 1000.0


def load_session(
    connections: int,
    *,
    total_s: float | None = None,
    connect_s: float | None = None,
) -> aiohttp.ClientSession:
    """The one client session a benchmark drives load through.

    ``connections`` open at once, to any one host (aiohttp's default of 100
    would queue requests inside the connector); ``total_s`` bounds each
    request, ``connect_s`` its connect; no cookies are kept.
    """
    connector = aiohttp.TCPConnector(limit=connections, limit_per_host=0)
    timeout = aiohttp.ClientTimeout(total=total_s, sock_connect=connect_s)
    return aiohttp.ClientSession(
        connector=connector, timeout=timeout, cookie_jar=aiohttp.DummyCookieJar()
    )


#: The last SSE payload of a stream that ended well.
DONE = b"[DONE]"


def refusal_reason(response: aiohttp.ClientResponse) -> str:
    """Why an answer that is not a 200 failed: the proxy's reason code, else its status."""
    return response.headers.get("X-Admission-Reason") or f"status {response.status}"


async def sse_data(response: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
    """The payload of every SSE ``data:`` line, up to and including ``[DONE]``."""
    async for line in response.content:
        if line.startswith(b"data:"):
            payload = line[5:].strip()
            yield payload
            if payload == DONE:
                return


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest rank: the smallest value with at least ``q`` of the values at or below it."""
    if not sorted_values:
        return float("nan")
    rank = max(1, min(len(sorted_values), -int(-len(sorted_values) * q // 1)))
    return sorted_values[rank - 1]


class Requester:
    """One request, sent and timed; the generators share it."""

    __slots__ = ("_body", "_headers", "_session", "_url", "error_kinds", "latencies")

    def __init__(
        self, session: aiohttp.ClientSession, url: str, body: bytes, headers: Mapping[str, str]
    ) -> None:
        self._session = session
        self._url = url
        self._body = body
        self._headers = dict(headers)
        self.latencies: list[float] = []
        self.error_kinds: dict[str, int] = {}

    async def send(self) -> None:
        sent = time.perf_counter()
        try:
            async with self._session.post(
                self._url, data=self._body, headers=self._headers
            ) as response:
                await response.read()
                error = None if response.status == 200 else f"status {response.status}"
        except (aiohttp.ClientError, TimeoutError) as exc:
            error = type(exc).__name__
        if error is None:
            self.latencies.append(time.perf_counter() - sent)
        else:
            self.error_kinds[error] = self.error_kinds.get(error, 0) + 1

    def sample(self, elapsed_s: float) -> Sample:
        kinds = dict(self.error_kinds)
        return Sample(sorted(self.latencies), sum(kinds.values()), elapsed_s, kinds)


async def closed_loop(requester: Requester, total: int, concurrency: int, cap_s: float) -> Sample:
    """``concurrency`` clients until ``total`` requests were sent or ``cap_s`` passed."""
    issued = 0
    start = time.perf_counter()
    stop_at = start + cap_s

    async def client() -> None:
        nonlocal issued
        while issued < total and time.perf_counter() < stop_at:
            issued += 1
            await requester.send()

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return requester.sample(time.perf_counter() - start)


async def open_loop(requester: Requester, total: int, rate: float, cap_s: float) -> Sample:
    """``total`` requests at ``rate`` per second, each on its own task.

    Timers are coarse (libuv counts milliseconds), so each wake-up sends every
    request that is due; latency runs from the actual send. Requests still in
    flight when sending ends are awaited; the time cap bounds the sending.
    """
    tasks: set[asyncio.Task[None]] = set()
    issued = 0
    start = time.perf_counter()
    stop_at = start + cap_s
    while issued < total:
        now = time.perf_counter()
        if now >= stop_at:
            break
        due = min(total, int((now - start) * rate) + 1)
        while issued < due:
            issued += 1
            task = asyncio.create_task(requester.send())
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        await asyncio.sleep(max(0.0, start + issued / rate - time.perf_counter()))
    sending_s = time.perf_counter() - start
    await asyncio.gather(*tasks)
    return requester.sample(sending_s)


class Arrivals:
    """Open-loop sending on a schedule: each request leaves at its due time on its own task.

    Use as ``async with Arrivals(drain_s) as arrivals:``; ``await
    arrivals.until(due_s)`` sleeps to a due time (seconds from ``t0``), then
    ``arrivals.launch(coroutine)`` sends. On leaving, what is still running
    gets ``drain_s`` to end (only when the block ended normally) and is then
    cancelled, so no request outlives its run.
    """

    __slots__ = ("_drain_s", "_tasks", "t0")

    def __init__(self, drain_s: float) -> None:
        self._drain_s = drain_s
        self._tasks: set[asyncio.Task[None]] = set()
        self.t0 = time.perf_counter()

    def __repr__(self) -> str:
        return f"<Arrivals {len(self._tasks)} in flight>"

    async def until(self, due_s: float) -> None:
        delay = self.t0 + due_s - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)

    def launch(self, send: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(send)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def __aenter__(self) -> Arrivals:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        try:
            if exc_type is None and self._tasks:
                await asyncio.wait(set(self._tasks), timeout=self._drain_s)
        finally:
            left = list(self._tasks)
            for task in left:
                task.cancel()
            await asyncio.gather(*left, return_exceptions=True)
