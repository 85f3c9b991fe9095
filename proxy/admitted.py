"""What a request carries past the entrance: its deadline and its admission.

One deadline per request, made of per-layer budgets.

``total_ms`` runs from arrival and every layer is clipped to what remains of
it (docs/REFERENCE.md). The client's ``X-Request-Timeout-Ms`` can only shorten
the total. ``Deadline`` is a value computed once at the entrance; the request
carries it through every layer, so a reload never changes the rules a queued
request was admitted under. No I/O and no clock reads here: callers pass
``now`` in, which keeps this testable with a fake clock.

``Admitted`` is the value the entrance hands to the rest of the path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from proxy.settings import BudgetsConfig

if TYPE_CHECKING:
    from proxy.token_quota import Held


@dataclass(frozen=True, slots=True)
class Deadline:
    """Absolute instants (clock seconds) derived from a request's budgets."""

    arrival: float
    total_at: float
    queue_s: float
    first_byte_s: float

    @classmethod
    def start(
        cls, arrival: float, budgets: BudgetsConfig, client_timeout_ms: int | None = None
    ) -> Deadline:
        total_ms = budgets.total_ms
        if client_timeout_ms is not None:
            total_ms = min(total_ms, client_timeout_ms)
        return cls(
            arrival=arrival,
            total_at=arrival + total_ms / 1000.0,
            queue_s=budgets.queue_ms / 1000.0,
            first_byte_s=budgets.first_byte_ms / 1000.0,
        )

    def remaining(self, now: float) -> float:
        """Seconds left of the total budget (never negative)."""
        return max(0.0, self.total_at - now)

    def expired(self, now: float) -> bool:
        return now >= self.total_at

    def queue_expires_at(self, enqueued_at: float) -> float:
        """When a ticket enqueued at ``enqueued_at`` must leave the queue."""
        return min(enqueued_at + self.queue_s, self.total_at)

    def first_byte_at(self, attempt_start: float) -> float:
        """When an attempt that started at ``attempt_start`` must have its first byte."""
        return min(attempt_start + self.first_byte_s, self.total_at)

    def first_byte_is_total(self, attempt_start: float) -> bool:
        """True when the total deadline, not the first-byte budget, ends the wait."""
        return self.total_at <= attempt_start + self.first_byte_s

    def remaining_ms_header(self, now: float) -> str:
        """The ``X-Request-Timeout-Ms`` value sent upstream: whole ms left, at least 1."""
        return str(max(1, int(self.remaining(now) * 1000.0)))


#: Bytes per prompt token when no tokenizer is at hand (docs/REFERENCE.md).
BYTES_PER_TOKEN = 4


@dataclass(frozen=True, slots=True)
class Admitted:
    """A request that passed the entrance: who, which class, by when, what."""

    tenant: str
    priority: str
    deadline: Deadline
    body: bytes
    streaming: bool
    seatless: bool
    inference: bool
    cost: float
    #: The normalised path (and the query as sent): what the replica receives.
    path_qs: str
    #: The served model the request goes to (after aliasing); ``None``: not routed by model.
    model: str | None = None
    #: The replicas that serve ``model``; ``None``: any replica (one implicit pool).
    pool: frozenset[str] | None = None
    #: Not routed by model: the body's ``model`` value as sent (``None``: absent;
    #: ``...``: the body was not read for one). See ``Ticket.asked``.
    asked: object = ...
    #: ``GET /v1/models`` answered by the proxy from the model table.
    listing: bool = False
    #: ``routing.policy: prefix_affinity``: the key that picks the replica (a hash only).
    affinity: int | None = None
    #: ``overload``: what was degraded (``max_tokens``): the answer says so in a header.
    degraded: str | None = None
    #: The token-quota charge to settle when the request ends (``quota_gate.py``).
    held: Held | None = None
    #: The proxy asked for the stream's usage: the relay removes what that added.
    strip_usage: bool = False
    #: ``x-ratelimit-*`` headers for the answer (tenants with a quota or ``rate_per_s``).
    ratelimit: dict[str, str] | None = None
