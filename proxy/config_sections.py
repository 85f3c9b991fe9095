"""The config sections of the request path: listener, replicas, health, budgets, retries.

Each is a frozen model whose fields are the YAML keys of docs/REFERENCE.md, in
the same order, with every default a named constant above it. ``settings.py``
assembles them into ``Config`` and re-exports every name here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Literal
from urllib.parse import SplitResult, urlsplit

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    field_validator,
    model_validator,
)

from proxy.config_errors import (
    rule,
    rule_violations,
)
from proxy.config_rules import budget_problems
from proxy.paths import route_problem
from proxy.tls import TLS_KEYS, TlsFileError, load_context

__all__ = [
    "DEFAULT_ADMIN_TOKEN_ENV",
    "DEFAULT_BASE_BACKOFF_MS",
    "DEFAULT_CANCEL_GRACE_MS",
    "DEFAULT_CONNECT_MS",
    "DEFAULT_EJECT_AFTER_FAILURES",
    "DEFAULT_EJECT_MS",
    "DEFAULT_ENTRANCE_MS",
    "DEFAULT_FIRST_BYTE_MS",
    "DEFAULT_GPU_SAMPLE_MS",
    "DEFAULT_HEADER_MS",
    "DEFAULT_HEALTH_INTERVAL_MS",
    "DEFAULT_HEALTH_PATH",
    "DEFAULT_HOST",
    "DEFAULT_IDLE_MS",
    "DEFAULT_JITTER",
    "DEFAULT_KEEPALIVE_MS",
    "DEFAULT_MAX_ATTEMPTS",
    "DEFAULT_MAX_BACKOFF_MS",
    "DEFAULT_MAX_BODY_BYTES",
    "DEFAULT_MAX_CONNECTIONS",
    "DEFAULT_MAX_TENANT_LABELS",
    "DEFAULT_MIN_RETRIES_PER_S",
    "DEFAULT_PORT",
    "DEFAULT_PRIORITY_WEIGHTS",
    "DEFAULT_QUEUE_MS",
    "DEFAULT_RETRY_BUDGET_RATIO",
    "DEFAULT_RETRY_ON",
    "DEFAULT_SATURATION_STALE_MS",
    "DEFAULT_SHUTDOWN_GRACE_MS",
    "DEFAULT_TOTAL_MS",
    "DEFAULT_WARMUP_REQUESTS",
    "NOT_A_BOOLEAN",
    "AdminConfig",
    "BudgetsConfig",
    "GpuConfig",
    "HeaderName",
    "HealthConfig",
    "HttpUrlStr",
    "ModelName",
    "Name",
    "PriorityConfig",
    "Ratio",
    "ReplicaConfig",
    "RetryClass",
    "RetryConfig",
    "Route",
    "SaturationConfig",
    "Section",
    "ServerConfig",
    "TelemetryConfig",
    "TimeoutsConfig",
    "WarmupConfig",
    "refuse_boolean",
]

RetryClass = Literal[
    "connect_error",
    "connect_timeout",
    "first_byte_timeout",
    "reset_before_first_byte",
    "http_429",
    "http_500",
    "http_502",
    "http_503",
    "http_504",
]

DEFAULT_HOST = "0.0.0.0"
DEFAULT_PORT = 8080
DEFAULT_MAX_BODY_BYTES = 1_048_576
DEFAULT_ENTRANCE_MS = 5_000
DEFAULT_SHUTDOWN_GRACE_MS = 25_000
DEFAULT_HEADER_MS = 5_000
DEFAULT_KEEPALIVE_MS = 15_000
DEFAULT_MAX_CONNECTIONS = 4_096
DEFAULT_ADMIN_TOKEN_ENV = "ADMISSION_ADMIN_TOKEN"
DEFAULT_HEALTH_PATH = "/health"
DEFAULT_HEALTH_INTERVAL_MS = 2_000
DEFAULT_EJECT_AFTER_FAILURES = 3
DEFAULT_EJECT_MS = 5_000
DEFAULT_WARMUP_REQUESTS = 1
DEFAULT_SATURATION_STALE_MS = 2_000
DEFAULT_GPU_SAMPLE_MS = 1_000
DEFAULT_QUEUE_MS = 2_000
DEFAULT_FIRST_BYTE_MS = 10_000
DEFAULT_TOTAL_MS = 60_000
DEFAULT_CONNECT_MS = 1_000
DEFAULT_IDLE_MS = 15_000
DEFAULT_CANCEL_GRACE_MS = 1_000
DEFAULT_MAX_ATTEMPTS = 2
DEFAULT_BASE_BACKOFF_MS = 200
DEFAULT_MAX_BACKOFF_MS = 2_000
DEFAULT_JITTER: Literal["full"] = "full"
DEFAULT_RETRY_ON: tuple[RetryClass, ...] = (
    "connect_error",
    "connect_timeout",
    "http_429",
    "http_503",
)
DEFAULT_RETRY_BUDGET_RATIO = 0.2
DEFAULT_MIN_RETRIES_PER_S = 3.0
#: Class weights when ``priorities`` is absent: interactive first, batch never starved.
DEFAULT_PRIORITY_WEIGHTS: Mapping[str, float] = {"interactive": 8.0, "standard": 3.0, "batch": 1.0}
DEFAULT_MAX_TENANT_LABELS = 100

#: Replica, tenant and class names end up in URLs, metric labels and headers.
Name = Annotated[
    str, StringConstraints(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
]
#: A model or adapter name as engines spell it ("meta-llama/Llama-3.1-8B", a GGUF
#: path): anything non-empty without surrounding whitespace.
ModelName = Annotated[str, StringConstraints(min_length=1, max_length=256, pattern=r"^\S(.*\S)?$")]
#: An HTTP header name (an RFC 9110 token).
HeaderName = Annotated[str, StringConstraints(pattern=r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")]


def split_url(value: str) -> SplitResult:
    """``urlsplit``, and a port that is not a number in range is a rule violation."""
    parts = urlsplit(value)
    try:
        parts.port  # noqa: B018 - raises on a port that is not a number in range
    except ValueError as exc:
        raise rule(f"invalid port in URL: {exc}") from None
    return parts


def _check_http_url(value: str) -> str:
    """An upstream URL: http(s), a host, no query or fragment; kept without trailing slash."""
    parts = split_url(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise rule("must be an http:// or https:// URL with a host")
    if parts.query or parts.fragment:
        raise rule("must not carry a query or a fragment")
    return value.rstrip("/")


def _check_path(value: str) -> str:
    if not value.startswith("/"):
        raise rule('must start with "/"')
    return value


def _check_route(value: str) -> str:
    problem = route_problem(value)
    if problem is not None:
        raise rule(problem)
    return value


HttpUrlStr = Annotated[str, AfterValidator(_check_http_url)]
Route = Annotated[str, AfterValidator(_check_route)]
Ratio = Annotated[float, Field(ge=0, le=1)]


#: What a boolean written where no key takes one is told (pydantic would read
#: ``max_concurrency: true`` as 1, and ``on`` as a name would read as true).
NOT_A_BOOLEAN = (
    "no key here takes true or false (YAML reads unquoted yes, no, on, off, true and false "
    "as booleans: quote a word that is meant)"
)


def refuse_boolean(value: object) -> object:
    """A boolean is refused before pydantic turns it into a number (``true`` into 1)."""
    if isinstance(value, bool):
        raise rule(NOT_A_BOOLEAN)
    return value


class Section(BaseModel):
    """Base of every section: frozen, and unknown keys are errors, not silently ignored."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_booleans(cls, value: object) -> object:
        """No config key takes a boolean: ``max_concurrency: yes`` is a mistake, not 1."""
        return refuse_boolean(value)


class ServerConfig(Section):
    """The listening socket and limits applied before a request is queued."""

    host: Annotated[str, StringConstraints(min_length=1)] = DEFAULT_HOST
    port: int = Field(default=DEFAULT_PORT, ge=1, le=65_535)
    max_body_bytes: int = Field(default=DEFAULT_MAX_BODY_BYTES, gt=0)
    entrance_ms: int = Field(default=DEFAULT_ENTRANCE_MS, gt=0)
    shutdown_grace_ms: int = Field(default=DEFAULT_SHUTDOWN_GRACE_MS, ge=0)
    #: The listener's limits (listener.py); read at start-up, a change needs a restart.
    header_ms: int = Field(default=DEFAULT_HEADER_MS, gt=0)
    keepalive_ms: int = Field(default=DEFAULT_KEEPALIVE_MS, gt=0)
    max_connections: int = Field(default=DEFAULT_MAX_CONNECTIONS, gt=0)


class AdminConfig(Section):
    """Where the admin bearer token lives; the token itself never sits in the file."""

    token_env: Annotated[str, StringConstraints(min_length=1)] = DEFAULT_ADMIN_TOKEN_ENV


class ReplicaConfig(Section):
    """One upstream inference server and its seat count (the staircase knee)."""

    name: Name
    url: HttpUrlStr
    max_concurrency: int = Field(ge=1)
    #: Seats above the knee that only tenants below their fair share may take:
    #: a light tenant then starts at once while a flood holds every regular
    #: seat. The engine must have the room (vLLM ``max_num_seqs``, llama.cpp
    #: ``--parallel`` at least ``max_concurrency + headroom``).
    headroom: int = Field(default=0, ge=0)
    metrics_url: HttpUrlStr | None = None
    api_key_env: str | None = None
    #: TLS to an https replica (``tls.py``): a CA bundle that replaces the
    #: system trust store for this replica, and a client certificate with its
    #: key for mutual TLS (both or neither). Paths are read at validation.
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    gpu_index: int | None = Field(default=None, ge=0)
    #: Names this replica serves (base models and LoRA adapters); ``None``:
    #: discovered from its ``GET /v1/models`` at warm-up and on every probe.
    models: tuple[ModelName, ...] | None = None

    @field_validator("models")
    @classmethod
    def _check_models(cls, models: tuple[str, ...] | None) -> tuple[str, ...] | None:
        if models is None:
            return None
        if not models:
            raise rule("list at least one model, or null to discover them from /v1/models")
        repeated = sorted({m for m in models if models.count(m) > 1})
        if repeated:
            raise rule(f"model listed twice: {', '.join(repeated)}")
        return models

    @model_validator(mode="after")
    def _check_tls(self) -> ReplicaConfig:
        """TLS files only for https, and they must load now, not at the first request."""
        given = [key for key in TLS_KEYS if getattr(self, key) is not None]
        if not given:
            return self
        urls = (self.url, self.metrics_url or "")
        if not any(urlsplit(url).scheme == "https" for url in urls):
            problems = [((key,), "only used with an https:// url or metrics_url") for key in given]
            raise rule_violations(type(self).__name__, problems)
        try:
            load_context(self)
        except TlsFileError as exc:
            raise rule_violations(type(self).__name__, [((exc.key,), str(exc))]) from None
        return self


class HealthConfig(Section):
    """Active probes and passive ejection (docs/REFERENCE.md, Health and ejection)."""

    path: Annotated[str, AfterValidator(_check_path)] = DEFAULT_HEALTH_PATH
    interval_ms: int = Field(default=DEFAULT_HEALTH_INTERVAL_MS, gt=0)
    eject_after_failures: int = Field(default=DEFAULT_EJECT_AFTER_FAILURES, ge=1)
    eject_ms: int = Field(default=DEFAULT_EJECT_MS, gt=0)


class WarmupConfig(Section):
    """Requests sent to a replica before it takes traffic; 0 turns warm-up off."""

    requests: int = Field(default=DEFAULT_WARMUP_REQUESTS, ge=0)


class SaturationConfig(Section):
    """Engine-metric thresholds; ``None`` ignores that signal."""

    max_waiting: int | None = Field(default=None, ge=0)
    max_kv_cache: Ratio | None = None
    stale_ms: int = Field(default=DEFAULT_SATURATION_STALE_MS, gt=0)


class GpuConfig(Section):
    """NVML sampling; the memory guard is off by default since vLLM preallocates ~90%."""

    memory_guard: Ratio | None = None
    sample_ms: int = Field(default=DEFAULT_GPU_SAMPLE_MS, gt=0)


class BudgetsConfig(Section):
    """Per-layer wait budgets; ``total_ms`` runs from arrival and clips every other layer."""

    queue_ms: int = Field(default=DEFAULT_QUEUE_MS, ge=0)
    first_byte_ms: int = Field(default=DEFAULT_FIRST_BYTE_MS, gt=0)
    total_ms: int = Field(default=DEFAULT_TOTAL_MS, gt=0)

    @model_validator(mode="after")
    def _check_layers_fit_total(self) -> BudgetsConfig:
        problems = budget_problems(self.queue_ms, self.first_byte_ms, self.total_ms)
        if problems:
            raise rule_violations(type(self).__name__, [((k,), m) for k, m in problems])
        return self


class TimeoutsConfig(Section):
    """Upstream socket timeouts, and how long a cancelled request keeps its seat."""

    connect_ms: int = Field(default=DEFAULT_CONNECT_MS, gt=0)
    idle_ms: int = Field(default=DEFAULT_IDLE_MS, gt=0)
    cancel_grace_ms: int = Field(default=DEFAULT_CANCEL_GRACE_MS, ge=0)


class RetryConfig(Section):
    """Which failures are retried, how far apart, and the fleet-wide retry budget."""

    max_attempts: int = Field(default=DEFAULT_MAX_ATTEMPTS, ge=1)
    base_backoff_ms: int = Field(default=DEFAULT_BASE_BACKOFF_MS, ge=0)
    max_backoff_ms: int = Field(default=DEFAULT_MAX_BACKOFF_MS, ge=0)
    jitter: Literal["full", "equal", "none"] = DEFAULT_JITTER
    retry_on: tuple[RetryClass, ...] = DEFAULT_RETRY_ON
    budget_ratio: float = Field(default=DEFAULT_RETRY_BUDGET_RATIO, ge=0)
    min_retries_per_s: float = Field(default=DEFAULT_MIN_RETRIES_PER_S, ge=0)

    @model_validator(mode="after")
    def _check_backoff_order(self) -> RetryConfig:
        if self.max_backoff_ms < self.base_backoff_ms:
            message = f"max_backoff_ms is below base_backoff_ms ({self.base_backoff_ms})"
            raise rule_violations(type(self).__name__, [(("max_backoff_ms",), message)])
        return self


class PriorityConfig(Section):
    """A priority class: its share of seats when several classes are backlogged."""

    weight: float = Field(gt=0)


class TelemetryConfig(Section):
    """Metric cardinality guard: tenants beyond the limit share the label ``other``."""

    max_tenant_labels: int = Field(default=DEFAULT_MAX_TENANT_LABELS, ge=1)
