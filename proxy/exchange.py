"""One request's exchange with the fleet, from its admission to its last byte.

``Exchange`` owns everything one request holds on its way through: the
admitted request, its ticket and seat, its attempts, and what the relay
reports back. Its stages read in order, each named for what it adds:

    run → _enqueue → _send_handling_retries → _send_single_attempt → _relay

(a request without a seat goes ``run → _send_seatless → _send_single_attempt →
_relay``: retried alike, on another serving replica, with no seat to take)

``_enqueue`` (the dispatcher decides when), ``_send_handling_retries`` (a
retried failure gives its seat back for the backoff and takes the next free
one ahead of queued tickets), ``_send_single_attempt`` (one upstream try up
to its first byte), ``_relay`` (the answer, streamed; ``relay.Relayed`` says
how it ended and what it used). The seat and the tenant place go back to the
dispatcher in one ``finally`` whatever happens; a request whose client left
while the replica worked keeps its seat for ``cancel_grace_ms`` because
engines notice a closed connection late.

The request's ``RequestRecord`` is written here for telemetry and never read
back to decide anything.
"""

from __future__ import annotations

import asyncio
from urllib.parse import unquote

from aiohttp import web
from multidict import CIMultiDict

from proxy.admitted import BYTES_PER_TOKEN, Admitted
from proxy.degrade import DEGRADED_HEADER
from proxy.engine_routes import METERED_PATHS, route_of
from proxy.errors import (
    FirstByteTimeout,
    IdleTimeout,
    ModelNotFound,
    NoHealthyReplica,
    ProxyError,
    RetryBudgetExhausted,
    ShuttingDown,
    TotalTimeout,
)
from proxy.record import RequestRecord
from proxy.relay import HOP_BY_HOP, Relayed, end_to_end_headers, relay, relay_whole
from proxy.replicas import Replica, ReplicaName, Seat
from proxy.retries import parse_retry_after, status_class
from proxy.runtime import Rules, Runtime
from proxy.scheduler import Ticket
from proxy.upstream import Committed, UpstreamRequest, attempt

#: Headers never forwarded upstream: hop-by-hop ones, and those the proxy consumes
#: or sets itself (the client's API key among them).
NOT_FORWARDED = HOP_BY_HOP | {
    "authorization", "x-api-key", "x-priority", "host", "content-length", "accept-encoding",
    "x-request-timeout-ms", "x-request-id", "x-forwarded-for", "expect",
}  # fmt: skip
#: Content codings aiohttp's HTTP parser decodes before the entrance reads the body.
#: A body sent in one of them reaches the replica decoded, so its label must not:
#: an engine that honours it would try to decode the JSON again and fail.
DECODED_CODINGS = frozenset({"gzip", "deflate", "br", "zstd"})
#: Methods whose repeat has no effect of its own (RFC 9110 section 9.2.1).
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


#: The proxy's own give-ups on an attempt the replica may still be running: the
#: engine notices the closed connection as late as after a client's leave, so the
#: seat stays taken for ``cancel_grace_ms`` as for a cancel. Given back at once, the
#: next queued request joined an engine still busy with the abandoned one, and a
#: replica slow enough to time out took more work for it.
GAVE_UP = (FirstByteTimeout, IdleTimeout, TotalTimeout)


class Exchange:
    """One admitted request on its way to a replica and back."""

    __slots__ = (
        "_answered_by",
        "_upstream",
        "admitted",
        "attempts",
        "record",
        "relayed",
        "request",
        "rules",
        "runtime",
        "seat",
        "ticket",
    )

    def __init__(
        self,
        request: web.Request,
        admitted: Admitted,
        rules: Rules,
        runtime: Runtime,
        record: RequestRecord,
    ) -> None:
        self.request = request
        self.admitted = admitted
        self.rules = rules
        self.runtime = runtime
        self.record = record
        self.ticket: Ticket | None = None
        #: The seat held now; a retry gives it back and takes another.
        self.seat: Seat | None = None
        self.attempts = 0
        self.relayed = Relayed()
        #: The replica whose answer is being relayed, until its health has heard how it ended.
        self._answered_by: Replica | None = None
        self._upstream = _upstream_request(request, admitted)

    @property
    def upstream_done(self) -> bool:
        """The replica's answer was read to its end: nothing runs upstream any more."""
        return self.relayed.upstream_done

    def __repr__(self) -> str:
        return (
            f"<Exchange {self.record.request_id} {self.admitted.tenant}/{self.admitted.priority} "
            f"{self.attempts} attempts, {self.relayed.ending}>"
        )

    async def run(self) -> web.StreamResponse:
        runtime = self.runtime
        if self.admitted.listing:
            return self._list_models()
        if self.admitted.seatless:
            replica = runtime.pool.choose_any(self.admitted.pool)
            if replica is None:
                model = self.admitted.model
                which = "" if model is None else f" of model {model!r}"
                raise NoHealthyReplica(
                    f"no replica{which} is serving",
                    retry_after_s=runtime.health.earliest_return_s(self.admitted.pool),
                )
            self.record.dispatched_at = runtime.clock.now()
            self._count_dispatch()
            return await self._relay(await self._send_seatless(replica))
        ticket = self._enqueue()
        # Granted at once (the unloaded case, local state): no wait to suspend in.
        dispatcher = runtime.dispatcher
        self.seat = (
            ticket.seat
            if ticket.seat is not None and dispatcher.shared is None
            else await dispatcher.wait(ticket)
        )
        self.record.dispatched_at = runtime.clock.now()
        self._count_dispatch()
        grace_s = 0.0
        try:
            response = await self._relay(await self._send_handling_retries())
            relayed = self.relayed
            if not self.upstream_done and (
                relayed.ending == "cancelled" or isinstance(relayed.failure, GAVE_UP)
            ):
                grace_s = self.rules.config.timeouts.cancel_grace_ms / 1000.0
            return response
        except ProxyError as err:
            if isinstance(err, GAVE_UP) and not self.upstream_done:
                grace_s = self.rules.config.timeouts.cancel_grace_ms / 1000.0
            raise
        except BaseException:
            # Cancelled (the client left) while the replica still worked on it;
            # an answer already read to its end left nothing running upstream.
            if not self.upstream_done:
                grace_s = self.rules.config.timeouts.cancel_grace_ms / 1000.0
            raise
        finally:
            self._judge_answer()
            self._finish(ticket, grace_s)

    def _count_dispatch(self) -> None:
        """One request dispatched, for the retry budget's ratio (the fleet's too): with or
        without a seat, since either may spend a retry."""
        self.runtime.retry_budget.record_request()
        if self.runtime.state is not None:
            self.runtime.state.record_request()

    def _no_healthy_replica(self) -> NoHealthyReplica:
        """503 ``no_healthy_replica`` naming the pool (other models' replicas may well
        be serving), ``Retry-After`` when its first replica may be back."""
        admitted = self.admitted
        which = "" if admitted.model is None else f" serving model {admitted.model!r}"
        return NoHealthyReplica(
            f"every replica{which} is ejected or drained",
            retry_after_s=self.runtime.health.earliest_return_s(admitted.pool),
        )

    def _enqueue(self) -> Ticket:
        runtime, admitted = self.runtime, self.admitted
        if runtime.shutting_down:
            raise ShuttingDown("the proxy is shutting down", retry_after_s=1.0)
        if not runtime.pool.any_usable(admitted.pool):
            raise self._no_healthy_replica()
        dispatcher = runtime.dispatcher
        flow = (admitted.tenant, admitted.priority, admitted.cost, admitted.deadline)
        if admitted.model is None and admitted.affinity is None:
            ticket = self.ticket = dispatcher.enqueue(*flow, asked=admitted.asked)
        else:
            ticket = self.ticket = dispatcher.enqueue_in(
                admitted.model, *flow, affinity=admitted.affinity, asked=admitted.asked
            )
        self.record.enqueued_at = ticket.enqueued_at
        if ticket.observed is not None and self.record.observed is None:
            self.record.observed = ticket.observed  # the first check enforcing would fail
        self.record.queue_depth_at_enqueue = dispatcher.scheduler.depth(admitted.tenant)
        return ticket

    def _list_models(self) -> web.Response:
        """``GET /v1/models`` (or ``/v1/models/{id}``) from the model table: healthy
        replicas' models and aliases, only those the tenant may use; no seat, no
        replica asked. An id outside that list is 404 ``model_not_found``."""
        runtime, record = self.runtime, self.record
        allowed = self.rules.config.tenants[self.admitted.tenant].allowed_models
        healthy = {r.name for r in runtime.pool.replicas if r.serving}
        path = self.admitted.path_qs.partition("?")[0]
        name = unquote(path.removeprefix("/v1/models").strip("/"))
        if name:
            answer = runtime.models.model_response(name, allowed, healthy)
            if answer is None:
                raise ModelNotFound("the requested model does not exist")  # no echo
        else:
            answer = runtime.models.list_response(allowed, healthy)
        record.status = 200
        headers = {"X-Request-Id": record.request_id, "Server-Timing": record.server_timing()}
        return web.json_response(answer, headers=headers)

    def _judge_answer(self) -> None:
        """The replica's health hears how its answer ended, not only that it began.

        An answer the relay passed on to its end (or until its client left)
        is the replica's success; one it broke off after the commit point (a
        reset, a replica that died mid-stream) is a failure like a reset before
        the first byte, so a replica that breaks every stream it starts is
        ejected as one that refuses them is. Judged at the end, not at the
        commit point: a success there would clear the count of every break.
        """
        replica, self._answered_by = self._answered_by, None
        if replica is None:
            return
        relayed = self.relayed
        if relayed.failure is not None:
            self.runtime.health.attempt_failed(replica, relayed.failure)
        elif relayed.ending != "broken":  # completed, or its client left ("relaying": mid-read)
            self.runtime.health.attempt_succeeded(replica)

    def _upstream_finished(self) -> None:
        """The replica finished: its seat goes back now, not after the client drains."""
        if self.seat is not None and self.ticket is not None:
            self.runtime.dispatcher.release_seat(self.ticket, self.seat)
            self.seat = None

    def _finish(self, ticket: Ticket, grace_s: float) -> None:
        """Seat and tenant place back; the real cost corrects the tenant's fair share."""
        relayed, actual = self.relayed, None
        if relayed.output_tokens is not None:
            self.runtime.output_tokens.record(self.admitted.tenant, relayed.output_tokens)
            # An engine that reports no prompt count (vLLM streams without
            # include_usage) keeps the prompt's estimate, not a refund of it.
            prompt = relayed.input_tokens
            if prompt is None:
                prompt = len(self.admitted.body) // BYTES_PER_TOKEN
            actual = float(prompt + relayed.output_tokens)
        self.runtime.dispatcher.finish(ticket, self.seat, actual_cost=actual, seat_grace_s=grace_s)

    async def _send_handling_retries(self) -> Committed:
        """Attempts until one commits an answer worth relaying, or retrying is not allowed.

        A retried failure gives its seat back for the backoff (keeping the
        tenant's place) and takes the next free seat ahead of queued tickets,
        preferring a replica that has not failed this request yet (docs/REFERENCE.md):
        with three attempts, the third goes neither to the second's replica nor back
        to the first's while another can take it.
        """
        runtime = self.runtime
        deadline = self.admitted.deadline
        failed: set[ReplicaName] = set()
        while True:
            assert self.seat is not None
            assert self.ticket is not None
            replica = self.seat.replica
            failure: ProxyError | Committed
            try:
                committed = await self._send_single_attempt(replica)
            except ProxyError as err:
                runtime.health.attempt_failed(replica, err)
                failure, retry_class, upstream_wait = err, err.retry_class, None
            else:
                retry_class = status_class(committed.status)
                if retry_class is None:
                    self._answered_by = replica  # judged when its answer has ended
                    return committed
                runtime.health.attempt_failed(replica, None, committed.status)
                failure = committed
                upstream_wait = parse_retry_after(committed.response.headers.get("Retry-After"))
            decision = runtime.retry_policy.decide(
                retry_class,
                attempts=self.attempts,
                inference_route=self.admitted.inference,
                remaining_s=deadline.remaining(runtime.clock.now()),
                upstream_retry_after_s=upstream_wait,
            )
            # Nowhere to retry: every replica of the pool is ejected or drained (an
            # operator's drain, the probes). Waiting for a seat would hold the client
            # to its total budget for an answer no replica can give.
            if not decision.retry or not runtime.pool.any_usable(self.admitted.pool):
                if isinstance(failure, Committed):
                    return failure  # the replica's own answer, passed through
                raise failure
            if isinstance(failure, Committed):
                failure.close()
            assert retry_class is not None
            await self._spend_retry(retry_class)
            failed.add(replica.name)
            # A replica that never answered may still run the attempt it was sent
            # (engines notice a closed connection late): its seat stays taken for the
            # cancel grace, as a cancelled request's does. Any other failure was an
            # answer, or no connection at all: nothing runs there any more.
            grace_s = 0.0
            if isinstance(failure, FirstByteTimeout):
                grace_s = self.rules.config.timeouts.cancel_grace_ms / 1000.0
            runtime.dispatcher.release(self.seat, grace_s)
            self.seat = None
            await self._back_off(decision.delay_s)
            if not runtime.pool.any_usable(self.admitted.pool):  # drained meanwhile
                raise self._no_healthy_replica()
            try:
                self.seat = await runtime.dispatcher.reseat(
                    frozenset(failed),
                    deadline.remaining(runtime.clock.now()),
                    runtime.dispatcher.pool_now(self.ticket),
                )
            except TimeoutError as exc:
                raise TotalTimeout("no seat for a retry within the total budget") from exc
            self.ticket.granted_at = runtime.clock.now()  # seat time is per seat, not per request

    async def _send_seatless(self, replica: Replica) -> Committed:
        """A request without a seat (``GET``, ``/v1/models``, ``/tokenize``): attempts
        until one commits, retried like any other (``retry_on``, the retry budget, the
        deadline) on another serving replica of its pool, with no seat to wait for.

        A replica that refuses connections before its health probe notices would
        otherwise answer every such request it is picked for with a 502.
        """
        runtime = self.runtime
        deadline = self.admitted.deadline
        failed: set[ReplicaName] = set()
        while True:
            try:
                return await self._send_single_attempt(replica)
            except ProxyError as err:
                runtime.health.attempt_failed(replica, err)
                decision = runtime.retry_policy.decide(
                    err.retry_class,
                    attempts=self.attempts,
                    inference_route=self.admitted.inference,
                    remaining_s=deadline.remaining(runtime.clock.now()),
                )
                if not decision.retry:
                    raise
                failure = err
            assert failure.retry_class is not None
            await self._spend_retry(failure.retry_class)
            failed.add(replica.name)
            await self._back_off(decision.delay_s)
            # Another serving replica of its pool when there is one, else the same.
            among = self.admitted.pool
            names = among if among is not None else {r.name for r in runtime.pool.replicas}
            following = runtime.pool.choose_any(frozenset(names.difference(failed)))
            following = following or runtime.pool.choose_any(among)
            if following is None:
                raise failure
            replica = following

    async def _spend_retry(self, retry_class: str) -> None:
        """Take a retry from the budget (the fleet's with shared state) and count it;
        refused: 503 ``retry_budget_exhausted``, with the time until it has one."""
        runtime = self.runtime
        refill_s = await runtime.spend_retry()
        if refill_s > 0:
            runtime.telemetry.retry_budget_exhausted()
            raise RetryBudgetExhausted(
                "retries are over the fleet's retry budget", retry_after_s=refill_s
            )
        self.record.retry_reasons.append(retry_class)
        runtime.telemetry.retry(retry_class)

    async def _back_off(self, delay_s: float) -> None:
        """The wait before a retry, kept for its ``proxy.backoff`` span."""
        clock = self.runtime.clock
        started = clock.now()
        await asyncio.sleep(delay_s)
        self.record.backoffs.append((started, clock.now()))

    async def _send_single_attempt(self, replica: Replica) -> Committed:
        runtime, record = self.runtime, self.record
        self.attempts += 1
        record.attempts = self.attempts
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
                runtime.client_session(), replica, self._upstream, self.admitted.deadline,
                runtime.clock, extra_headers=extra, client_timeout=self.rules.upstream_timeout,
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

    async def _relay(self, committed: Committed) -> web.StreamResponse:
        record = self.record
        status = record.status = self.relayed.status = committed.status
        extra = {"X-Request-Id": record.request_id, "Server-Timing": record.server_timing()}
        if self.admitted.degraded is not None:
            extra[DEGRADED_HEADER] = self.admitted.degraded
        if self.admitted.ratelimit:
            extra.update(self.admitted.ratelimit)
        if not 200 <= status < 300:
            extra["X-Admission-Reason"] = "upstream_status"
            record.outcome, record.reason = "failed", "upstream_status"
        whole = relay_whole(committed, record, extra, self.relayed)
        if whole is not None:
            return whole
        return await relay(
            self.request, committed, record, self.admitted.deadline, self.runtime.clock,
            idle_s=self.rules.config.timeouts.idle_ms / 1000.0, extra_headers=extra,
            relayed=self.relayed,
            on_upstream_done=self._upstream_finished if self.ticket is not None else None,
            strip_usage=self.admitted.strip_usage,
        )  # fmt: skip


def _upstream_request(request: web.Request, admitted: Admitted) -> UpstreamRequest:
    headers = end_to_end_headers(request.headers, NOT_FORWARDED)
    codings = request.headers.getall("Content-Encoding", ())
    if any(coding.strip().lower() in DECODED_CODINGS for coding in codings):
        del headers["Content-Encoding"]  # every one: the body is no longer encoded
    forwarded = request.headers.get("X-Forwarded-For")
    peer = request.remote or ""
    headers["X-Forwarded-For"] = f"{forwarded}, {peer}" if forwarded else peer
    headers["Accept-Encoding"] = "identity"  # the relay reads SSE events as they pass
    return UpstreamRequest(
        method=request.method,
        path_qs=admitted.path_qs,
        headers=_writable(headers),
        body=admitted.body,
        streaming=admitted.streaming,
        # Inference routes are safe to repeat before the first byte (docs/REFERENCE.md,
        # retry classes), and so are safe methods anywhere (RFC 9110 section 9.2.1),
        # and every route where an engine only computes (llama.cpp's own
        # ``/completion``, embeddings, reranking): llama-server drops the kept-alive
        # connection after each of its streams there too.
        resend_on_stale=admitted.inference
        or request.method in SAFE_METHODS
        or route_of(admitted.path_qs.partition("?")[0]) in METERED_PATHS,
    )


def _writable(headers: CIMultiDict[str]) -> CIMultiDict[str]:
    """The headers with the bytes of a client's value that were not UTF-8 left out.

    aiohttp's parser keeps such bytes as lone surrogates; its C header writer
    drops them, its pure-Python one (``AIOHTTP_NO_EXTENSIONS``) raised
    ``UnicodeEncodeError``, a 500. Both now send what the C writer sent. The
    common case, every value ASCII, is one scan per value and no copy.
    """
    if all(value.isascii() for value in headers.values()):
        return headers
    return CIMultiDict(
        (name, value if value.isascii() else value.encode("utf-8", "ignore").decode())
        for name, value in headers.items()
    )
