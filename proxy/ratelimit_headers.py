"""OpenAI's ``x-ratelimit-*`` headers, from a tenant's token quota and request bucket.

OpenAI's SDKs, and the dashboards built on them, read these to pace a
client: limit, remaining and reset (a Go-style duration such as ``1s``,
``6m0s`` or ``17ms``: the time until the limit is back to its full value).
The token headers describe the window that binds now (the one with fewer
tokens left; the minute on a tie); the request headers the ``rate_per_s``
bucket (its size is the limit). No I/O here.
"""

from __future__ import annotations

import math

from proxy.state.quota import MINUTE_S, QuotaLimits, QuotaRemaining


def go_duration(seconds: float) -> str:
    """``17ms``, ``1s``, ``6m0s``, ``23h59m59s``: whole units, rounded up."""
    if seconds <= 0:
        return "0s"
    if seconds < 1:
        return f"{math.ceil(seconds * 1000)}ms"
    hours, rest = divmod(math.ceil(seconds), 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes}m{secs}s"
    if minutes:
        return f"{minutes}m{secs}s"
    return f"{secs}s"


def token_headers(limits: QuotaLimits, remaining: QuotaRemaining) -> dict[str, str]:
    minute: tuple[int, int, float] | None = None
    if limits.per_minute is not None:
        left = remaining.minute if remaining.minute is not None else limits.per_minute
        left = max(0, min(limits.per_minute, left))
        refill_s = (limits.per_minute - left) * MINUTE_S / limits.per_minute
        minute = (limits.per_minute, left, refill_s)
    day: tuple[int, int, float] | None = None
    if limits.per_day is not None:
        left = remaining.day if remaining.day is not None else limits.per_day
        day = (limits.per_day, left, remaining.day_resets_in_s if left < limits.per_day else 0.0)
    binding = minute if day is None or (minute is not None and minute[1] <= day[1]) else day
    assert binding is not None
    limit, left, reset_s = binding
    return {
        "x-ratelimit-limit-tokens": str(limit),
        "x-ratelimit-remaining-tokens": str(left),
        "x-ratelimit-reset-tokens": go_duration(reset_s),
    }


def request_headers(tokens: float, burst: float, rate_per_s: float) -> dict[str, str]:
    """The ``rate_per_s`` bucket: ``burst`` requests at most, refilled at ``rate_per_s``."""
    return {
        "x-ratelimit-limit-requests": str(math.floor(burst)),
        "x-ratelimit-remaining-requests": str(max(0, math.floor(tokens))),
        "x-ratelimit-reset-requests": go_duration((burst - tokens) / rate_per_s),
    }
