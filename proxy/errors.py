"""Every outcome the proxy answers itself, as one exception tree.

Each class carries its HTTP status, its stable ``reason`` code (the public
contract of docs/REFERENCE.md) and the outcome label it is counted under
(section 12). Lower layers raise these; ``entrance.py`` is the only place that
turns one into an HTTP response, and ``upstream.py`` the only place that
translates aiohttp's client errors into them.

    ProxyError
    ├── Rejected                       outcome "rejected"
    │   ├── BadRequest                 400 bad_request
    │   ├── Unauthenticated            401 unauthenticated
    │   ├── PriorityNotAllowed         403 priority_not_allowed
    │   ├── RouteNotAllowed            404 route_not_allowed
    │   ├── ModelNotFound              404 model_not_found
    │   ├── ModelNotAllowed            403 model_not_allowed
    │   ├── NotFound                   404 not_found (reserved paths)
    │   ├── MethodNotAllowed           405 method_not_allowed (reserved paths)
    │   ├── BodyTooLarge               413 body_too_large
    │   ├── RateLimited                429 rate_limited
    │   ├── TokenQuotaExceeded         429 token_quota_exceeded
    │   ├── TenantQueueFull            429 tenant_queue_full
    │   ├── TenantConcurrency          429 tenant_concurrency
    │   ├── PredictedWaitExceedsBudget 503 predicted_wait_exceeds_budget
    │   ├── NoHealthyReplica           503 no_healthy_replica
    │   ├── ShuttingDown               503 shutting_down
    │   ├── RetryBudgetExhausted       503 retry_budget_exhausted
    │   ├── OverloadedConnections      503 overloaded_connections
    │   ├── StateUnavailable           503 state_unavailable
    │   └── NoPreviousConfig           409 no_previous_config (POST /admin/rollback)
    ├── TimedOut                       outcome "timed_out"
    │   ├── EntranceTimeout            408 entrance_timeout
    │   ├── QueueTimeout               503 queue_timeout
    │   ├── ConnectTimeout             504 connect_timeout
    │   ├── FirstByteTimeout           504 first_byte_timeout
    │   ├── IdleTimeout                504 idle_timeout
    │   └── TotalTimeout               504 total_timeout
    ├── UpstreamFailed                 outcome "failed"
    │   ├── UpstreamConnectError       502 upstream_connect_error
    │   └── UpstreamProtocolError      502 upstream_protocol_error
    │       └── ResetBeforeFirstByte   502 upstream_protocol_error
    └── InternalError                  500 internal_error, outcome "failed"

``retry_class`` names the ``retry.retry_on`` class a failure belongs to, or
``None`` when it is never retried.
"""

from __future__ import annotations

from typing import ClassVar, Literal

Outcome = Literal["completed", "rejected", "timed_out", "failed", "cancelled"]


class ProxyError(Exception):
    """An answer the proxy gives itself instead of the upstream's."""

    status: ClassVar[int] = 500
    reason: ClassVar[str] = "internal_error"
    outcome: ClassVar[Outcome] = "failed"
    retry_class: ClassVar[str | None] = None

    def __init__(self, message: str, *, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.message = message
        #: Seconds until a retry may succeed; rounded and clamped when sent.
        self.retry_after_s = retry_after_s

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.status}, {self.reason!r}, {self.message!r})"


class Rejected(ProxyError):
    outcome: ClassVar[Outcome] = "rejected"


class BadRequest(Rejected):
    status = 400
    reason = "bad_request"


class Unauthenticated(Rejected):
    status = 401
    reason = "unauthenticated"


class PriorityNotAllowed(Rejected):
    status = 403
    reason = "priority_not_allowed"


class RouteNotAllowed(Rejected):
    """A path outside the ``routes`` allow-list, or one of the proxy's own reached
    by another spelling: never forwarded."""

    status = 404
    reason = "route_not_allowed"


class ModelNotFound(Rejected):
    """A body's ``model`` that no replica serves, alias resolved (models.py)."""

    status = 404
    reason = "model_not_found"


class ModelNotAllowed(Rejected):
    """A served model outside the tenant's ``allowed_models``."""

    status = 403
    reason = "model_not_allowed"


class NotFound(Rejected):
    """An unknown ``/admin/*`` path (or replica)."""

    status = 404
    reason = "not_found"


class MethodNotAllowed(Rejected):
    """A reserved path asked with a method it does not serve; ``allow`` lists those it does."""

    status = 405
    reason = "method_not_allowed"

    def __init__(self, message: str, *, allow: tuple[str, ...]) -> None:
        super().__init__(message)
        self.allow = allow


class BodyTooLarge(Rejected):
    status = 413
    reason = "body_too_large"


class RateLimited(Rejected):
    status = 429
    reason = "rate_limited"


class TokenQuotaExceeded(Rejected):
    """The request's token estimate does not fit its tenant's ``token_quota``.

    ``window`` says which quota refused it; a ``day`` refusal's Retry-After is
    the time to 00:00 UTC, the one Retry-After not clamped to 60 s.
    """

    status = 429
    reason = "token_quota_exceeded"

    def __init__(self, message: str, *, retry_after_s: float, window: str) -> None:
        super().__init__(message, retry_after_s=retry_after_s)
        self.window = window


class TenantQueueFull(Rejected):
    status = 429
    reason = "tenant_queue_full"


class TenantConcurrency(Rejected):
    status = 429
    reason = "tenant_concurrency"


class PredictedWaitExceedsBudget(Rejected):
    status = 503
    reason = "predicted_wait_exceeds_budget"


class NoHealthyReplica(Rejected):
    status = 503
    reason = "no_healthy_replica"


class ShuttingDown(Rejected):
    status = 503
    reason = "shutting_down"


class RetryBudgetExhausted(Rejected):
    status = 503
    reason = "retry_budget_exhausted"


class OverloadedConnections(Rejected):
    """A connection opened while ``server.max_connections`` were open (listener.py)."""

    status = 503
    reason = "overloaded_connections"


class StateUnavailable(Rejected):
    """Shared state (``state.backend: redis``) unreachable with ``on_failure: reject``."""

    status = 503
    reason = "state_unavailable"


class NoPreviousConfig(Rejected):
    """``POST /admin/rollback`` with no earlier good config kept (or no config file)."""

    status = 409
    reason = "no_previous_config"


class TimedOut(ProxyError):
    outcome: ClassVar[Outcome] = "timed_out"
    #: The ``layer`` label of ``admission_timeouts_total``.
    layer: ClassVar[str] = "total"


class EntranceTimeout(TimedOut):
    status = 408
    reason = "entrance_timeout"
    layer = "entrance"


class QueueTimeout(TimedOut):
    status = 503
    reason = "queue_timeout"
    layer = "queue"


class ConnectTimeout(TimedOut):
    status = 504
    reason = "connect_timeout"
    layer = "connect"
    retry_class = "connect_timeout"


class FirstByteTimeout(TimedOut):
    status = 504
    reason = "first_byte_timeout"
    layer = "first_byte"
    retry_class = "first_byte_timeout"


class IdleTimeout(TimedOut):
    status = 504
    reason = "idle_timeout"
    layer = "idle"


class TotalTimeout(TimedOut):
    status = 504
    reason = "total_timeout"
    layer = "total"


class UpstreamFailed(ProxyError):
    outcome: ClassVar[Outcome] = "failed"
    status = 502


class UpstreamConnectError(UpstreamFailed):
    reason = "upstream_connect_error"
    retry_class = "connect_error"


class UpstreamProtocolError(UpstreamFailed):
    """The replica broke the exchange after its answer began: never retried."""

    reason = "upstream_protocol_error"


class ResetBeforeFirstByte(UpstreamProtocolError):
    """The replica closed or reset the connection before any body byte."""

    retry_class = "reset_before_first_byte"


class InternalError(ProxyError):
    """A bug: an exception no layer expected. Answered without details, logged with them."""

    status = 500
    reason = "internal_error"
