"""The configuration model: one frozen, validated tree built once and passed down.

The YAML keys of docs/REFERENCE.md are the field names of ``Config`` and of its
sections, in the same order, and every default is a named constant next to the
model that uses it. The sections live by concern in ``config_sections.py`` (the
request path's), ``config_tenants.py`` and ``config_fleet.py`` (routing within
a model pool, shared state); this module assembles them, loads the YAML and
the environment, and re-exports every name, so ``proxy.settings`` is the one
import for config. All
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
from typing import Any

import yaml
from pydantic import (
    Field,
    ModelWrapValidatorHandler,
    ValidationError,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict
from pydantic_settings.exceptions import SettingsError

from proxy import config_fleet, config_overload, config_sections, config_tenants
from proxy.config_errors import (
    SHA256_PREFIX,
    ConfigError,
    ConfigIssue,
    hash_api_key,
    issues_from_validation_error,
    mask_url_password,
    read_document,
    rule,
    rule_violations,
    stored_key_digest,
    with_rule_violations,
)
from proxy.config_fleet import *  # noqa: F403 - re-exported, see __all__
from proxy.config_fleet import RoutingConfig, StateConfig
from proxy.config_overload import *  # noqa: F403 - re-exported, see __all__
from proxy.config_overload import (
    DEFAULT_CONFIG_HISTORY,
    DEFAULT_MODE,
    Mode,
    OverloadConfig,
    overload_problems,
)
from proxy.config_rules import anonymous_problem, replica_problems, tenant_problems, valid_items
from proxy.config_sections import *  # noqa: F403 - re-exported, see __all__
from proxy.config_sections import (
    DEFAULT_PRIORITY_WEIGHTS,
    AdminConfig,
    BudgetsConfig,
    GpuConfig,
    HealthConfig,
    ModelName,
    Name,
    PriorityConfig,
    ReplicaConfig,
    RetryConfig,
    Route,
    SaturationConfig,
    ServerConfig,
    TelemetryConfig,
    TimeoutsConfig,
    WarmupConfig,
    refuse_boolean,
)
from proxy.config_tenants import *  # noqa: F403 - re-exported, see __all__
from proxy.config_tenants import ANONYMOUS_REJECT, TenantConfig
from proxy.models import alias_problems, static_models

#: Every config name, importable from here as it was before the sections moved out.
__all__ = [
    "DEFAULT_ROUTES", "ENV_NESTED_DELIMITER", "ENV_PREFIX", "MASK", "MAX_CONFIG_BYTES",
    "SHA256_PREFIX", "Config", "ConfigError", "ConfigIssue", "config_from_mapping",
    "dump_effective_config", "hash_api_key", "load_config", "parse_config", "read_config_bytes",
    "stored_key_digest",
]  # fmt: skip
__all__ += config_sections.__all__
__all__ += config_tenants.__all__
__all__ += config_fleet.__all__
__all__ += config_overload.__all__

ENV_PREFIX = "ADMISSION_"
ENV_NESTED_DELIMITER = "__"

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
#: The largest config file read: PyYAML parses about 4 MB/s, and a reload runs
#: beside the traffic; the largest real configs (thousands of tenants) are a
#: few MiB. A bigger file is refused unparsed.
MAX_CONFIG_BYTES = 8 * 2**20
#: ``anonymous`` value that answers requests without a key with 401.
#: What ``dump_effective_config(mask_secrets=True)`` writes for every API key.
MASK = "***"


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
    #: ``observe``: forward everything at once, count what ``enforce`` would refuse.
    mode: Mode = DEFAULT_MODE
    overload: OverloadConfig = OverloadConfig()
    #: Good configs kept for ``POST /admin/rollback``, the running one included.
    config_history: int = Field(default=DEFAULT_CONFIG_HISTORY, ge=1, le=100)
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

    @field_validator("*", mode="before")
    @classmethod
    def _no_booleans(cls, value: object) -> object:
        """No top-level key takes a boolean (``config_history: yes`` is not 1)."""
        return refuse_boolean(value)

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
        problems = alias_problems(aliases, static_models(info.data.get("replicas")))
        if problems:
            raise rule_violations("model_aliases", problems)
        return aliases

    @field_validator("priorities")
    @classmethod
    def _check_priorities(cls, priorities: dict[str, PriorityConfig]) -> dict[str, PriorityConfig]:
        if not priorities:
            raise rule("at least one priority class is required")
        return priorities

    @field_validator("overload")
    @classmethod
    def _check_overload(cls, overload: OverloadConfig, info: ValidationInfo) -> OverloadConfig:
        problems = overload_problems(overload, info.data.get("priorities"))
        if problems:
            raise rule_violations("overload", problems)
        return overload

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
        data = read_config_bytes(source)
        text = data.decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError([ConfigIssue("<file>", f"cannot read {source}: {exc}")], source) from None
    if len(data) > MAX_CONFIG_BYTES:
        message = (
            f"{source} is larger than {MAX_CONFIG_BYTES // 2**20} MiB: a config is a few "
            "KiB (is it the right file?)"
        )
        raise ConfigError([ConfigIssue("<file>", message)], source)
    return parse_config(text, source)


def read_config_bytes(path: str | os.PathLike[str]) -> bytes:
    """The file's bytes, at most ``MAX_CONFIG_BYTES`` + 1: a log file or a model's
    weights named by mistake is refused for its size, not read whole into memory."""
    with open(path, "rb") as file:
        return file.read(MAX_CONFIG_BYTES + 1)


def config_from_mapping(document: Mapping[str, Any], source: str = "<mapping>") -> Config:
    """Build a ``Config`` from an already parsed document; the environment still wins."""
    token = _document.set(document)
    try:
        return Config()
    except ValidationError as exc:
        issues = issues_from_validation_error(
            exc, env_prefix=ENV_PREFIX, env_delimiter=ENV_NESTED_DELIMITER, model=Config
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
    becomes ``"***"``, and so does the password of every URL that carries one
    (``state.redis_url``, a replica's ``url`` or ``metrics_url``); the output
    then no longer loads (its keys collide).
    """
    data = config.model_dump(mode="json")
    if mask_secrets:
        for tenant in data["tenants"].values():
            tenant["api_keys"] = [MASK for _ in tenant["api_keys"]]
        for replica in data["replicas"]:
            for key in ("url", "metrics_url"):
                if replica[key] is not None:
                    replica[key] = mask_url_password(replica[key])
        data["state"]["redis_url"] = mask_url_password(data["state"]["redis_url"])
    return yaml.safe_dump(data, sort_keys=False, allow_unicode=True, default_flow_style=False)
