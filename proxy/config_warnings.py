"""Settings that are valid but do nothing, or likely not what the operator meant.

A config that validates can still hold a knob that has no effect where it
stands: ``routing.affinity_header`` while the policy is ``least_loaded``, a
tenant ``weight`` with no other tenant to share with, a saturation threshold
with no replica ``metrics_url`` to read it from, two replica entries for one
engine (a copied block whose port was left as it was: the engine gets the
seats of both, which is right only when they split its knee between two
model pools), an ``ADMISSION_*`` override that sets nothing (a misspelt
section, or ``_`` where ``__`` was meant: pydantic-settings ignores both).
Each is not an error (the proxy runs as documented), but the operator who
wrote it expected something, so ``check-config`` prints it as a ``warning:``
line (exit 0 still), ``serve`` prints it at start and a reload logs it.
Warnings are ``ConfigIssue``s at the key's YAML path (``<env>`` for a
variable); nothing here does I/O beyond reading the environment.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

from pydantic import BaseModel

from proxy.config_errors import ConfigIssue
from proxy.settings import DEFAULT_ADMIN_TOKEN_ENV, ENV_NESTED_DELIMITER, ENV_PREFIX, Config


def config_warnings(config: Config, environ: Mapping[str, str] | None = None) -> list[ConfigIssue]:
    """Every setting of ``config`` that has no effect, or that points at nothing."""
    env = os.environ if environ is None else environ
    warnings: list[ConfigIssue] = []

    def warn(path: str, message: str) -> None:
        warnings.append(ConfigIssue(path, message))

    if config.routing.policy == "least_loaded":
        knobs = ("affinity_prefix_chars", "affinity_header", "max_load_factor")
        for key in _changed(config.routing, knobs):
            warn(f"routing.{key}", _NO_AFFINITY)
    if len(config.tenants) == 1:
        name, tenant = next(iter(config.tenants.items()))
        if _changed(tenant, ("weight",)):
            warn(f"tenants.{name}.weight", _ONE_TENANT)
    for name, tenant in config.tenants.items():
        allowed = tenant.allowed_priorities
        if allowed is not None and tenant.priority not in allowed:
            message = f"does not list the tenant's priority {tenant.priority!r}, {_OWN_CLASS}"
            warn(f"tenants.{name}.allowed_priorities", message)
    for i, replica in enumerate(config.replicas):
        if replica.api_key_env is not None and not env.get(replica.api_key_env):
            message = (
                f"environment variable {replica.api_key_env} is unset or empty here: {_NO_KEY}"
            )
            warn(f"replicas[{i}].api_key_env", message)
    first_url: dict[str, int] = {}
    for i, replica in enumerate(config.replicas):
        seen = first_url.setdefault(_url_identity(replica.url), i)
        if seen != i:
            warn(f"replicas[{i}].url", f"the same engine as replicas[{seen}]: {_TWICE}")
    if not any(r.metrics_url for r in config.replicas):
        for key in _changed(config.saturation, ("max_waiting", "max_kv_cache", "stale_ms")):
            warn(f"saturation.{key}", _NO_METRICS)
    if not any(r.gpu_index is not None for r in config.replicas) and _changed(
        config.gpu, ("memory_guard",)
    ):
        warn("gpu.memory_guard", "has no effect: no replica has a gpu_index")
    if config.overload.max_tokens_cap is None:
        for key in _changed(config.overload, ("at", "classes")):
            warn(f"overload.{key}", _NO_CAP)
    if config.state.backend == "local":
        keys = ("redis_url", "key_prefix", "lease_ms", "timeout_ms", "on_failure")
        for key in _changed(config.state, keys):
            warn(f"state.{key}", "has no effect with state.backend local")
    read = {config.admin.token_env, DEFAULT_ADMIN_TOKEN_ENV}
    read |= {r.api_key_env for r in config.replicas if r.api_key_env}
    for name in sorted(env):
        if name not in read:
            problem = _ignored_override(name)
            if problem is not None:
                warn("<env>", problem)
    return warnings


def _ignored_override(name: str) -> str | None:
    """Why ``ADMISSION_...`` variable ``name`` sets nothing, when it looks meant to.

    pydantic-settings ignores a variable that names no key, so a misspelt section
    (``ADMISSION_BUDGET__QUEUE_MS``) or one ``_`` where ``__`` separates a section
    from its key (``ADMISSION_STATE_BACKEND``) would leave the file's value in force
    without a word. Other ``ADMISSION_*`` names (the admin token's) are left alone.
    """
    if not name.upper().startswith(ENV_PREFIX):
        return None
    rest = name[len(ENV_PREFIX) :].lower()
    head, sep, _ = rest.partition(ENV_NESTED_DELIMITER)
    keys = list(Config.model_fields)
    if sep and head not in keys:
        close = difflib.get_close_matches(head, keys, n=1, cutoff=0.75)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        return f"{name} sets nothing: there is no top-level key {head!r}{hint}"
    for key in keys:
        if not sep and rest.startswith(f"{key}_") and isinstance(_section_default(key), BaseModel):
            meant = f"{ENV_PREFIX}{key}{ENV_NESTED_DELIMITER}{rest[len(key) + 1 :]}".upper()
            return f"{name} sets nothing: a key of {key} is set with two underscores ({meant})"
    return None


def _section_default(key: str) -> object:
    field = Config.model_fields[key]
    return None if field.is_required() else field.get_default(call_default_factory=True)


_NO_AFFINITY = "has no effect with routing.policy least_loaded (only prefix_affinity reads it)"
_ONE_TENANT = (
    "has no effect with a single tenant (a weight shares seats among the tenants of one class)"
)
_OWN_CLASS = "which is allowed all the same"
_NO_KEY = "no key would be sent to this replica"
_NO_METRICS = "has no effect: no replica has a metrics_url to read the engine's saturation from"
_TWICE = (
    "it gets the seats of both entries (a block copied without changing its port?); "
    "fine only when their max_concurrency add up to the engine's knee"
)
_NO_CAP = "has no effect while overload.max_tokens_cap is null (never degrade)"


def _changed(section: BaseModel, keys: tuple[str, ...]) -> list[str]:
    """The ``keys`` of ``section`` whose value is not the model's default."""
    fields: Mapping[str, Any] = type(section).model_fields
    return [key for key in keys if getattr(section, key) != fields[key].get_default()]


def _url_identity(url: str) -> str:
    """The engine a URL reaches, for comparing: scheme and host in lower case, the
    default port written out, no trailing slash (``HTTP://Host/`` is ``http://host:80``)."""
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme.lower() == "https" else 80)
    host = (parts.hostname or "").lower()
    return f"{parts.scheme.lower()}://{host}:{port}{parts.path.rstrip('/')}"
