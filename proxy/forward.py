"""From an admitted request to a relayed answer: queue, seat, attempt, relay.

The path reads top to bottom as the stages it passes: ``_enqueue`` (the
dispatcher decides when), ``_attempt`` (one upstream try up to its first
byte), ``relay`` (the answer, streamed). The seat and the tenant place are
released in one ``finally`` whatever happens; a request whose client left
while the replica worked keeps its seat for ``cancel_grace_ms`` because
engines notice a closed connection late.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from aiohttp import web

from proxy.admitted import BYTES_PER_TOKEN, Admitted
from proxy.errors import (
    NoHealthyReplica,
    ProxyError,
    RetryBudgetExhausted,
    ShuttingDown,
    TotalTimeout,
)
from proxy.record import RequestRecord
from proxy.relay import HOP_BY_HOP, end_to_end_headers, relay, relay_whole
from proxy.replicas import Replica, Seat
from proxy.retries import parse_retry_after, status_class
from proxy.runtime import Rules, Runtime
from proxy.scheduler import Ticket
from proxy.upstream import Committed, UpstreamRequest, attempt

#: Headers never forwarded upstream: hop-by-hop ones, and those the proxy consumes
#: or sets itself (the client's API key among them).
NOT_FORWARDED = HOP_BY_HOP | {
    "authorization", "x-api-key", "x-priority", "host", "content-length", "accept-encoding",
    "x-request-timeout-ms", "x-request-id", "x-forwarded-for",
}  # fmt: skip
#: Methods whose repeat has no effect of its own (RFC 9110 section 9.2.1).
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


class Lease:
    """The seat a request holds now; a retry gives it back and takes another."""

    __slots__ = ("seat",)

    def __init__(self, seat: Seat) -> None:
        self.seat: Seat | None = seat


async def forward(
    request: web.Request,
    admitted: Admitted,
    rules: Rules,
    runtime: Runtime,
    record: RequestRecord,
) -> web.StreamResponse:
    upstream_request = _upstream_request(request, admitted)
    if admitted.seatless:
        replica = runtime.pool.choose_any()
        if replica is None:
            raise NoHealthyReplica(
                "no replica is serving", retry_after_s=runtime.health.earliest_return_s()
            )
        record.dispatched_at = runtime.clock.now()
        committed = await _attempt(runtime, replica, upstream_request, admitted, record)
        return await _relay(request, committed, admitted, rules, runtime, record)

    if runtime.shutting_down:
        raise ShuttingDown("the proxy is shutting down", retry_after_s=1.0)
    if not runtime.pool.any_usable():
        raise NoHealthyReplica(
            "every replica is ejected or drained", retry_after_s=runtime.health.earliest_return_s()
        )
    dispatcher = runtime.dispatcher
    ticket = dispatcher.enqueue(admitted.tenant, admitted.priority, admitted.cost,
                                admitted.deadline)  # fmt: skip
    record.enqueued_at = ticket.enqueued_at
    record.queue_depth_at_enqueue = dispatcher.scheduler.depth(admitted.tenant)
    # Granted at once (the unloaded case): no wait to suspend in.
    lease = Lease(ticket.seat if ticket.seat is not None else await dispatcher.wait(ticket))
    record.dispatched_at = runtime.clock.now()
    runtime.retry_budget.record_request()
    grace_s = 0.0

    def upstream_done() -> None:
        """The replica finished: its seat goes back now, not after the client drains."""
        if lease.seat is not None:
            dispatcher.release_seat(ticket, lease.seat)
            lease.seat = None

    try:
        committed = await _send(runtime, lease, upstream_request, admitted, record, ticket)
        response = await _relay(
            request, committed, admitted, rules, runtime, record, on_upstream_done=upstream_done
        )
        if record.outcome == "cancelled" and not record.upstream_done:
            grace_s = rules.config.timeouts.cancel_grace_ms / 1000.0
        return response
    except ProxyError:
        raise
    except BaseException:
        # Cancelled (the client left) while the replica still worked on it;
        # an answer already read to its end left nothing running upstream.
        if not record.upstream_done:
            grace_s = rules.config.timeouts.cancel_grace_ms / 1000.0
        raise
    finally:
        actual = None
        if record.output_tokens is not None:
            runtime.output_tokens.record(admitted.tenant, record.output_tokens)
            # An engine that reports no prompt count (vLLM streams without
            # include_usage) keeps the prompt's estimate, not a refund of it.
            prompt = record.input_tokens
            if prompt is None:
                prompt = len(admitted.body) // BYTES_PER_TOKEN
            actual = float(prompt + record.output_tokens)
        dispatcher.finish(ticket, lease.seat, actual_cost=actual, seat_grace_s=grace_s)


async def _send(
    runtime: Runtime,
    lease: Lease,
    upstream_request: UpstreamRequest,
    admitted: Admitted,
    record: RequestRecord,
    ticket: Ticket,
) -> Committed:
    """Attempts until one commits an answer worth relaying, or retrying is not allowed.

    A retried failure gives its seat back for the backoff (keeping the
    tenant's place) and takes the next free seat ahead of queued tickets,
    preferring another replica (docs/REFERENCE.md).
    """
    deadline = admitted.deadline
    while True:
        assert lease.seat is not None
        replica = lease.seat.replica
        failure: ProxyError | Committed
        try:
            committed = await _attempt(runtime, replica, upstream_request, admitted, record)
        except ProxyError as err:
            runtime.health.attempt_failed(replica, err)
            failure, retry_class, upstream_wait = err, err.retry_class, None
        else:
            retry_class = status_class(committed.status)
            if retry_class is None:
                runtime.health.attempt_succeeded(replica)
                return committed
            runtime.health.attempt_failed(replica, None, committed.status)
            failure = committed
            upstream_wait = parse_retry_after(committed.response.headers.get("Retry-After"))
        decision = runtime.retry_policy.decide(
            retry_class,
            attempts=record.attempts,
            inference_route=admitted.inference,
            remaining_s=deadline.remaining(runtime.clock.now()),
            upstream_retry_after_s=upstream_wait,
        )
        if not decision.retry:
            if isinstance(failure, Committed):
                return failure  # the replica's own answer, passed through
            raise failure
        if isinstance(failure, Committed):
            failure.close()
        if not runtime.retry_budget.try_spend():
            runtime.telemetry.retry_budget_exhausted()
            raise RetryBudgetExhausted(
                "retries are over the fleet's retry budget",
                retry_after_s=runtime.retry_budget.refill_in(),
            )
        assert retry_class is not None
        record.retry_reasons.append(retry_class)
        runtime.telemetry.retry(retry_class)
        runtime.dispatcher.release(lease.seat)
        lease.seat = None
        backoff_start = runtime.clock.now()
        await asyncio.sleep(decision.delay_s)
        record.backoffs.append((backoff_start, runtime.clock.now()))
        try:
            lease.seat = await runtime.dispatcher.reseat(
                frozenset({replica.name}), deadline.remaining(runtime.clock.now())
            )
        except TimeoutError as exc:
            raise TotalTimeout("no seat for a retry within the total budget") from exc
        ticket.granted_at = runtime.clock.now()  # seat time is per seat, not per request


def _upstream_request(request: web.Request, admitted: Admitted) -> UpstreamRequest:
    headers = end_to_end_headers(request.headers, NOT_FORWARDED)
    forwarded = request.headers.get("X-Forwarded-For")
    peer = request.remote or ""
    headers["X-Forwarded-For"] = f"{forwarded}, {peer}" if forwarded else peer
    headers["Accept-Encoding"] = "identity"  # the relay reads SSE events as they pass
    return UpstreamRequest(
        method=request.method,
        path_qs=admitted.path_qs,
        headers=headers,
        body=admitted.body,
        streaming=admitted.streaming,
        # Inference routes are safe to repeat before the first byte (docs/REFERENCE.md,
        # retry classes), and so are safe methods anywhere (RFC 9110 section 9.2.1).
        resend_on_stale=admitted.inference or request.method in SAFE_METHODS,
    )


async def _attempt(
    runtime: Runtime,
    replica: Replica,
    upstream_request: UpstreamRequest,
    admitted: Admitted,
    record: RequestRecord,
) -> Committed:
    record.attempts += 1
    record.replica = replica.name
    extra = {"X-Request-Id": record.request_id}
    if replica.api_key:
        extra["Authorization"] = f"Bearer {replica.api_key}"
    trace = record.trace
    tracing = runtime.telemetry.tracing
    if trace is not None:
        tracing.upstream_started(trace, record, replica.name, runtime.clock.now(), extra)
    try:
        committed = await attempt(
            runtime.client_session(), replica, upstream_request, admitted.deadline, runtime.clock,
            extra_headers=extra, client_timeout=runtime.rules.upstream_timeout,
        )  # fmt: skip
    except ProxyError as err:
        if trace is not None:
            tracing.upstream_ended(trace, record, runtime.clock.now(), error=err.reason)
        raise
    except BaseException:
        if trace is not None:
            tracing.upstream_ended(trace, record, runtime.clock.now(), error="cancelled")
        raise
    if trace is not None:
        tracing.upstream_ended(trace, record, committed.first_byte_at, status=committed.status)
    record.first_byte_at = committed.first_byte_at
    record.upstream_status = committed.status
    if replica.config.gpu_index is not None:
        reading = runtime.gpu.snapshot.get(replica.config.gpu_index)
        if reading is not None:
            record.gpu = {
                "utilization": reading.utilization,
                "memory_used_ratio": reading.memory_ratio,
            }
    return committed


async def _relay(
    request: web.Request,
    committed: Committed,
    admitted: Admitted,
    rules: Rules,
    runtime: Runtime,
    record: RequestRecord,
    on_upstream_done: Callable[[], None] | None = None,
) -> web.StreamResponse:
    status = record.status = committed.status
    extra = {"X-Request-Id": record.request_id, "Server-Timing": record.server_timing()}
    if not 200 <= status < 300:
        extra["X-Admission-Reason"] = "upstream_status"
        record.outcome, record.reason = "failed", "upstream_status"
    whole = relay_whole(committed, record, extra)
    if whole is not None:
        return whole
    return await relay(
        request, committed, record, admitted.deadline, runtime.clock,
        idle_s=rules.config.timeouts.idle_ms / 1000.0, extra_headers=extra,
        on_upstream_done=on_upstream_done,
    )  # fmt: skip
