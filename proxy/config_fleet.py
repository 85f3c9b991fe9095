"""The fleet's sections: model pools' routing and the shared admission state.

``routing`` says how a request picks a replica within its model's pool
(``affinity.py``); ``state`` where limits shared by several processes and
instances live (``proxy/state/``).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import (
    AfterValidator,
    Field,
    StringConstraints,
)

from proxy.config_errors import (
    rule,
)
from proxy.config_sections import HeaderName, Section, split_url

__all__ = [
    "DEFAULT_AFFINITY_HEADER",
    "DEFAULT_AFFINITY_PREFIX_CHARS",
    "DEFAULT_LEASE_MS",
    "DEFAULT_MAX_LOAD_FACTOR",
    "DEFAULT_REDIS_URL",
    "DEFAULT_ROUTING_POLICY",
    "DEFAULT_STATE_BACKEND",
    "DEFAULT_STATE_KEY_PREFIX",
    "DEFAULT_STATE_ON_FAILURE",
    "DEFAULT_STATE_TIMEOUT_MS",
    "RoutingConfig",
    "StateConfig",
]

#: Model pools and routing within a pool (docs/REFERENCE.md, Model pools).
DEFAULT_ROUTING_POLICY: Literal["least_loaded", "prefix_affinity"] = "least_loaded"
DEFAULT_AFFINITY_PREFIX_CHARS = 2_048
DEFAULT_AFFINITY_HEADER = "X-Session-Id"
DEFAULT_MAX_LOAD_FACTOR = 1.25


class RoutingConfig(Section):
    """How a request picks a replica within its model's pool."""

    policy: Literal["least_loaded", "prefix_affinity"] = DEFAULT_ROUTING_POLICY
    #: ``prefix_affinity``: leading characters of the prompt that are hashed.
    affinity_prefix_chars: int = Field(default=DEFAULT_AFFINITY_PREFIX_CHARS, gt=0)
    #: A client header that, when present, is the affinity key instead of the prompt.
    affinity_header: HeaderName = DEFAULT_AFFINITY_HEADER
    #: Bounded load: a replica above this times its pool's mean load is skipped.
    max_load_factor: float = Field(default=DEFAULT_MAX_LOAD_FACTOR, ge=1.0)


#: Shared admission state (docs/REFERENCE.md "Shared state"); ``local`` keeps it in memory.
DEFAULT_STATE_BACKEND: Literal["local", "redis"] = "local"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
DEFAULT_STATE_KEY_PREFIX = "admission:"
DEFAULT_LEASE_MS = 10_000
DEFAULT_STATE_TIMEOUT_MS = 50
DEFAULT_STATE_ON_FAILURE: Literal["local_share", "reject"] = "local_share"


def _check_redis_url(value: str) -> str:
    """A Redis URL as redis-py reads it: redis://, rediss:// (TLS) or unix://."""
    parts = split_url(value)
    if parts.scheme in ("redis", "rediss") and parts.hostname:
        return value
    if parts.scheme == "unix" and parts.path:
        return value
    raise rule("must be a redis://host, rediss://host or unix:///path URL")


class StateConfig(Section):
    """Where limits shared by several processes and instances live (Redis, or memory)."""

    backend: Literal["local", "redis"] = DEFAULT_STATE_BACKEND
    redis_url: Annotated[str, AfterValidator(_check_redis_url)] = DEFAULT_REDIS_URL
    key_prefix: Annotated[str, StringConstraints(min_length=1, pattern=r"^[^{}\s]+$")] = (
        DEFAULT_STATE_KEY_PREFIX
    )
    lease_ms: int = Field(default=DEFAULT_LEASE_MS, gt=0)
    timeout_ms: int = Field(default=DEFAULT_STATE_TIMEOUT_MS, gt=0)
    on_failure: Literal["local_share", "reject"] = DEFAULT_STATE_ON_FAILURE
