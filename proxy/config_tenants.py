"""The ``tenants`` section: keys, class, fair-share weight, quotas and budget overrides.

Rules between tenants and the rest of the config run in ``Config`` (settings.py)
through ``config_rules.tenant_problems``; here is what one tenant checks alone.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import (
    AfterValidator,
    Field,
    model_validator,
)

from proxy.config_errors import (
    SHA256_PREFIX,
    rule,
    rule_violations,
)
from proxy.config_sections import ModelName, Section

__all__ = [
    "ANONYMOUS_REJECT",
    "DEFAULT_QUEUE_CAPACITY",
    "DEFAULT_TENANT_PRIORITY",
    "DEFAULT_TENANT_WEIGHT",
    "ApiKey",
    "BudgetOverrides",
    "TenantConfig",
    "TokenQuotaConfig",
]

ANONYMOUS_REJECT = "reject"
DEFAULT_TENANT_PRIORITY = "standard"
DEFAULT_TENANT_WEIGHT = 1.0
DEFAULT_QUEUE_CAPACITY = 64

_HEX64 = re.compile(r"[0-9a-fA-F]{64}")


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


ApiKey = Annotated[str, AfterValidator(_check_api_key)]


class BudgetOverrides(Section):
    """A tenant's budgets; each ``None`` key inherits the global one."""

    queue_ms: int | None = Field(default=None, ge=0)
    first_byte_ms: int | None = Field(default=None, gt=0)
    total_ms: int | None = Field(default=None, gt=0)


class TokenQuotaConfig(Section):
    """A tenant's token quotas; ``None``: no limit of that kind (docs/REFERENCE.md, token quotas).

    ``per_minute`` is a bucket of that many tokens refilling continuously over
    a minute, ``per_day`` a count per UTC calendar day. ``count`` says which
    tokens are charged: ``total`` (prompt and completion) or ``completion``.
    """

    per_minute: int | None = Field(default=None, ge=1)
    per_day: int | None = Field(default=None, ge=1)
    count: Literal["total", "completion"] = "total"

    @property
    def enabled(self) -> bool:
        return self.per_minute is not None or self.per_day is not None


class TenantConfig(Section):
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
    token_quota: TokenQuotaConfig = TokenQuotaConfig()

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
