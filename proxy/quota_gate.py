"""The entrance's token-quota step, and the ``x-ratelimit-*`` headers of each answer.

``admit_tokens`` runs after the body is read (the estimate needs it): it
charges the estimate or refuses with 429 ``token_quota_exceeded`` (nothing
charged, no queue place or seat taken), asks the engine for the stream's
usage where the client did not, and returns the headers the answer carries.
``settle`` corrects the charge to what the request really used, once,
whatever ended it. ``refusal_headers`` gives a refused request of a limited
tenant the same headers. Tenants with neither ``token_quota`` nor
``rate_per_s`` pass through without a store call.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from proxy.admitted import BYTES_PER_TOKEN
from proxy.config_tenants import TenantConfig
from proxy.errors import TokenQuotaExceeded
from proxy.quotas import RateTake
from proxy.ratelimit_headers import request_headers, token_headers
from proxy.relay import Relayed
from proxy.state.quota import QuotaLimits, QuotaRefused, QuotaRemaining
from proxy.token_quota import Held, TokenQuotas, actual_tokens, limits_of, quota_estimate
from proxy.usage_request import USAGE_ROUTES, request_usage


@dataclass(slots=True)
class TokenGate:
    """What the quota step decided for one admitted request."""

    body: bytes
    held: Held | None = None
    strip_usage: bool = False
    #: The ``x-ratelimit-*`` headers of the answer (state at admission).
    headers: dict[str, str] = field(default_factory=dict)


def _bucket_headers(take: RateTake | None) -> dict[str, str]:
    if take is None:
        return {}
    return request_headers(take.level, take.burst, take.rate)


async def admit_tokens(
    quotas: TokenQuotas,
    rate: RateTake | None,
    tenant: str,
    config: TenantConfig,
    route: str,
    doc: dict[str, Any] | None,
    body: bytes,
    expected_output: float,
    served_model: str | None,
) -> TokenGate:
    """Charge the request's estimate, or raise ``TokenQuotaExceeded``.

    ``body`` is what goes upstream (an alias already replaced by
    ``served_model``); the estimate is taken on it as the client's prompt;
    ``rate`` is the request's turn at its tenant's bucket.
    """
    gate = TokenGate(body, headers=_bucket_headers(rate))
    quota = config.token_quota
    limits = limits_of(quota.per_minute, quota.per_day)
    if limits is None:
        return gate
    prompt_estimate = len(body) // BYTES_PER_TOKEN
    estimate = quota_estimate(len(body), doc, expected_output, quota.count)
    outcome, remaining = await quotas.charge(tenant, estimate, limits)
    gate.headers.update(token_headers(limits, remaining))
    if isinstance(outcome, QuotaRefused):
        raise TokenQuotaExceeded(
            _refusal(tenant, estimate, outcome.window, limits),
            retry_after_s=outcome.retry_after_s,
            window=outcome.window,
        )
    gate.held = Held(outcome, quota.count, prompt_estimate)
    if doc is not None and route in USAGE_ROUTES:
        asked = request_usage(doc)
        if asked is not None:
            if served_model is not None and isinstance(doc.get("model"), str):
                asked["model"] = served_model
            gate.body = json.dumps(asked).encode()
            gate.strip_usage = True
    return gate


def _refusal(tenant: str, estimate: int, window: str, limits: QuotaLimits) -> str:
    """The refusal's message; it says so when the request can never fit: its
    estimate is more than a whole window holds, so waiting would not help."""
    for name, limit in (("minute", limits.per_minute), ("day", limits.per_day)):
        if limit is not None and estimate > limit:
            return (
                f"this request is estimated at {estimate} tokens, more than the whole "
                f"token quota per {name} of tenant {tenant!r} ({limit}): it can never be "
                f"admitted; ask for fewer output tokens (max_tokens) or send a shorter prompt"
            )
    return (
        f"tenant {tenant!r} is over its token quota per {window} "
        f"({estimate} tokens estimated for this request)"
    )


async def settle(quotas: TokenQuotas, held: Held, relayed: Relayed | None) -> QuotaRemaining | None:
    """Correct the charge to the real usage (0 when no replica answered with a 2xx)."""
    if relayed is None:
        actual = 0
    else:
        actual = actual_tokens(
            held.count,
            held.prompt_estimate,
            relayed.status,
            relayed.input_tokens,
            relayed.output_tokens,
        )
    return await quotas.settle(held, actual)


async def refusal_headers(
    quotas: TokenQuotas, rate: RateTake | None, tenant: str, config: TenantConfig
) -> dict[str, str]:
    """A refused request's ``x-ratelimit-*`` headers: its bucket as its turn left it
    (None: refused before it), its token quota now."""
    headers = _bucket_headers(rate)
    limits = limits_of(config.token_quota.per_minute, config.token_quota.per_day)
    if limits is not None:
        headers.update(token_headers(limits, await quotas.remaining(tenant, limits)))
    return headers


def settled_headers(held: Held, remaining: QuotaRemaining, headers: dict[str, str]) -> None:
    """After a settlement: the token headers of ``headers`` count the real usage."""
    headers.update(token_headers(held.charge.limits, remaining))
