"""The fairness benchmark's traffic: open-loop Poisson flows of streamed chat requests.

A ``Flow`` is one tenant's arrivals at a fixed mean rate. Its arrival times,
prompt lengths and output lengths come from a generator seeded by the flow's
name only, so a flow sends exactly the same requests in every scenario it
appears in (the victim alone, next to a neighbour, next to an aggressor, with
or without the proxy): the scenarios differ in their neighbours, never in the
victim's own luck. Which replica a request goes to when there is no proxy
comes from a second generator, so routing never shifts the arrivals.

Each request is streamed, and its TTFT is measured here, at the client: from
just before the request is sent to the first SSE ``data:`` event whose
``choices[0].delta.content`` is not empty (the role-only opening delta does
not count), as docs/REFERENCE.md defines it for the proxy. The proxy's own
queue wait is read from its ``Server-Timing`` header. Every request ends as
one ``Result``; nothing is retried.

Every loop is bounded: arrivals stop at the run's length, each request has a
client timeout, and whatever is still open ``drain_s`` after the last arrival
is cancelled and recorded as ``unfinished``.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass

import aiohttp

from bench.load import DONE, Arrivals, refusal_reason, sse_data

PATH = "/v1/chat/completions"
MODEL = "sim-model"
#: Mirrors the simulator's prompt estimate (about four characters a token).
CHARS_PER_TOKEN = 4
UNFINISHED = "unfinished"
WORD = "lorem "


@dataclass(frozen=True, slots=True)
class Shape:
    """Request sizes, the same distribution for every flow."""

    prompt_words: tuple[int, int]
    max_tokens: tuple[int, int]

    def draw(self, rng: random.Random) -> tuple[bytes, int, int]:
        """A request body, its prompt tokens (as the engine counts them) and its output."""
        content = WORD * rng.randint(*self.prompt_words)
        max_tokens = rng.randint(*self.max_tokens)
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens,
            "stream": True,
        }
        return json.dumps(body).encode(), max(1, len(content) // CHARS_PER_TOKEN), max_tokens


@dataclass(frozen=True, slots=True)
class Flow:
    """One tenant's open-loop arrivals; ``name`` seeds them and labels the results."""

    name: str
    tenant: str
    api_key: str
    rate_per_s: float
    priority: str | None = None

    def headers(self) -> dict[str, str]:
        headers = {"Authorization": f"Bearer {self.api_key}", "Content-Type": "application/json"}
        if self.priority is not None:
            headers["X-Priority"] = self.priority
        return headers


@dataclass(slots=True)
class Result:
    """One request: when it was due, what it asked for, and how it ended."""

    flow: str
    #: Sent as ``X-Request-Id``: the proxy's access log names the request by it.
    request_id: str
    #: Scheduled send time, seconds from the start of the run.
    due_s: float
    prompt_tokens: int
    max_tokens: int
    status: int = 0
    #: ``""`` when served in full; else the proxy's ``X-Admission-Reason``,
    #: ``status N``, ``stream_error``, an exception name or ``unfinished``.
    reason: str = UNFINISHED
    ttft_s: float | None = None
    total_s: float | None = None
    #: When the first token arrived, seconds from the start of the run.
    first_token_s: float | None = None
    queue_ms: float | None = None
    #: How late the load generator sent it (its own event-loop lag), in ms.
    late_ms: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.reason

    @property
    def cost(self) -> int:
        """Tokens the request is charged in the end: prompt plus output."""
        return self.prompt_tokens + self.max_tokens


def _has_content(payload: bytes) -> bool:
    try:
        event = json.loads(payload)
    except ValueError:
        return False
    choices = event.get("choices") if isinstance(event, dict) else None
    if not choices or not isinstance(choices[0], dict):
        return False
    delta = choices[0].get("delta")
    return isinstance(delta, dict) and bool(delta.get("content"))


def server_timing_ms(header: str | None, name: str) -> float | None:
    """``dur`` of one metric in a ``Server-Timing`` header (``queue;dur=12.5, ...``)."""
    if not header:
        return None
    for part in header.split(","):
        metric, _, params = part.strip().partition(";")
        if metric == name and params.startswith("dur="):
            try:
                return float(params[4:])
            except ValueError:
                return None
    return None


async def send(
    session: aiohttp.ClientSession,
    url: str,
    headers: dict[str, str],
    body: bytes,
    result: Result,
    t0: float,
) -> None:
    """Send one streamed request and fill ``result`` in; never raises but CancelledError."""
    sent = time.perf_counter()
    result.late_ms = (sent - t0 - result.due_s) * 1000.0
    try:
        async with session.post(url, data=body, headers=headers) as response:
            result.status = response.status
            if response.status != 200:
                await response.read()
                result.reason = refusal_reason(response)
                return
            result.queue_ms = server_timing_ms(response.headers.get("Server-Timing"), "queue")
            reason = "truncated"
            async for payload in sse_data(response):
                if payload == DONE:
                    reason = ""
                    break
                if payload.startswith(b'{"error"'):
                    reason = "stream_error"
                    break
                if result.ttft_s is None and _has_content(payload):
                    now = time.perf_counter()
                    result.ttft_s = now - sent
                    result.first_token_s = now - t0
            result.reason = reason
            result.total_s = time.perf_counter() - sent
    except (aiohttp.ClientError, TimeoutError) as exc:
        result.reason = type(exc).__name__


async def drive(
    session: aiohttp.ClientSession,
    flows: Sequence[Flow],
    targets: Sequence[str],
    shape: Shape,
    seconds: float,
    drain_s: float,
) -> list[Result]:
    """Run every flow for ``seconds`` against ``targets`` (base URLs, one picked at random).

    Returns every request's result, in order of sending per flow.
    """
    results: list[Result] = []

    async def arrivals(flow: Flow, launcher: Arrivals) -> None:
        rng = random.Random(f"arrivals:{flow.name}")
        route = random.Random(f"route:{flow.name}")
        headers = flow.headers()
        due = 0.0
        while True:
            due += rng.expovariate(flow.rate_per_s)
            if due >= seconds:
                return
            body, prompt_tokens, max_tokens = shape.draw(rng)
            url = targets[route.randrange(len(targets))] + PATH
            await launcher.until(due)
            result = Result(
                flow.name, f"{flow.name}-{len(results)}", due, prompt_tokens, max_tokens
            )
            results.append(result)
            request_headers = {**headers, "X-Request-Id": result.request_id}
            launcher.launch(send(session, url, request_headers, body, result, launcher.t0))

    async with Arrivals(drain_s) as launcher:
        await asyncio.gather(*(arrivals(flow, launcher) for flow in flows))
    return results
