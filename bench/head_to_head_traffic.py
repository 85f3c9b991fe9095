"""The head-to-head benchmark's clients: streamed chat requests with a deadline.

Every client has the same deadline, the SLO's total time. It sends it as
``X-Request-Timeout-Ms`` (this proxy shortens its budget to it; HAProxy and
the replicas ignore it) and gives up when it passes: the request's task is
cancelled, which closes its connection, the way an impatient client does.
Nothing is retried.

TTFT runs from just before the request is sent to the first SSE ``data:``
event that carries content (``proxy.sse.has_token``: the role-only opening
delta does not count). A request is *on time* when its ``[DONE]`` arrived
before the deadline; its tokens are the ``usage`` the stream ends with.

Arrivals come from a generator seeded by the load multiple alone, so every
target sees exactly the same requests at the same offsets. Every loop is
bounded: arrivals stop at the phase's end, each request ends by its deadline,
and anything still open a little after that is cancelled as ``unfinished``.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass

import aiohttp

from bench.load import DONE, load_session, refusal_reason, sse_data
from proxy.loadtest.client import request_resending_stale
from proxy.sse import has_token

PATH = "/v1/chat/completions"
MODEL = "sim-model"
WORD = "lorem "
#: The simulator's prompt estimate: about four characters a token.
CHARS_PER_TOKEN = 4
UNFINISHED = "unfinished"
GAVE_UP_WAITING = "gave_up_waiting"
GAVE_UP_STREAMING = "gave_up_streaming"
#: Past its deadline, a request task gets this long to notice before it is cut.
CUT_AFTER_DEADLINE_S = 2.0
#: Open-loop requests must never wait for a pooled connection in the client.
CONNECTIONS = 2048


@dataclass(frozen=True, slots=True)
class Shape:
    """Request sizes, the same distribution for every target and load."""

    prompt_words: tuple[int, int]
    max_tokens: tuple[int, int]
    #: Exactly ``max_tokens`` out of a random-weight llama.cpp model (the simulator ignores it).
    ignore_eos: bool = False

    def body(self, rng: random.Random) -> tuple[bytes, int]:
        content = WORD * rng.randint(*self.prompt_words)
        max_tokens = rng.randint(*self.max_tokens)
        body: dict[str, object] = {
            "model": MODEL,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.ignore_eos:
            body["ignore_eos"] = True
        return json.dumps(body).encode(), max_tokens


@dataclass(frozen=True, slots=True)
class Arrival:
    #: Seconds from the start of the phase (its warm-up included).
    due_s: float
    #: False during the warm-up: such requests load the system but are not reported.
    measured: bool
    body: bytes
    max_tokens: int


def poisson_arrivals(
    rate: float, warmup_s: float, seconds: float, shape: Shape, seed: str
) -> list[Arrival]:
    """Open-loop arrivals at ``rate`` per second for ``warmup_s + seconds``."""
    rng = random.Random(seed)
    arrivals: list[Arrival] = []
    due = 0.0
    while True:
        due += rng.expovariate(rate)
        if due >= warmup_s + seconds:
            return arrivals
        body, max_tokens = shape.body(rng)
        arrivals.append(Arrival(due, due >= warmup_s, body, max_tokens))


@dataclass(slots=True)
class Outcome:
    """How one request ended, as its client saw it."""

    due_s: float
    measured: bool
    max_tokens: int
    status: int = 0
    #: ``""`` when ``[DONE]`` arrived before the deadline; else the proxy's
    #: ``X-Admission-Reason``, ``status N``, ``gave_up_*``, ``truncated``,
    #: ``stream_error``, an exception name or ``unfinished``.
    reason: str = UNFINISHED
    ttft_s: float | None = None
    total_s: float | None = None
    #: Completion tokens of an on-time answer (its ``usage``), else 0.
    tokens: int = 0
    #: How late the load generator sent it (its own event-loop lag), in ms.
    late_ms: float = 0.0

    @property
    def on_time(self) -> bool:
        return self.status == 200 and not self.reason


def make_session(connect_timeout_s: float) -> aiohttp.ClientSession:
    """A session sized for open loop; no total timeout (each request has its deadline)."""
    return load_session(CONNECTIONS, connect_s=connect_timeout_s)


async def send(
    session: aiohttp.ClientSession,
    url: str,
    headers: dict[str, str],
    arrival: Arrival,
    deadline_s: float,
    t0: float,
) -> Outcome:
    """One streamed request, given up at ``deadline_s``; never raises but CancelledError."""
    outcome = Outcome(arrival.due_s, arrival.measured, arrival.max_tokens)
    sent = time.perf_counter()
    outcome.late_ms = (sent - t0 - arrival.due_s) * 1000.0
    deadline = asyncio.timeout(deadline_s)
    try:
        async with deadline:
            await _exchange(session, url, headers, arrival.body, outcome, sent)
    except TimeoutError:
        if deadline.expired():
            outcome.reason = GAVE_UP_WAITING if outcome.ttft_s is None else GAVE_UP_STREAMING
            outcome.tokens = 0
        else:
            outcome.reason = "client_timeout"
    except aiohttp.ClientError as exc:
        outcome.reason = type(exc).__name__
    return outcome


async def _exchange(
    session: aiohttp.ClientSession,
    url: str,
    headers: dict[str, str],
    body: bytes,
    outcome: Outcome,
    sent: float,
) -> None:
    # llama-server drops a kept-alive connection after each stream: resend, as any client would.
    response = await request_resending_stale(session, "POST", url, body, headers)
    async with response:
        outcome.status = response.status
        if response.status != 200:
            await response.read()
            outcome.reason = refusal_reason(response)
            return
        reason = "truncated"
        async for payload in sse_data(response):
            if payload == DONE:
                reason = ""
                break
            if outcome.ttft_s is not None and b'"usage"' not in payload:
                if payload.startswith(b'{"error"'):
                    reason = "stream_error"
                    break
                continue  # after the first token, only the usage event matters
            try:
                event = json.loads(payload)
            except ValueError:
                continue
            if isinstance(event, dict) and "error" in event:
                reason = "stream_error"
                break
            if outcome.ttft_s is None and has_token(event):
                outcome.ttft_s = time.perf_counter() - sent
            usage = event.get("usage") if isinstance(event, dict) else None
            if isinstance(usage, dict):
                outcome.tokens = int(usage.get("completion_tokens") or 0)
        outcome.total_s = time.perf_counter() - sent
        outcome.reason = reason
        if reason:
            outcome.tokens = 0


async def open_loop(
    session: aiohttp.ClientSession,
    urls: Sequence[str],
    headers: dict[str, str],
    arrivals: Sequence[Arrival],
    deadline_s: float,
) -> list[Outcome]:
    """Send every arrival at its offset, round-robin over ``urls``; wait for all to end."""
    t0 = time.perf_counter()
    tasks: list[asyncio.Task[Outcome]] = []
    try:
        for index, arrival in enumerate(arrivals):
            delay = t0 + arrival.due_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            url = urls[index % len(urls)] + PATH
            tasks.append(asyncio.create_task(send(session, url, headers, arrival, deadline_s, t0)))
        if tasks:
            await asyncio.wait(tasks, timeout=deadline_s + CUT_AFTER_DEADLINE_S)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    outcomes: list[Outcome] = []
    for task, arrival in zip(tasks, arrivals, strict=False):
        if task.cancelled() or task.exception() is not None:
            outcomes.append(Outcome(arrival.due_s, arrival.measured, arrival.max_tokens))
        else:
            outcomes.append(task.result())
    return outcomes


async def closed_loop(
    session: aiohttp.ClientSession,
    urls: Sequence[str],
    headers: dict[str, str],
    clients: int,
    warmup_s: float,
    seconds: float,
    shape: Shape,
    deadline_s: float,
) -> tuple[int, int]:
    """``clients`` back-to-back senders (client i on ``urls[i % n]``).

    Returns the on-time completions that ended inside the measured window
    (after ``warmup_s``, for ``seconds``) and the failures of the whole run.
    """
    t0 = time.perf_counter()
    window = (t0 + warmup_s, t0 + warmup_s + seconds)
    completed = failed = 0

    async def client(index: int) -> None:
        nonlocal completed, failed
        rng = random.Random(f"closed:{index}")
        url = urls[index % len(urls)] + PATH
        while time.perf_counter() < window[1]:
            body, max_tokens = shape.body(rng)
            arrival = Arrival(time.perf_counter() - t0, True, body, max_tokens)
            outcome = await send(session, url, headers, arrival, deadline_s, t0)
            if not outcome.on_time:
                failed += 1
            elif window[0] <= time.perf_counter() <= window[1]:
                completed += 1

    await asyncio.gather(*(client(i) for i in range(clients)))
    return completed, failed
