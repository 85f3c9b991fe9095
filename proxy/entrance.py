"""The entrance: every proxied request starts and ends here.

``handle`` identifies the tenant, its class and its deadline, reads the body
within ``entrance_ms``, hands the request to its ``Exchange``, and is the one place
where a ``ProxyError`` becomes an HTTP response. It writes the request's end
into its record exactly once, whatever happened (``finally``), which is what
makes "every request ends exactly once with one outcome" hold.

Order of checks (docs/REFERENCE.md): 401, 400 (headers: ``X-Priority``, ``X-Request-Timeout-Ms``,
the path), 403, 404 ``route_not_allowed``, 413 on Content-Length, rate limit,
body read (408, 413, 400), 503 ``shutting_down``, then admission. The route
check comes after every header check so that a client without a valid key
learns nothing about which paths exist.

The path is normalised once, here (``paths.normalise_path``); every decision
below and the replica see that one string.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import sys
import time
from collections.abc import MutableMapping
from typing import Any

import structlog
from aiohttp import HttpVersion11, web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError
from multidict import CIMultiDictProxy

from proxy.admitted import BYTES_PER_TOKEN, Admitted, Deadline
from proxy.affinity import affinity_key
from proxy.config_tenants import TenantConfig
from proxy.degrade import DEGRADED_HEADER, MAX_TOKENS, cap_max_tokens
from proxy.engine_routes import (
    INFERENCE_PATHS,
    METERED_PATHS,
    PROMPT_ONLY_PATHS,
    output_limit,
    route_of,
    samples_per_prompt,
)
from proxy.errors import (
    BadRequest,
    BodyTooLarge,
    EntranceTimeout,
    InternalError,
    MethodNotAllowed,
    NoHealthyReplica,
    PriorityNotAllowed,
    ProxyError,
    RateLimited,
    RouteNotAllowed,
    ShuttingDown,
    TokenQuotaExceeded,
    Unauthenticated,
)
from proxy.estimators import DEFAULT_OUTPUT_TOKENS
from proxy.exchange import Exchange
from proxy.models import ModelRefusal
from proxy.observe import would
from proxy.paths import checked_query, forwardable, normalise_path
from proxy.quota_gate import TokenGate, admit_tokens, refusal_headers, settle, settled_headers
from proxy.quotas import RateTake
from proxy.record import RequestRecord
from proxy.runtime import RUNTIME, Rules, Runtime
from proxy.settings import ANONYMOUS_REJECT, hash_api_key

log = structlog.get_logger(__name__)

#: Routes that do no GPU work: authenticated, but no queue and no seat.
SEATLESS_PATHS = frozenset({"/v1/models", "/tokenize", "/detokenize"})
#: Estimated cost is capped so one request cannot claim the whole fair share.
MAX_ESTIMATED_COST = 4096
MAX_REQUEST_ID_LEN = 128
#: ``X-Request-Timeout-Ms`` digits: ten already allow 115 days.
MAX_TIMEOUT_DIGITS = 10
#: JSON nesting allowed in an inference body. Real requests nest a few levels;
#: deeper ones only cost parsing here and in the engine (whose parser may recurse).
MAX_JSON_DEPTH = 64
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_JSON_OBJECT_START = re.compile(rb"[ \t\r\n]*\{")
_NOT_BRACKET = bytes(b for b in range(256) if b not in b"[]{}")
_BRACKET_RUN = re.compile(rb"[\[{]+|[\]}]+")
RETRY_AFTER_MIN_S, RETRY_AFTER_MAX_S = 1, 60
#: A refused ``model`` is logged, cut to the longest name a config may hold.
MAX_MODEL_NAME_LOGGED = 256
READ_CHUNK = 64 * 1024


def retry_after_header(seconds: float) -> str:
    """Whole seconds, rounded up, clamped to 1..60 (client SDKs ignore larger)."""
    return str(min(RETRY_AFTER_MAX_S, max(RETRY_AFTER_MIN_S, math.ceil(seconds))))


#: The ``Server`` header of the proxy's own answers: the product, no versions (the app
#: sets it on the rest: ``app._server_header``).
SERVER_HEADER = "admission-proxy"


def error_response(
    err: ProxyError, record: RequestRecord, extra: dict[str, str] | None = None
) -> web.Response:
    headers = {"Server-Timing": record.server_timing(), **(extra or {})}
    if record.degraded is not None:
        headers[DEGRADED_HEADER] = record.degraded
    return error_answer(err, record.request_id, headers)


def error_answer(
    err: ProxyError, request_id: str, headers: dict[str, str] | None = None
) -> web.Response:
    """Section 6's error answer: the JSON body, ``X-Request-Id``, ``X-Admission-Reason``."""
    body = {"error": {"message": err.message, "type": "admission_error", "code": err.reason}}
    headers = {
        **(headers or {}),
        "X-Request-Id": request_id,
        "X-Admission-Reason": err.reason,
        "Server": SERVER_HEADER,
    }
    if isinstance(err, TokenQuotaExceeded) and err.window == "day":
        # Until 00:00 UTC: the one Retry-After that may exceed 60 s.
        headers["Retry-After"] = str(max(RETRY_AFTER_MIN_S, math.ceil(err.retry_after_s or 1.0)))
    elif err.status in (429, 503):
        headers["Retry-After"] = retry_after_header(err.retry_after_s or 1.0)
    if isinstance(err, ShuttingDown):
        headers["Connection"] = "close"
    if isinstance(err, MethodNotAllowed):
        headers["Allow"] = ", ".join(err.allow)
    return web.json_response(body, status=err.status, headers=headers)


async def expect_continue(request: web.Request) -> None:
    """Every route's ``Expect`` handler, run before the handler itself.

    ``100-continue`` is answered at once, as aiohttp does. Any other
    expectation is ignored, as nginx does (RFC 9110 section 10.1.1 allows
    it): aiohttp's own answer would be a plain-text 417 that quotes the
    value, with none of the proxy's headers. The header is never forwarded
    (``exchange.NOT_FORWARDED``): the proxy has the whole body by then.
    """
    if request.version < HttpVersion11:
        return
    if request.headers.get("Expect", "").strip().lower() == "100-continue":
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0  # the answer's own bytes are still to come


def bearer_token(authorization: str) -> str | None:
    """The token of ``Bearer <token>``, or None for any other form.

    The scheme is case-insensitive and may be followed by any run of spaces
    or tabs (RFC 7235 asks for one space; clients that write a tab are met
    the way Envoy and nginx meet them). Surrounding spaces and tabs are not
    part of the token.
    """
    if authorization.startswith("Bearer "):  # how nearly every client writes it
        return authorization[7:].strip(" \t") or None
    if authorization[:6].lower() != "bearer" or authorization[6:7] not in (" ", "\t"):
        return None
    return authorization[7:].strip(" \t") or None


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
        path=request.rel_url.raw_path,
    )
    record.wall_arrival_ns = time.time_ns()
    record.trace = runtime.telemetry.tracing.start_request(request.headers, record)
    runtime.enter(record)
    exchange: Exchange | None = None
    admitted: Admitted | None = None
    try:
        admitted = await _admit(request, rules, runtime, record)
        exchange = Exchange(request, admitted, rules, runtime, record)
        response = await exchange.run()
        if admitted.held is not None and not response.prepared:
            # A whole answer, not sent yet: its headers can count its real usage.
            await _settle_despite_cancel(runtime, admitted, exchange, record, response.headers)
        return response
    except ProxyError as err:
        record.fail(err)
        if record.entrance_done is None:  # refused at the entrance: all its time was there
            record.entrance_done = runtime.clock.now()
        limits = await _refusal_limits(runtime, rules, record, admitted, exchange)
        return error_response(err, record, limits)
    except asyncio.CancelledError:
        # A client that left after the whole answer (at ``data: [DONE]``,
        # before the chunked terminator) was served, not cancelled.
        if exchange is None or not exchange.upstream_done:
            record.cancel()
        raise
    except Exception:
        log.exception("unhandled error", request_id=record.request_id)
        internal = InternalError("internal error")
        record.fail(internal)
        return error_response(internal, record)
    finally:
        try:
            if admitted is not None and admitted.held is not None and not admitted.held.settled:
                await _settle_despite_cancel(runtime, admitted, exchange, record, None)
        finally:
            if runtime.grace_over and record.outcome == "cancelled":
                record.cut_by_shutdown()  # the proxy closed the connection, not the client
            runtime.leave(record)
            record.end(runtime.clock.now())
            runtime.telemetry.request_ended(record)


async def _settle_despite_cancel(
    runtime: Runtime,
    admitted: Admitted,
    exchange: Exchange | None,
    record: RequestRecord,
    headers: MutableMapping[str, str] | None,
) -> None:
    """The settlement, carried through a client that leaves meanwhile.

    It runs once the replica has answered, and with shared state it is a round trip:
    a client that closes its connection at ``data: [DONE]`` cancels the handler
    during it. Shielded, the correction still reaches the store (bounded by the
    store's own ``timeout_ms``) and the access line still counts it; the cancel is
    passed on once it is done. A second cancel (the shutdown's cut) is passed on
    at once, the correction finishing on its own.
    """
    settling = asyncio.ensure_future(_settle(runtime, admitted, exchange, record, headers))
    try:
        await asyncio.shield(settling)
    except asyncio.CancelledError:
        await asyncio.shield(settling)
        raise


async def _settle(
    runtime: Runtime,
    admitted: Admitted,
    exchange: Exchange | None,
    record: RequestRecord,
    headers: MutableMapping[str, str] | None,
) -> None:
    """The charge corrected to the real usage, once; ``headers`` then count it."""
    held = admitted.held
    assert held is not None
    remaining = await settle(
        runtime.token_quotas, held, exchange.relayed if exchange is not None else None
    )
    record.quota_actual_tokens = held.actual
    if remaining is not None and headers is not None:
        limits = dict(admitted.ratelimit or {})
        settled_headers(held, remaining, limits)
        headers.update(limits)


async def _refusal_limits(
    runtime: Runtime,
    rules: Rules,
    record: RequestRecord,
    admitted: Admitted | None,
    exchange: Exchange | None,
) -> dict[str, str] | None:
    """The ``x-ratelimit-*`` headers of a refused inference request of a limited tenant."""
    tenant = rules.config.tenants.get(record.tenant)
    if tenant is None or (tenant.rate_per_s is None and not tenant.token_quota.enabled):
        return None
    if route_of(record.path) not in METERED_PATHS:
        return None
    try:
        if admitted is not None and admitted.held is not None:
            headers: dict[str, str] = {}
            await _settle(runtime, admitted, exchange, record, headers)
            return {**(admitted.ratelimit or {}), **headers}
        return await refusal_headers(runtime.token_quotas, record.rate_take, record.tenant, tenant)
    except ProxyError:
        # The quota store failed again while the refusal was being answered (shared
        # state down with ``on_failure: reject``, which may be the refusal itself):
        # the refusal goes out without its token figures, never as a bare 500.
        return None


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
    client_timeout_ms = _client_timeout_ms(headers)
    path = record.path = normalise_path(record.path)
    query = checked_query(request.rel_url.raw_query_string)
    # The default class is always allowed: only another one needs the set.
    if priority != tenant_config.priority and priority not in tenant_config.classes():
        allowed = ", ".join(sorted(tenant_config.classes()))
        raise PriorityNotAllowed(f"this key may not use that priority class; allowed: {allowed}")
    if not forwardable(path, rules.routes):
        raise RouteNotAllowed("this path is not forwarded (see the routes setting)")
    server = config.server
    max_body = server.max_body_bytes
    content_length = request.content_length
    if content_length is not None and content_length > max_body:
        raise BodyTooLarge(f"body of {content_length} bytes exceeds {max_body}")
    rate = record.rate_take = await runtime.take_rate(tenant)
    if rate is not None and rate.wait_s > 0:
        if config.mode == "observe":
            record.observed = would(RateLimited.reason)
        else:
            raise RateLimited(
                f"tenant {tenant!r} is over its request rate", retry_after_s=rate.wait_s
            )
    budgets = rules.budgets[tenant]
    arrival = record.arrival
    deadline = Deadline.start(arrival, budgets, client_timeout_ms)
    record.first_byte_budget_ms = float(budgets.first_byte_ms)
    record.total_budget_ms = (deadline.total_at - arrival) * 1000.0
    entrance_until = arrival + server.entrance_ms / 1000.0
    body = await _read_body(request, max_body, entrance_until, runtime)
    route = route_of(path)
    inference = route in INFERENCE_PATHS
    method = record.method
    doc = None
    if inference and (body or method == "POST"):  # the method inference routes take
        doc = _parse_json(body)
    elif route in METERED_PATHS and body:
        doc = _json_object(body)  # read, not required: the engine judges any other body
    seatless = method in ("GET", "HEAD") or route in SEATLESS_PATHS
    streaming = route == "/generate_stream" or (isinstance(doc, dict) and doc.get("stream") is True)
    record.streaming = streaming
    record.samples_per_prompt = samples_per_prompt(doc)
    listing = (
        (route == "/v1/models" or route.startswith("/v1/models/"))
        and method == "GET"
        and runtime.models.pooled
    )
    routed = doc
    if doc is None and not inference and (body or method not in ("GET", "HEAD")) and not listing:
        routed = _model_document(body, runtime)  # any other route's model picks its pool too
    model, pool, body = _choose_pool(routed, body, tenant_config.allowed_models, runtime, record)
    if doc is not None and _degrading(priority, model, rules, runtime):
        capped = cap_max_tokens(doc, route, config.overload.max_tokens_cap or 0)
        if capped is not None:
            if model is not None and "model" in capped:
                capped["model"] = model  # the alias's target, as _choose_pool sent it
            doc, body = capped, json.dumps(capped).encode()
            record.degraded = MAX_TOKENS
    routing = config.routing
    affinity = None
    if doc is not None and routing.policy == "prefix_affinity":
        affinity = affinity_key(
            doc, headers, header=routing.affinity_header, prefix_chars=routing.affinity_prefix_chars
        )
    if runtime.shutting_down:  # seatless requests included: nothing new starts
        record.entrance_done = runtime.clock.now()
        raise ShuttingDown("the proxy is shutting down", retry_after_s=1.0)
    # A route that generates nothing (embeddings, reranking) costs its prompt alone.
    expected_output = 0.0 if route in PROMPT_ONLY_PATHS else runtime.output_tokens.expected(tenant)
    cost = estimate_cost(body, doc, expected_output)
    gate = None
    limited = tenant_config.token_quota.enabled or tenant_config.rate_per_s is not None
    if route in METERED_PATHS and not seatless and limited:
        if record.observed is not None:
            # Observed over its rate: enforcing refuses it before the quota, so it is not
            # charged (the quota keeps enforcing's numbers for the requests after it).
            gate = await _uncharged(body, runtime, rate, tenant, tenant_config)
        else:
            try:
                gate = await admit_tokens(
                    runtime.token_quotas, rate, tenant, tenant_config, route, doc, body,
                    expected_output, model,
                )  # fmt: skip
            except TokenQuotaExceeded:
                if config.mode != "observe":
                    raise
                # Observed, not refused: forwarded uncharged, as enforcing would charge
                # nothing; its answer carries the headers enforcing's refusal would.
                record.observed = would(TokenQuotaExceeded.reason)
                gate = await _uncharged(body, runtime, rate, tenant, tenant_config)
        if gate is not None:
            body = gate.body
            if gate.held is not None:
                record.quota_charged_tokens = gate.held.charge.tokens
    record.entrance_done = runtime.clock.now()
    return Admitted(
        tenant=tenant,
        priority=priority,
        deadline=deadline,
        body=body,
        streaming=streaming,
        seatless=seatless,
        inference=inference,
        cost=cost,
        path_qs=path + "?" + query if query else path,
        model=model,
        pool=pool,
        asked=routed.get("model") if model is None and isinstance(routed, dict) else ...,
        listing=listing,
        affinity=affinity,
        degraded=record.degraded,
        held=gate.held if gate is not None else None,
        strip_usage=gate is not None and gate.strip_usage,
        ratelimit=gate.headers if gate is not None else None,
    )


async def _uncharged(
    body: bytes, runtime: Runtime, rate: RateTake | None, tenant: str, config: TenantConfig
) -> TokenGate:
    """Observe mode: a request forwarded uncharged, with the ``x-ratelimit-*`` headers
    enforcing's refusal would carry."""
    try:
        headers = await refusal_headers(runtime.token_quotas, rate, tenant, config)
    except ProxyError:
        headers = {}  # the quota store failed: forwarded without its figures, never a 500
    return TokenGate(body, headers=headers)


def _degrading(priority: str, model: str | None, rules: Rules, runtime: Runtime) -> bool:
    """``overload``: a listed class whose budget pressure is past ``at`` (enforce mode
    only: observe mode changes no request); with model pools, its pressure within the
    request's pool, whose queue it waits in."""
    config = rules.config
    overload = config.overload
    return (
        overload.max_tokens_cap is not None
        and priority in overload.classes
        and config.mode == "enforce"
        and runtime.dispatcher.pressure.of(priority, model) > overload.at
    )


def _choose_pool(
    doc: dict[str, Any] | None,
    body: bytes,
    allowed: tuple[str, ...] | None,
    runtime: Runtime,
    record: RequestRecord,
) -> tuple[str | None, frozenset[str] | None, bytes]:
    """The served model, its replicas and the body to send; or the model refusal.

    A body is routed by model only while the table is ``pooled``
    (``models.py``): a single-model deployment without static lists, aliases
    or ``allowed_models`` sends every body unchanged to any replica. ``doc``
    is ``None`` for a request not routed (a GET without a body). The body is
    rewritten only when the client named an alias, so the replica gets the
    model it serves.
    """
    table = runtime.models
    if doc is None or not table.pooled:
        return None, None, body
    if not table.served_models():
        # No replica has listed a model yet (they are starting, or their
        # ``/v1/models`` fails: logged as ``model discovery failed``). Every
        # pool is unknown, not absent: a 404 for a model that will be served a
        # probe later, or a 400 for a body without one, would send the client
        # away for good, so it is the 503 of a fleet that is not serving yet.
        raise NoHealthyReplica(
            "no replica has listed its models yet",
            retry_after_s=runtime.health.earliest_return_s(),
        )
    asked = doc.get("model")
    choice = table.select(asked, allowed=allowed)
    if isinstance(choice, ModelRefusal):
        if isinstance(asked, str):
            record.model = table.resolve(asked)[:MAX_MODEL_NAME_LOGGED]
            record.model_served = choice.reason == "model_not_allowed"
        raise choice.error()
    record.model, record.model_served = choice.model, True
    if isinstance(asked, str) and asked != choice.model:
        body = json.dumps({**doc, "model": choice.model}).encode()  # ASCII: lone surrogates too
    return choice.model, choice.replicas, body


def _model_document(body: bytes, runtime: Runtime) -> dict[str, Any] | None:
    """What a non-inference route's body says of its model, while routing by model.

    Not pooled: ``None`` (unrouted, nothing parsed). A JSON object is routed
    by its ``model`` as an inference body is, so ``allowed_models`` holds on
    every forwarded route (``/v1/rerank``, llama.cpp's ``/completion``...).
    Any other body (empty, form data, binary, a JSON array) names no model:
    it goes to the only pool when exactly one exists; with several it cannot
    be placed, and a replica chosen at random would bypass ``allowed_models``,
    so it is refused 400.
    """
    table = runtime.models
    if not table.pooled:
        return None
    doc = _json_object(body)
    if doc is not None:
        return doc
    served = len(table.served_models())
    if served > 1:
        raise BadRequest(
            f"{served} models are served and this body is not a JSON object naming one: "
            f"send a JSON body with model"
        )
    return {}


def _json_object(body: bytes) -> dict[str, Any] | None:
    """The body as a JSON object, or None for any other body (nothing raised)."""
    if not _JSON_OBJECT_START.match(body) or json_too_deep(body, MAX_JSON_DEPTH):
        return None
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError):
        return None
    return doc if isinstance(doc, dict) else None


def _identify(headers: CIMultiDictProxy[str], rules: Rules) -> str:
    key = headers.get("X-API-Key")
    auth = headers.get("Authorization")
    if key is None and auth is not None:
        key = bearer_token(auth)
        if key is None:
            raise Unauthenticated('Authorization must be "Bearer <key>"')
    if key is None:
        anonymous = rules.config.anonymous
        if anonymous == ANONYMOUS_REJECT:
            raise Unauthenticated("an API key is required (Authorization: Bearer or X-API-Key)")
        return anonymous
    try:
        tenant = rules.keys.get(hash_api_key(key))
    except UnicodeEncodeError:  # bytes that are not UTF-8: no configured key has them
        tenant = None
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
        raise BadRequest(f"unknown X-Priority; known: {known}")  # the value is not echoed
    return asked


def _client_timeout_ms(headers: CIMultiDictProxy[str]) -> int | None:
    value = headers.get("X-Request-Timeout-Ms")
    if value is None:
        return None
    value = value.strip()
    # Only ASCII digits are numbers ("²" and "٥" pass isdigit()), and only a
    # few of them (int() refuses more than 4,300).
    if not (0 < len(value) <= MAX_TIMEOUT_DIGITS and value.isascii() and value.isdigit()):
        raise BadRequest(
            f"X-Request-Timeout-Ms must be a positive integer of milliseconds, "
            f"at most {MAX_TIMEOUT_DIGITS} ASCII digits"
        )
    timeout_ms = int(value)
    if timeout_ms <= 0:
        raise BadRequest("X-Request-Timeout-Ms must be a positive integer of milliseconds")
    return timeout_ms


async def _read_body(request: web.Request, max_body: int, until: float, runtime: Runtime) -> bytes:
    """The whole body by ``until`` (the entrance budget), never more than ``max_body`` bytes."""
    if not request.body_exists:
        return b""
    content = request.content
    budget_s = until - runtime.clock.now()
    chunks: list[bytes] = []
    size = 0
    try:
        if content.is_eof():  # small bodies arrive with the headers: no timer needed
            body = content.read_nowait()
            if len(body) > max_body:
                raise BodyTooLarge(f"body exceeds {max_body} bytes")
            return body
        async with asyncio.timeout(max(0.0, budget_s)):
            while chunk := await content.readany():
                size += len(chunk)
                if size > max_body:
                    raise BodyTooLarge(f"body exceeds {max_body} bytes")
                chunks.append(chunk)
    except TimeoutError as exc:
        raise EntranceTimeout(f"request body not received within {budget_s * 1000:.0f} ms") from exc
    except (HttpProcessingError, RequestPayloadError):
        # The parser's message quotes what the client sent (a chunk line may hold
        # a key): say nothing of it, and keep it out of the logs (``from None``).
        raise BadRequest("malformed HTTP request body") from None
    return b"".join(chunks)


def _parse_json(body: bytes) -> dict[str, Any]:
    """The JSON object an inference route takes, or ``BadRequest``."""
    if not body:
        raise BadRequest("an inference route needs a JSON body")
    if json_too_deep(body, MAX_JSON_DEPTH):
        raise BadRequest(f"JSON nested deeper than {MAX_JSON_DEPTH} levels")
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise BadRequest(f"request body is not valid JSON: {_json_problem(exc)}") from exc
    if not isinstance(doc, dict):
        raise BadRequest("the body of an inference route must be a JSON object")
    return doc


def _json_problem(exc: ValueError | RecursionError) -> str:
    """What is wrong with a body ``json.loads`` refused, quoting nothing of it.

    A syntax error says where (its own message holds no input); the decoder's
    other errors would quote a byte of the body (``UnicodeDecodeError``) or
    name Python's settings (a number past the integer digit limit).
    """
    if isinstance(exc, json.JSONDecodeError):
        return str(exc)
    if isinstance(exc, UnicodeDecodeError):
        return "the body is not UTF-8 text"
    if isinstance(exc, RecursionError):
        return f"nested deeper than {MAX_JSON_DEPTH} levels"
    return f"a number holds more than {sys.get_int_max_str_digits()} digits"


def json_too_deep(body: bytes, limit: int) -> bool:
    """Whether brackets outside strings nest deeper than ``limit``, without recursing.

    A body with at most ``limit`` opening brackets cannot be too deep: the
    common case costs two ``count`` calls. Otherwise strings are cut out
    and the runs of opening and closing brackets are summed, so a body that
    is one long run costs one step, not one per bracket.
    """
    if body.count(b"[") + body.count(b"{") <= limit:
        return False
    brackets = _JSON_STRING.sub(b"", body).translate(None, _NOT_BRACKET)
    depth = 0
    for run in _BRACKET_RUN.findall(brackets):
        if run[0] in b"[{":
            depth += len(run)
            if depth > limit:
                return True
        else:
            depth -= len(run)
    return False


def estimate_cost(body: bytes, doc: Any, expected_output: float = DEFAULT_OUTPUT_TOKENS) -> float:
    """Prompt tokens (bytes / 4) plus the output limit, capped (docs/REFERENCE.md).

    A request that names no limit is charged ``expected_output``: its tenant's
    recent mean output (``OutputTokens``), corrected when it ends.
    """
    limit = output_limit(doc)
    output = expected_output if limit is None else limit
    return float(min(MAX_ESTIMATED_COST, len(body) // BYTES_PER_TOKEN + output))
