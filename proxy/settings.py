"""The configuration model: one frozen, validated tree built once and passed down.

The YAML keys of docs/REFERENCE.md are the field names here, in the same order,
and every default is a named constant next to the model that uses it. All
cross-field rules live in validators, so a bad config fails at start-up (or is
refused on reload) with *every* problem at its YAML path, never at the first
request. No module holds a global config: the CLI calls ``load_config`` and
hands the result to whoever needs it; a reload builds a new one.

Sources, highest rank first: constructor arguments, ``ADMISSION_*`` environment
variables (``ADMISSION_SERVER__PORT=9000``), the YAML document. The YAML is fed
through its own settings source ranked *below* the environment, because
pydantic-settings ranks constructor arguments above the environment: passing
the YAML as ``Config(**document)`` would let the file beat the environment.
No ``.env`` file and no secrets directory are ever read.

Choices the contract left open:

- a tenant's default ``priority`` is always allowed, whether or not it is
  listed in ``allowed_priorities`` (see ``TenantConfig.classes``);
- ``dump_effective_config(mask_secrets=True)`` masks every ``api_keys`` entry,
  ``sha256:`` hashes included (an unsalted hash of a short key is guessable);
- a YAML key given twice (a tenant defined twice) is an error, not "the last
  one wins"; replica, tenant and class names are ``[A-Za-z0-9][A-Za-z0-9_.-]*``
  since they end up in URLs, headers and metric labels;
- ``burst`` without ``rate_per_s`` is an error (it would silently do nothing);
  ``timeouts.connect_ms`` and ``idle_ms`` must be positive, and
  ``retry.max_backoff_ms`` at least ``base_backoff_ms``;
- an ``ADMISSION_PRIORITIES__<CLASS>__WEIGHT`` override changes or adds one
  class on top of the file's (or the default) classes;
- ``queue_ms + first_byte_ms`` must fit in ``total_ms`` (merged, per tenant),
  not only each alone: the total must also leave the generation some time;
- ``routes`` entries are normalised path prefixes (``paths.route_problem``);
  a reserved path as an entry, or no entry at all, is an error.
- ``model_aliases`` are one step (an alias naming an alias is an error); when
  every replica lists ``models``, a target must be one of them and an alias may
  not shadow one; with discovery, targets may appear later (``models.py``). A
  replica's ``models`` is null (discover) or a non-empty list without repeats.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from contextvars import ContextVar
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ModelWrapValidatorHandler,
    StringConstraints,
    ValidationError,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict
from pydantic_settings.exceptions import SettingsError

from proxy.config_errors import SHA256_PREFIX as SHA256_PREFIX
from proxy.config_errors import ConfigError as ConfigError
from proxy.config_errors import ConfigIssue as ConfigIssue
from proxy.config_errors import (
    anonymous_problem,
    budget_problems,
    issues_from_validation_error,
    read_document,
    replica_problems,
    rule,
    rule_violations,
    tenant_problems,
    valid_items,
    with_rule_violations,
)
from proxy.config_errors import hash_api_key as hash_api_key
from proxy.config_errors import stored_key_digest as stored_key_digest
from proxy.models import alias_problems
from proxy.paths import route_problem
from proxy.tls import TLS_KEYS, TlsFileError, load_context

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

ENV_PREFIX = "ADMISSION_"
ENV_NESTED_DELIMITER = "__"

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
#: Path prefixes forwarded to replicas: the inference, tokenizer and model routes
#: of the OpenAI-compatible servers (vLLM, SGLang, llama.cpp), TGI and llama.cpp's
#: own API. Engine control routes (a simulator's ``/sim/faults``, admin routes)
#: are not among them.
DEFAULT_ROUTES: tuple[str, ...] = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/embeddings",
    "/v1/models",
    "/v1/rerank",
    "/generate",
    "/generate_stream",
    "/tokenize",
    "/detokenize",
    "/completion",
    "/completions",
    "/embedding",
    "/embeddings",
    "/infill",
    "/rerank",
)
#: ``anonymous`` value that answers requests without a key with 401.
ANONYMOUS_REJECT = "reject"
DEFAULT_TENANT_PRIORITY = "standard"
DEFAULT_TENANT_WEIGHT = 1.0
DEFAULT_QUEUE_CAPACITY = 64
#: What ``dump_effective_config(mask_secrets=True)`` writes for every API key.
MASK = "***"

_HEX64 = re.compile(r"[0-9a-fA-F]{64}")

#: Replica, tenant and class names end up in URLs, metric labels and headers.
Name = Annotated[
    str, StringConstraints(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
]
#: A model or adapter name as engines spell it ("meta-llama/Llama-3.1-8B", a GGUF
#: path): anything non-empty without surrounding whitespace.
ModelName = Annotated[str, StringConstraints(min_length=1, max_length=256, pattern=r"^\S(.*\S)?$")]
#: An HTTP header name (an RFC 9110 token).
HeaderName = Annotated[str, StringConstraints(pattern=r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")]

#: Model pools and routing within a pool (docs/REFERENCE.md, Model pools).
DEFAULT_ROUTING_POLICY: Literal["least_loaded", "prefix_affinity"] = "least_loaded"
DEFAULT_AFFINITY_PREFIX_CHARS = 2_048
DEFAULT_AFFINITY_HEADER = "X-Session-Id"
DEFAULT_MAX_LOAD_FACTOR = 1.25


def _check_http_url(value: str) -> str:
    """An upstream URL: http(s), a host, no query or fragment; kept without trailing slash."""
    parts = urlsplit(value)
    try:
        parts.port  # noqa: B018 - raises on a port that is not a number in range
    except ValueError as exc:
        raise rule(f"invalid port in URL: {exc}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise rule("must be an http:// or https:// URL with a host")
    if parts.query or parts.fragment:
        raise rule("must not carry a query or a fragment")
    return value.rstrip("/")


def _check_api_key(value: str) -> str:
    """A key as clients send it, or ``sha256:<64 hex>`` (normalised to lower case)."""
    if not value or value != value.strip():
        raise rule("an API key must be non-empty, without surrounding whitespace")
    if value.startswith(SHA256_PREFIX):
        digest = value.removeprefix(SHA256_PREFIX)
        if not _HEX64.fullmatch(digest):
            raise rule("a sha256: entry must hold exactly 64 hexadecimal characters")
        return SHA256_PREFIX + digest.lower()
    return value


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
ApiKey = Annotated[str, AfterValidator(_check_api_key)]
Ratio = Annotated[float, Field(ge=0, le=1)]


class _Section(BaseModel):
    """Base of every section: frozen, and unknown keys are errors, not silently ignored."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


class ServerConfig(_Section):
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


class AdminConfig(_Section):
    """Where the admin bearer token lives; the token itself never sits in the file."""

    token_env: Annotated[str, StringConstraints(min_length=1)] = DEFAULT_ADMIN_TOKEN_ENV


class ReplicaConfig(_Section):
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


class RoutingConfig(_Section):
    """How a request picks a replica within its model's pool."""

    policy: Literal["least_loaded", "prefix_affinity"] = DEFAULT_ROUTING_POLICY
    #: ``prefix_affinity``: leading characters of the prompt that are hashed.
    affinity_prefix_chars: int = Field(default=DEFAULT_AFFINITY_PREFIX_CHARS, gt=0)
    #: A client header that, when present, is the affinity key instead of the prompt.
    affinity_header: HeaderName = DEFAULT_AFFINITY_HEADER
    #: Bounded load: a replica above this times its pool's mean load is skipped.
    max_load_factor: float = Field(default=DEFAULT_MAX_LOAD_FACTOR, ge=1.0)


class HealthConfig(_Section):
    """Active probes and passive ejection (docs/REFERENCE.md, Health and ejection)."""

    path: Annotated[str, AfterValidator(_check_path)] = DEFAULT_HEALTH_PATH
    interval_ms: int = Field(default=DEFAULT_HEALTH_INTERVAL_MS, gt=0)
    eject_after_failures: int = Field(default=DEFAULT_EJECT_AFTER_FAILURES, ge=1)
    eject_ms: int = Field(default=DEFAULT_EJECT_MS, gt=0)


class WarmupConfig(_Section):
    """Requests sent to a replica before it takes traffic; 0 turns warm-up off."""

    requests: int = Field(default=DEFAULT_WARMUP_REQUESTS, ge=0)


class SaturationConfig(_Section):
    """Engine-metric thresholds; ``None`` ignores that signal."""

    max_waiting: int | None = Field(default=None, ge=0)
    max_kv_cache: Ratio | None = None
    stale_ms: int = Field(default=DEFAULT_SATURATION_STALE_MS, gt=0)


class GpuConfig(_Section):
    """NVML sampling; the memory guard is off by default since vLLM preallocates ~90%."""

    memory_guard: Ratio | None = None
    sample_ms: int = Field(default=DEFAULT_GPU_SAMPLE_MS, gt=0)


class BudgetsConfig(_Section):
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


class BudgetOverrides(_Section):
    """A tenant's budgets; each ``None`` key inherits the global one."""

    queue_ms: int | None = Field(default=None, ge=0)
    first_byte_ms: int | None = Field(default=None, gt=0)
    total_ms: int | None = Field(default=None, gt=0)


class TimeoutsConfig(_Section):
    """Upstream socket timeouts, and how long a cancelled request keeps its seat."""

    connect_ms: int = Field(default=DEFAULT_CONNECT_MS, gt=0)
    idle_ms: int = Field(default=DEFAULT_IDLE_MS, gt=0)
    cancel_grace_ms: int = Field(default=DEFAULT_CANCEL_GRACE_MS, ge=0)


class RetryConfig(_Section):
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


class PriorityConfig(_Section):
    """A priority class: its share of seats when several classes are backlogged."""

    weight: float = Field(gt=0)


class TelemetryConfig(_Section):
    """Metric cardinality guard: tenants beyond the limit share the label ``other``."""

    max_tenant_labels: int = Field(default=DEFAULT_MAX_TENANT_LABELS, ge=1)


#: Shared admission state (docs/REFERENCE.md "Shared state"); ``local`` keeps it in memory.
DEFAULT_STATE_BACKEND: Literal["local", "redis"] = "local"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
DEFAULT_STATE_KEY_PREFIX = "admission:"
DEFAULT_LEASE_MS = 10_000
DEFAULT_STATE_TIMEOUT_MS = 50
DEFAULT_STATE_ON_FAILURE: Literal["local_share", "reject"] = "local_share"


def _check_redis_url(value: str) -> str:
    """A Redis URL as redis-py reads it: redis://, rediss:// (TLS) or unix://."""
    parts = urlsplit(value)
    try:
        parts.port  # noqa: B018 - raises on a port that is not a number in range
    except ValueError as exc:
        raise rule(f"invalid port in URL: {exc}") from None
    if parts.scheme in ("redis", "rediss") and parts.hostname:
        return value
    if parts.scheme == "unix" and parts.path:
        return value
    raise rule("must be a redis://host, rediss://host or unix:///path URL")


class StateConfig(_Section):
    """Where limits shared by several processes and instances live (Redis, or memory)."""

    backend: Literal["local", "redis"] = DEFAULT_STATE_BACKEND
    redis_url: Annotated[str, AfterValidator(_check_redis_url)] = DEFAULT_REDIS_URL
    key_prefix: Annotated[str, StringConstraints(min_length=1, pattern=r"^[^{}\s]+$")] = (
        DEFAULT_STATE_KEY_PREFIX
    )
    lease_ms: int = Field(default=DEFAULT_LEASE_MS, gt=0)
    timeout_ms: int = Field(default=DEFAULT_STATE_TIMEOUT_MS, gt=0)
    on_failure: Literal["local_share", "reject"] = DEFAULT_STATE_ON_FAILURE


class TenantConfig(_Section):
    """One tenant: its keys, class, fair-share weight, quotas and budget overrides."""

    api_keys: tuple[ApiKey, ...] = ()
    priority: str = DEFAULT_TENANT_PRIORITY
    allowed_priorities: tuple[str, ...] | None = None
    weight: float = Field(default=DEFAULT_TENANT_WEIGHT, gt=0)
    max_concurrency: int | None = Field(default=None, ge=1)
    queue_capacity: int = Field(default=DEFAULT_QUEUE_CAPACITY, ge=0)
    rate_per_s: float | None = Field(default=None, gt=0)
    burst: float | None = Field(default=None, ge=1)
    budgets: BudgetOverrides = BudgetOverrides()
    #: Models (or aliases) this tenant may use; ``None``: every model.
    allowed_models: tuple[ModelName, ...] | None = None

    @model_validator(mode="after")
    def _check_burst_has_rate(self) -> TenantConfig:
        if self.burst is not None and self.rate_per_s is None:
            message = "burst has no effect without rate_per_s"
            raise rule_violations(type(self).__name__, [(("burst",), message)])
        return self

    @property
    def effective_burst(self) -> float | None:
        """Bucket size: ``burst``, else ``max(1, rate_per_s)``; ``None`` when unlimited."""
        if self.rate_per_s is None:
            return None
        return self.burst if self.burst is not None else max(1.0, self.rate_per_s)

    def classes(self) -> frozenset[str]:
        """Classes this tenant may ask for; its default class is always among them."""
        return frozenset(self.allowed_priorities or ()) | {self.priority}


_DEFAULT_PRIORITIES_DOCUMENT = {name: {"weight": w} for name, w in DEFAULT_PRIORITY_WEIGHTS.items()}


def _default_priorities() -> dict[str, PriorityConfig]:
    return {name: PriorityConfig(weight=w) for name, w in DEFAULT_PRIORITY_WEIGHTS.items()}


#: The parsed YAML document that ``_DocumentSource`` serves to the ``Config`` being built.
_document: ContextVar[Mapping[str, Any] | None] = ContextVar("_document", default=None)


class _DocumentSource(PydanticBaseSettingsSource):
    """The YAML document as a settings source, ranked below the environment."""

    def __init__(
        self, settings_cls: type[BaseSettings], document: Mapping[str, Any] | None
    ) -> None:
        super().__init__(settings_cls)
        self._document = document

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return (self._document or {}).get(field_name), field_name, False

    def __call__(self) -> dict[str, Any]:
        """The document over the default classes, so that ``ADMISSION_PRIORITIES__X__WEIGHT``
        changes or adds one class instead of replacing them all; nothing when no document
        is being loaded (``Config(...)`` built directly)."""
        if self._document is None:
            return {}
        return {"priorities": dict(_DEFAULT_PRIORITIES_DOCUMENT), **self._document}


class Config(BaseSettings):
    """The whole configuration (docs/REFERENCE.md), in the key order of the YAML."""

    model_config = SettingsConfigDict(
        frozen=True,
        extra="forbid",
        allow_inf_nan=False,
        env_prefix=ENV_PREFIX,
        env_nested_delimiter=ENV_NESTED_DELIMITER,
        env_parse_none_str="null",
        env_file=None,
        secrets_dir=None,
        cli_parse_args=False,
    )

    server: ServerConfig = ServerConfig()
    admin: AdminConfig = AdminConfig()
    replicas: tuple[ReplicaConfig, ...]
    #: Client-facing name -> served model; upstream gets the target.
    model_aliases: dict[ModelName, ModelName] = Field(default_factory=dict)
    routing: RoutingConfig = RoutingConfig()
    health: HealthConfig = HealthConfig()
    warmup: WarmupConfig = WarmupConfig()
    saturation: SaturationConfig = SaturationConfig()
    gpu: GpuConfig = GpuConfig()
    budgets: BudgetsConfig = BudgetsConfig()
    timeouts: TimeoutsConfig = TimeoutsConfig()
    retry: RetryConfig = RetryConfig()
    priorities: dict[Name, PriorityConfig] = Field(default_factory=_default_priorities)
    telemetry: TelemetryConfig = TelemetryConfig()
    state: StateConfig = StateConfig()
    #: Path prefixes forwarded to replicas, matched by whole segments ("/" opens all).
    routes: tuple[Route, ...] = DEFAULT_ROUTES
    anonymous: str = ANONYMOUS_REJECT
    tenants: dict[Name, TenantConfig]

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """Constructor, then environment, then the YAML document; no dotenv, no secrets."""
        return (init_settings, env_settings, _DocumentSource(settings_cls, _document.get()))

    @field_validator("replicas", mode="wrap")
    @classmethod
    def _check_replicas(
        cls, value: Any, handler: ValidatorFunctionWrapHandler
    ) -> tuple[ReplicaConfig, ...]:
        """Names must be unique; checked among the valid replicas even when others fail."""
        try:
            replicas: tuple[ReplicaConfig, ...] = handler(value)
        except ValidationError as exc:
            problems = replica_problems(valid_items(value, ReplicaConfig))
            raise with_rule_violations(exc, problems) from None
        if not replicas:
            raise rule("at least one replica is required")
        problems = replica_problems(dict(enumerate(replicas)))
        if problems:
            raise rule_violations("replicas", problems)
        return replicas

    @field_validator("model_aliases")
    @classmethod
    def _check_model_aliases(cls, aliases: dict[str, str], info: ValidationInfo) -> dict[str, str]:
        """One-step aliases; targets must be served when every replica lists ``models``.

        Skipped against the replicas when they failed their own validation.
        """
        replicas: tuple[ReplicaConfig, ...] | None = info.data.get("replicas")
        static: set[str] | None = None
        if replicas and all(replica.models is not None for replica in replicas):
            static = {model for replica in replicas for model in replica.models or ()}
        problems = alias_problems(aliases, static)
        if problems:
            raise rule_violations("model_aliases", problems)
        return aliases

    @field_validator("priorities")
    @classmethod
    def _check_priorities(cls, priorities: dict[str, PriorityConfig]) -> dict[str, PriorityConfig]:
        if not priorities:
            raise rule("at least one priority class is required")
        return priorities

    @field_validator("routes")
    @classmethod
    def _check_routes(cls, routes: tuple[str, ...]) -> tuple[str, ...]:
        if not routes:
            raise rule('at least one route is required ("/" forwards every path)')
        return routes

    @field_validator("tenants", mode="wrap")
    @classmethod
    def _check_tenants(
        cls, value: Any, handler: ValidatorFunctionWrapHandler, info: ValidationInfo
    ) -> dict[str, TenantConfig]:
        """Rules between tenants and the sections before them, each at its own path.

        They run among the tenants that are valid on their own even when others
        are not, so one pass reports everything. Sections that failed their own
        validation are absent from ``info.data``; rules needing them are skipped.
        """
        try:
            tenants: dict[str, TenantConfig] = handler(value)
        except ValidationError as exc:
            valid = {str(k): t for k, t in valid_items(value, TenantConfig).items()}
            raise with_rule_violations(exc, tenant_problems(valid, info.data)) from None
        if not tenants:
            raise rule("at least one tenant is required")
        problems = tenant_problems(tenants, info.data)
        if problems:
            raise rule_violations("tenants", problems)
        return tenants

    @model_validator(mode="wrap")
    @classmethod
    def _check_anonymous(cls, data: Any, handler: ModelWrapValidatorHandler[Config]) -> Config:
        """``anonymous`` must name a configured tenant; checked even when other keys fail."""
        try:
            config = handler(data)
        except ValidationError as exc:
            raw = data if isinstance(data, Mapping) else {}
            anonymous = raw.get("anonymous", ANONYMOUS_REJECT)
            problem = anonymous_problem(anonymous, raw.get("tenants"), ANONYMOUS_REJECT)
            if problem is None or any(e["loc"][:1] == ("anonymous",) for e in exc.errors()):
                raise
            raise with_rule_violations(exc, [(("anonymous",), problem)]) from None
        problem = anonymous_problem(config.anonymous, config.tenants, ANONYMOUS_REJECT)
        if problem is not None:
            raise rule_violations(cls.__name__, [(("anonymous",), problem)])
        return config

    def budgets_for(self, tenant: str) -> BudgetsConfig:
        """The tenant's budgets: its overrides merged key by key over the global ones."""
        overrides = self.tenants[tenant].budgets.model_dump(exclude_none=True)
        return self.budgets.model_copy(update=overrides)

    def key_index(self) -> dict[str, str]:
        """SHA-256 hex of every key -> tenant name; build once per config, look up by hash."""
        return {
            stored_key_digest(entry): name
            for name, tenant in self.tenants.items()
            for entry in tenant.api_keys
        }


def parse_config(text: str, source: str = "<string>") -> Config:
    """A ``Config`` from YAML text plus ``ADMISSION_*`` overrides, or ``ConfigError``."""
    return config_from_mapping(read_document(text, source), source)


def load_config(path: str | os.PathLike[str]) -> Config:
    """Read and validate the config file at ``path``; every failure is a ``ConfigError``."""
    source = os.fspath(path)
    try:
        with open(source, encoding="utf-8") as file:
            text = file.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError([ConfigIssue("<file>", f"cannot read {source}: {exc}")], source) from None
    return parse_config(text, source)


def config_from_mapping(document: Mapping[str, Any], source: str = "<mapping>") -> Config:
    """Build a ``Config`` from an already parsed document; the environment still wins."""
    token = _document.set(document)
    try:
        return Config()
    except ValidationError as exc:
        issues = issues_from_validation_error(
            exc, env_prefix=ENV_PREFIX, env_delimiter=ENV_NESTED_DELIMITER
        )
        raise ConfigError(issues, source) from None
    except SettingsError as exc:
        raise ConfigError([_env_issue(exc)], source) from None
    finally:
        _document.reset(token)


def _env_issue(exc: SettingsError) -> ConfigIssue:
    """An override pydantic-settings could not decode (bad JSON for a list or a section)."""
    match = re.search(r'field "(\w+)"', str(exc))
    if match is None:
        return ConfigIssue("<env>", str(exc))
    prefix = f"{ENV_PREFIX}{match[1]}".upper()
    names = sorted(name for name in os.environ if name.upper().startswith(prefix))
    cause = f": {exc.__cause__}" if exc.__cause__ else ""
    return ConfigIssue(match[1], f"cannot decode environment variable {', '.join(names)}{cause}")


def dump_effective_config(config: Config, *, mask_secrets: bool = False) -> str:
    """The effective config as YAML, every default filled in, keys in the reference's order.

    With ``mask_secrets`` every ``api_keys`` entry, ``sha256:`` ones included,
    becomes ``"***"``; the output then no longer loads (its keys collide).
    """
    data = config.model_dump(mode="json")
    if mask_secrets:
        for tenant in data["tenants"].values():
            tenant["api_keys"] = [MASK for _ in tenant["api_keys"]]
    return yaml.safe_dump(data, sort_keys=False, allow_unicode=True, default_flow_style=False)
