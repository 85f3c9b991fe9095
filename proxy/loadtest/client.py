"""One load-test request over HTTP, and the bodies and session it uses.

Owns ``make_session`` (an explicitly sized connector: aiohttp's default of
100 connections would quietly cap a closed loop at 100 and queue the rest in
the client, where no report sees it), ``send_one`` (one request, measured),
and the request bodies (``build_spec``).

TTFT is measured from the first SSE ``data:`` event with non-empty content,
read line by line: the same definition as the proxy's (``proxy.sse.has_token``),
so a role-only first delta or a keep-alive comment never counts. A
non-streaming answer's TTFT is its whole latency: that is when its first
token reaches the client. Queue wait
comes from the proxy's ``Server-Timing: queue;dur=`` when present, else from
an engine's ``x-queue-time`` (TGI and the simulator).

``send_one`` never raises for what the target did: every failure becomes a
countable ``RequestResult.error``. Only cancellation propagates.
"""

from __future__ import annotations

import json
import random
import re
import time
from collections.abc import Mapping
from typing import Any

import aiohttp
from yarl import URL

from proxy.loadtest.results import RequestResult, RequestSpec
from proxy.sse import has_token, usage_from_body

__all__ = [
    "ENDPOINTS",
    "build_spec",
    "make_session",
    "prompt_text",
    "queue_wait",
    "send_one",
]

#: Endpoint names accepted on the command line and in workload files.
ENDPOINTS: Mapping[str, str] = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
}
#: Three-letter words: about one token each for BPE tokenizers, and four
#: characters with the separator, which is the simulator's chars-per-token.
_WORDS = (
    "the", "and", "for", "you", "not", "are", "but", "can", "all", "any",
    "was", "one", "our", "out", "day", "get", "has", "him", "his", "how",
    "man", "new", "now", "old", "see", "two", "way", "who", "boy", "did",
    "its", "let", "put", "say", "she", "too", "use", "art", "big", "car",
)  # fmt: skip
#: Longest SSE line or error body read; longer lines mean this is not an SSE stream.
_READ_BUFSIZE = 1 << 20
_SERVER_TIMING_QUEUE = re.compile(r"(?:^|,)\s*queue\s*;\s*dur=([0-9.]+)")


def make_session(
    max_connections: int, request_timeout_s: float, connect_timeout_s: float = 10.0
) -> aiohttp.ClientSession:
    """A session whose pool holds ``max_connections`` open at once, and no more."""
    connector = aiohttp.TCPConnector(limit=max_connections, limit_per_host=0)
    timeout = aiohttp.ClientTimeout(total=request_timeout_s, sock_connect=connect_timeout_s)
    return aiohttp.ClientSession(
        connector=connector,
        timeout=timeout,
        cookie_jar=aiohttp.DummyCookieJar(),
        read_bufsize=_READ_BUFSIZE,
    )


def prompt_text(tokens: int, rng: random.Random) -> str:
    """A prompt of about ``tokens`` tokens; random words, so no prefix cache hides work."""
    return " ".join(rng.choice(_WORDS) for _ in range(max(1, tokens))) + "."


def build_spec(
    *,
    endpoint: str,
    model: str,
    input_tokens: int,
    max_tokens: int,
    rng: random.Random,
    stream: bool = True,
    ignore_eos: bool = False,
    headers: Mapping[str, str] | None = None,
    tenant: str = "",
    request_class: str = "",
    phase: str = "",
) -> RequestSpec:
    """A ready-to-send OpenAI request (chat or completions) with a fresh prompt."""
    path = ENDPOINTS[endpoint]
    prompt = prompt_text(input_tokens, rng)
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "stream": stream}
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if stream:
        body["stream_options"] = {"include_usage": True}
    if ignore_eos:
        body["ignore_eos"] = True  # vLLM/SGLang: generate exactly max_tokens
    return RequestSpec(
        path=path,
        body=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **(headers or {})},
        input_tokens=input_tokens,
        max_tokens=max_tokens,
        stream=stream,
        tenant=tenant,
        request_class=request_class,
        phase=phase,
    )


def queue_wait(headers: Mapping[str, str]) -> tuple[float | None, str | None]:
    """Queue wait in ms and where it came from: the proxy, the engine, or nowhere."""
    timing = headers.get("Server-Timing")
    if timing:
        match = _SERVER_TIMING_QUEUE.search(timing)
        if match:
            return float(match[1]), "proxy"
    engine = headers.get("x-queue-time")
    if engine:
        try:
            return float(engine), "engine"
        except ValueError:
            return None, None
    return None, None


#: Resends of a request whose pooled connection turned out dead (see below).
STALE_RESENDS = 4
#: Servers seen closing kept-alive connections (scheme://host:port): later
#: requests to them ask for ``Connection: close``, so no dead one is pooled.
_DROPS_KEPT_ALIVE: set[str] = set()


async def request_resending_stale(
    session: aiohttp.ClientSession,
    method: str,
    url: str,
    body: bytes | None = None,
    headers: Mapping[str, str] | None = None,
) -> aiohttp.ClientResponse:
    """Send, and send again when a kept-alive connection was closed under us.

    llama.cpp's server closes the connection after each streamed answer while
    advertising keep-alive; the next request on it fails before any answer.
    That is the client's pool, not the replica's capacity: counting it as an
    error would end every staircase at its first level. A refused connection
    is not retried; a server seen doing it gets ``Connection: close`` from
    then on, so none of its dead connections reach the pool again.
    """
    origin = str(URL(url).origin())
    if origin in _DROPS_KEPT_ALIVE:  # seen dropping: never pool its connections
        headers = {**(headers or {}), "Connection": "close"}
    resends = STALE_RESENDS
    while True:
        try:
            return await session.request(method, url, data=body, headers=headers)
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
            if not resends or isinstance(exc, aiohttp.ClientConnectorError):
                raise
            resends -= 1
            _DROPS_KEPT_ALIVE.add(origin)


async def send_one(
    session: aiohttp.ClientSession,
    base_url: str,
    spec: RequestSpec,
    *,
    index: int,
    zero: float,
    due_at: float | None = None,
) -> RequestResult:
    """Send ``spec`` and measure it; times are seconds since ``zero`` (``perf_counter``)."""
    result = RequestResult(
        index=index,
        started_at=time.perf_counter() - zero,
        input_tokens=spec.input_tokens,
        tenant=spec.tenant,
        request_class=spec.request_class,
        phase=spec.phase,
        due_at=due_at,
    )
    try:
        resp = await request_resending_stale(
            session, "POST", base_url + spec.path, spec.body, spec.headers
        )
        async with resp:
            result.status = resp.status
            result.reason = resp.headers.get("X-Admission-Reason")
            result.queue_ms, result.queue_source = queue_wait(resp.headers)
            if not 200 <= resp.status < 300:
                await resp.read()
                result.error = f"http_{resp.status}"
            elif spec.stream and resp.content_type == "text/event-stream":
                await _read_stream(resp, result, zero, needs_done=spec.path in ENDPOINTS.values())
            else:
                # The whole answer is the first thing the client sees: TTFT is its latency.
                _, completion = usage_from_body(await resp.read())
                result.output_tokens = completion or 0
                result.ttft_s = time.perf_counter() - zero - result.started_at
    except aiohttp.ClientConnectorError:
        result.error = "connect_error"
    except aiohttp.ConnectionTimeoutError:
        result.error = "connect_timeout"
    except TimeoutError:
        result.error = "client_timeout"
    except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, aiohttp.ClientOSError):
        result.error = "stream_broken" if result.status is not None else "connection_error"
    except aiohttp.ClientError as exc:
        result.error = f"client_error:{type(exc).__name__}"
    finally:
        result.ended_at = time.perf_counter() - zero
    return result


async def _read_stream(
    resp: aiohttp.ClientResponse, result: RequestResult, zero: float, *, needs_done: bool
) -> None:
    """Read SSE events line by line: TTFT, token count, usage, a mid-stream error."""
    content_events = 0
    usage_tokens: int | None = None
    done = False
    async for line in resp.content:
        if not line.startswith(b"data:"):
            continue  # comments (keep-alives), event names, blank separators
        payload = line[5:].strip()
        if payload == b"[DONE]":
            done = True
            break
        if not payload:
            continue
        if result.ttft_s is not None and b'"usage"' not in payload and b'"error"' not in payload:
            content_events += 1  # after the first token, a cheap count is enough
            continue
        try:
            event = json.loads(payload)
        except ValueError:
            continue
        if isinstance(event, dict) and isinstance(event.get("error"), dict):
            code = event["error"].get("code") or event["error"].get("type") or "unknown"
            result.error = f"stream_error:{code}"
            return
        if has_token(event):
            content_events += 1
            if result.ttft_s is None:
                result.ttft_s = time.perf_counter() - zero - result.started_at
        usage_tokens = _usage_tokens(event, usage_tokens)
    result.output_tokens = usage_tokens if usage_tokens is not None else content_events
    if needs_done and not done:
        result.error = "stream_incomplete"


def _usage_tokens(event: object, current: int | None) -> int | None:
    if not isinstance(event, dict):
        return current
    usage = event.get("usage")
    if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
        return int(usage["completion_tokens"])
    details = event.get("details")  # TGI's last event
    if isinstance(details, dict) and isinstance(details.get("generated_tokens"), int):
        return int(details["generated_tokens"])
    return current
