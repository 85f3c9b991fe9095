"""The per-request record: what happened to one request, filled in as it goes.

Each stage writes the fields it owns (the entrance its identity and timing,
the dispatcher its queue wait, the relay its first token and token counts);
telemetry reads the record once, when the request ends. Nothing on the
request path reads it back to decide anything (the exchange learns from the
relay's ``Relayed``). Keeping it one plain
object makes "every request ends exactly once with one outcome" checkable:
``end`` refuses a second call.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from proxy.errors import Outcome, ProxyError
from proxy.quotas import RateTake


@dataclass(slots=True, eq=False)
class RequestRecord:
    request_id: str
    arrival: float
    method: str = "GET"
    path: str = "/"
    tenant: str = "unknown"
    priority: str = "unknown"
    streaming: bool = False
    #: Counted in admission_requests_total (False for reserved paths).
    counted: bool = True
    entrance_done: float | None = None
    enqueued_at: float | None = None
    dispatched_at: float | None = None
    queue_depth_at_enqueue: int = 0
    first_byte_at: float | None = None
    first_token_at: float | None = None
    ended_at: float | None = None
    attempts: int = 0
    replica: str | None = None
    #: Model pools: the served model the request went to, or the name a refusal
    #: named (at most 256 characters); ``None`` when not routed by model.
    model: str | None = None
    #: ``model`` is a served model (its metric label); else the label is ``unknown``.
    model_served: bool = False
    upstream_status: int | None = None
    status: int = 0
    #: The status the client was sent before ``cancel`` logged 499 (shutdown may undo it).
    status_sent: int = 0
    outcome: Outcome | None = None
    reason: str = "none"
    timeout_layer: str | None = None
    input_tokens: int | None = None
    output_tokens: int | None = None
    #: Answers the engine gives per prompt, each repeating the prompt's count
    #: (SGLang's ``n``): the relay counts the prompt once (``samples_per_prompt``).
    samples_per_prompt: int = 1
    #: Token quota: the estimate charged at admission, and what it was corrected to.
    quota_charged_tokens: int | None = None
    quota_actual_tokens: int | None = None
    engine_queue_ms: float | None = None
    engine_inference_ms: float | None = None
    retry_reasons: list[str] = field(default_factory=list)
    #: Wall-clock arrival (epoch ns): anchors the monotonic instants for spans.
    wall_arrival_ns: int = 0
    #: (start, end) of each retry backoff.
    backoffs: list[tuple[float, float]] = field(default_factory=list)
    #: The live spans (``telemetry.tracing.RequestTrace``) when tracing is on.
    trace: Any = None
    #: The serving replica's GPU reading when it has one (sidecar mode).
    gpu: dict[str, float] | None = None
    #: The budgets this request was admitted under, for goodput.
    first_byte_budget_ms: float | None = None
    total_budget_ms: float | None = None
    #: Durations in ms (rounded to the microsecond), computed once by ``end``;
    #: None where the request never reached that point.
    entrance_ms: float | None = None
    queue_ms: float | None = None
    upstream_ms: float | None = None
    ttft_ms: float | None = None
    total_ms: float | None = None
    #: The request's turn at its tenant's ``rate_per_s`` bucket (None: no rate, or not
    #: reached): only for the ``x-ratelimit-*-requests`` headers of its answer.
    rate_take: RateTake | None = None
    #: ``overload``: what was degraded (``max_tokens``), or None.
    degraded: str | None = None
    #: ``mode: observe``: the refusal enforcing would have given (``would_<reason>``), or None.
    observed: str | None = None

    def fail(self, error: ProxyError) -> None:
        """Record the proxy's own answer (before ``end``)."""
        self.status = error.status
        self.outcome = error.outcome
        self.reason = error.reason
        if error.reason == "model_not_found":  # also a queued one whose model went away
            self.model_served = False
        layer = getattr(error, "layer", None)
        self.timeout_layer = layer if isinstance(layer, str) else None

    def broke(self, error: ProxyError) -> None:
        """The answer failed after the commit point: counted as ``error`` (outcome,
        reason, timeout layer), logged with the status the client was sent, which
        the SSE error event or the cut connection followed (docs/REFERENCE.md)."""
        sent = self.status
        self.fail(error)
        self.status = sent

    def cancel(self) -> None:
        """The client left: logged with status 499 (docs/REFERENCE.md)."""
        self.status_sent = self.status
        self.status, self.outcome, self.reason = 499, "cancelled", "client_disconnected"
        self.timeout_layer = None

    def cut_by_shutdown(self) -> None:
        """The shutdown grace ran out while the request was in flight: the proxy ended
        it, not the client, so it is ``failed`` with reason ``shutting_down``; the
        status stays the one the client was sent (503 if nothing was sent yet)."""
        self.status = self.status_sent if self.status_sent >= 200 else 503
        self.outcome, self.reason = "failed", "shutting_down"
        self.timeout_layer = None

    def end(self, now: float) -> None:
        """The request is over: its outcome is final and its durations are computed, once."""
        if self.ended_at is not None:
            raise RuntimeError(f"request {self.request_id} ended twice")
        self.ended_at = now
        if self.entrance_done is None:
            # It ended at the entrance (refused, timed out or left there): the entrance
            # took its whole time, which its access line and wait layer show.
            self.entrance_done = now
        if self.outcome is None:
            self.outcome = "completed" if 200 <= self.status < 300 else "failed"
        arrival = self.arrival
        if self.entrance_done is not None:
            self.entrance_ms = round((self.entrance_done - arrival) * 1000.0, 3)
        if self.enqueued_at is not None:
            left = self.dispatched_at if self.dispatched_at is not None else now
            self.queue_ms = round((left - self.enqueued_at) * 1000.0, 3)
        if self.dispatched_at is not None and self.first_byte_at is not None:
            self.upstream_ms = round((self.first_byte_at - self.dispatched_at) * 1000.0, 3)
        if self.first_token_at is not None:
            self.ttft_ms = round((self.first_token_at - arrival) * 1000.0, 3)
        self.total_ms = round((now - arrival) * 1000.0, 3)

    @property
    def good(self) -> bool:
        """A 2xx that met its first-token and total budgets (goodput); after ``end``."""
        if self.outcome != "completed":
            return False
        ttft, total = self.ttft_ms, self.total_ms
        budget = self.first_byte_budget_ms
        if budget is not None and ttft is not None and ttft > budget:
            return False
        return not (
            self.total_budget_ms is not None and total is not None and total > self.total_budget_ms
        )

    def server_timing(self) -> str:
        """``Server-Timing`` while the answer is being made (before ``end``): ms, 0 when unknown.

        Entrance, queue (to now when the ticket is still waiting: 0 before
        ``end``), upstream (dispatch to the first upstream body byte).
        """
        arrival = self.arrival
        entrance = queue = upstream = 0.0
        if self.entrance_done is not None:
            entrance = (self.entrance_done - arrival) * 1000.0
        left = self.dispatched_at if self.dispatched_at is not None else self.ended_at
        if self.enqueued_at is not None and left is not None:
            queue = (left - self.enqueued_at) * 1000.0
        if self.dispatched_at is not None and self.first_byte_at is not None:
            upstream = (self.first_byte_at - self.dispatched_at) * 1000.0
        return f"entrance;dur={entrance:.3f}, queue;dur={queue:.3f}, upstream;dur={upstream:.3f}"
