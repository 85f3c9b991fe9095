"""The entrance: every proxied request starts and ends here.

``handle`` identifies the tenant, its class and its deadline, reads the body
within ``entrance_ms``, hands the request to ``forward``, and is the one place
where a ``ProxyError`` becomes an HTTP response. It writes the request's end
into its record exactly once, whatever happened (``finally``), which is what
makes "every request ends exactly once with one outcome" hold.

Order of checks (DESIGN section 12): 401, 400 (headers), 403, 413 on
Content-Length, rate limit, body read (408, 413, 400), then admission.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import time
from typing import Any

import structlog
from aiohttp import web
from multidict import CIMultiDictProxy

from proxy.admitted import BYTES_PER_TOKEN, Admitted
from proxy.deadline import Deadline
from proxy.errors import (
    BadRequest,
    BodyTooLarge,
    EntranceTimeout,
    PriorityNotAllowed,
    ProxyError,
    RateLimited,
    ShuttingDown,
    Unauthenticated,
)
from proxy.estimators import DEFAULT_OUTPUT_TOKENS
from proxy.forward import forward
from proxy.keys import RUNTIME
from proxy.record import RequestRecord
from proxy.runtime import Rules, Runtime
from proxy.settings import ANONYMOUS_REJECT, hash_api_key

log = structlog.get_logger(__name__)

#: Routes whose body is JSON the proxy reads (cost, streaming) and whose repeat is safe.
INFERENCE_PATHS = frozenset(
    {"/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/generate", "/generate_stream"}
)
#: Routes that do no GPU work: authenticated, but no queue and no seat.
SEATLESS_PATHS = frozenset({"/v1/models", "/tokenize", "/detokenize"})
#: Estimated cost is capped so one request cannot claim the whole fair share.
MAX_ESTIMATED_COST = 4096
MAX_REQUEST_ID_LEN = 128
RETRY_AFTER_MIN_S, RETRY_AFTER_MAX_S = 1, 60
READ_CHUNK = 64 * 1024


def retry_after_header(seconds: float) -> str:
    """Whole seconds, rounded up, clamped to 1..60 (client SDKs ignore larger)."""
    return str(min(RETRY_AFTER_MAX_S, max(RETRY_AFTER_MIN_S, math.ceil(seconds))))


def error_response(err: ProxyError, record: RequestRecord) -> web.Response:
    body = {"error": {"message": err.message, "type": "admission_error", "code": err.reason}}
    headers = {
        "X-Request-Id": record.request_id,
        "X-Admission-Reason": err.reason,
        "Server-Timing": record.server_timing(),
    }
    if err.status in (429, 503):
        headers["Retry-After"] = retry_after_header(err.retry_after_s or 1.0)
    if isinstance(err, ShuttingDown):
        headers["Connection"] = "close"
    return web.json_response(body, status=err.status, headers=headers)


def request_id_of(request: web.Request) -> str:
    """The client's ``X-Request-Id`` when it is 1 to 128 visible ASCII characters."""
    given = request.headers.get("X-Request-Id", "")
    if 0 < len(given) <= MAX_REQUEST_ID_LEN and all(33 <= ord(c) <= 126 for c in given):
        return given
    return os.urandom(16).hex()  # as unique as uuid4, a third of the cost


async def handle(request: web.Request) -> web.StreamResponse:
    runtime = request.app[RUNTIME]
    rules = runtime.rules  # one snapshot for the request's whole life
    record = RequestRecord(
        request_id=request_id_of(request),
        arrival=runtime.clock.now(),
        method=request.method,
        path=request.path,
    )
    record.wall_arrival_ns = time.time_ns()
    record.trace = runtime.telemetry.tracing.start_request(request.headers, record)
    runtime.enter(record)
    try:
        admitted = await _admit(request, rules, runtime, record)
        return await forward(request, admitted, rules, runtime, record)
    except ProxyError as err:
        record.fail(err)
        return error_response(err, record)
    except asyncio.CancelledError:
        # A client that left after the whole answer (at ``data: [DONE]``,
        # before the chunked terminator) was served, not cancelled.
        if not record.upstream_done:
            record.cancel()
        raise
    except Exception:
        log.exception("unhandled error", request_id=record.request_id)
        record.status, record.outcome, record.reason = 500, "failed", "internal_error"
        return web.json_response(
            {"error": {"message": "internal error", "type": "admission_error",
                       "code": "internal_error"}},
            status=500,
            headers={"X-Request-Id": record.request_id},
        )  # fmt: skip
    finally:
        runtime.leave(record)
        record.end(runtime.clock.now())
        runtime.telemetry.request_ended(record)


async def _admit(
    request: web.Request, rules: Rules, runtime: Runtime, record: RequestRecord
) -> Admitted:
    config = rules.config
    headers = request.headers
    tenant = _identify(headers, rules)
    record.tenant = tenant
    tenant_config = config.tenants[tenant]
    priority = _priority(headers, rules, tenant_config.priority)
    record.priority = priority
    # The default class is always allowed: only another one needs the set.
    if priority != tenant_config.priority and priority not in tenant_config.classes():
        raise PriorityNotAllowed(f"tenant {tenant!r} may not use priority {priority!r}")
    client_timeout_ms = _client_timeout_ms(headers)
    server = config.server
    max_body = server.max_body_bytes
    content_length = request.content_length
    if content_length is not None and content_length > max_body:
        raise BodyTooLarge(f"body of {content_length} bytes exceeds {max_body}")
    wait_s = runtime.quotas.try_take(tenant)
    if wait_s > 0:
        raise RateLimited(f"tenant {tenant!r} is over its request rate", retry_after_s=wait_s)
    budgets = rules.budgets[tenant]
    arrival = record.arrival
    deadline = Deadline.start(arrival, budgets, client_timeout_ms)
    record.first_byte_budget_ms = float(budgets.first_byte_ms)
    record.total_budget_ms = (deadline.total_at - arrival) * 1000.0
    entrance_until = arrival + server.entrance_ms / 1000.0
    body = await _read_body(request, max_body, entrance_until, runtime)
    path = record.path
    inference = path in INFERENCE_PATHS
    doc = _parse_json(body) if inference and body else None
    seatless = record.method in ("GET", "HEAD") or path in SEATLESS_PATHS
    streaming = path == "/generate_stream" or (isinstance(doc, dict) and doc.get("stream") is True)
    record.streaming = streaming
    record.entrance_done = runtime.clock.now()
    return Admitted(
        tenant=tenant,
        priority=priority,
        deadline=deadline,
        body=body,
        streaming=streaming,
        seatless=seatless,
        inference=inference,
        cost=estimate_cost(body, doc, runtime.output_tokens.expected(tenant)),
    )


def _identify(headers: CIMultiDictProxy[str], rules: Rules) -> str:
    key = headers.get("X-API-Key")
    auth = headers.get("Authorization")
    if key is None and auth is not None:
        scheme, _, value = auth.partition(" ")
        if scheme.lower() == "bearer" and value.strip():
            key = value.strip()
    if key is None:
        anonymous = rules.config.anonymous
        if anonymous == ANONYMOUS_REJECT:
            raise Unauthenticated("an API key is required (Authorization: Bearer or X-API-Key)")
        return anonymous
    tenant = rules.keys.get(hash_api_key(key))
    if tenant is None:
        raise Unauthenticated("unknown API key")
    return tenant


def _priority(headers: CIMultiDictProxy[str], rules: Rules, default: str) -> str:
    asked = headers.get("X-Priority")
    if asked is None:
        return default
    asked = asked.strip().lower()
    if asked not in rules.config.priorities:
        known = ", ".join(sorted(rules.config.priorities))
        raise BadRequest(f"unknown priority {asked!r}; known: {known}")
    return asked


def _client_timeout_ms(headers: CIMultiDictProxy[str]) -> int | None:
    value = headers.get("X-Request-Timeout-Ms")
    if value is None:
        return None
    value = value.strip()
    if not value.isdigit() or int(value) <= 0:
        raise BadRequest("X-Request-Timeout-Ms must be a positive integer of milliseconds")
    return int(value)


async def _read_body(request: web.Request, max_body: int, until: float, runtime: Runtime) -> bytes:
    """The whole body by ``until`` (the entrance budget), never more than ``max_body`` bytes."""
    if not request.body_exists:
        return b""
    content = request.content
    if content.is_eof():  # small bodies arrive with the headers: no timer needed
        body = content.read_nowait()
        if len(body) > max_body:
            raise BodyTooLarge(f"body exceeds {max_body} bytes")
        return body
    budget_s = until - runtime.clock.now()
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(max(0.0, budget_s)):
            while chunk := await content.readany():
                size += len(chunk)
                if size > max_body:
                    raise BodyTooLarge(f"body exceeds {max_body} bytes")
                chunks.append(chunk)
    except TimeoutError as exc:
        raise EntranceTimeout(f"request body not received within {budget_s * 1000:.0f} ms") from exc
    return b"".join(chunks)


def _parse_json(body: bytes) -> Any:
    try:
        return json.loads(body)
    except ValueError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from exc


def estimate_cost(body: bytes, doc: Any, expected_output: float = DEFAULT_OUTPUT_TOKENS) -> float:
    """Prompt tokens (bytes / 4) plus the output limit, capped (DESIGN section 12).

    A request that names no limit is charged ``expected_output``: its tenant's
    recent mean output (``OutputTokens``), corrected when it ends.
    """
    output: Any = None
    if isinstance(doc, dict):
        output = doc.get("max_tokens") or doc.get("max_completion_tokens")
        params = doc.get("parameters")
        if output is None and isinstance(params, dict):
            output = params.get("max_new_tokens")
    if not isinstance(output, int) or output <= 0:
        output = expected_output
    return float(min(MAX_ESTIMATED_COST, len(body) // BYTES_PER_TOKEN + output))
