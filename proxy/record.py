"""The per-request record: what happened to one request, filled in as it goes.

Each stage writes the fields it owns (the entrance its identity and timing,
the dispatcher its queue wait, the relay its first token and token counts);
telemetry reads the record once, when the request ends. Keeping it one plain
object makes "every request ends exactly once with one outcome" checkable:
``end`` refuses a second call.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from proxy.errors import Outcome, ProxyError


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
    upstream_status: int | None = None
    status: int = 0
    outcome: Outcome | None = None
    reason: str = "none"
    timeout_layer: str | None = None
    input_tokens: int | None = None
    output_tokens: int | None = None
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

    def fail(self, error: ProxyError) -> None:
        """Record the proxy's own answer (before ``end``)."""
        self.status = error.status
        self.outcome = error.outcome
        self.reason = error.reason
        layer = getattr(error, "layer", None)
        self.timeout_layer = layer if isinstance(layer, str) else None

    def cancel(self) -> None:
        """The client left: logged with status 499 (DESIGN section 12)."""
        self.status, self.outcome, self.reason = 499, "cancelled", "client_disconnected"
        self.timeout_layer = None

    def end(self, now: float) -> None:
        if self.ended_at is not None:
            raise RuntimeError(f"request {self.request_id} ended twice")
        self.ended_at = now
        if self.outcome is None:
            self.outcome = "completed" if 200 <= self.status < 300 else "failed"

    # -- derived durations, in milliseconds --------------------------------------------

    @staticmethod
    def _ms(start: float | None, end: float | None) -> float | None:
        if start is None or end is None:
            return None
        return round((end - start) * 1000.0, 3)

    @property
    def entrance_ms(self) -> float | None:
        return self._ms(self.arrival, self.entrance_done)

    @property
    def queue_ms(self) -> float | None:
        end = self.dispatched_at if self.dispatched_at is not None else self.ended_at
        return self._ms(self.enqueued_at, end)

    @property
    def upstream_ms(self) -> float | None:
        """Dispatch to the first upstream body byte (the Server-Timing definition)."""
        return self._ms(self.dispatched_at, self.first_byte_at)

    @property
    def ttft_ms(self) -> float | None:
        return self._ms(self.arrival, self.first_token_at)

    @property
    def total_ms(self) -> float | None:
        return self._ms(self.arrival, self.ended_at)

    @property
    def good(self) -> bool:
        """A 2xx that met its first-token and total budgets (goodput)."""
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
        parts = []
        for name, value in (
            ("entrance", self.entrance_ms),
            ("queue", self.queue_ms),
            ("upstream", self.upstream_ms),
        ):
            parts.append(f"{name};dur={value if value is not None else 0:.3f}")
        return ", ".join(parts)
