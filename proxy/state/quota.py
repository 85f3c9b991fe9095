"""Token quotas (per minute, per UTC day): the interface, and its in-memory implementation.

``TokenQuotaStore`` is what admission calls (``token_quota.TokenQuotas``):
``charge`` a request's estimate when it is admitted (refused, with the seconds
until it would fit, when it does not), ``correct`` the charge by the
difference once the real usage is known, ``remaining`` for the
``x-ratelimit-*`` headers. ``charge`` and ``correct`` also say what is left
after them, in the same step (one round trip to Redis, not two). The
per-minute quota is a bucket of ``per_minute`` tokens refilling continuously
over a minute; the per-day one a counter per UTC calendar day. A correction
never takes a counter below zero nor the bucket above full, and a correction
arriving after midnight leaves the new day alone.

``LocalTokenQuotas`` keeps that in memory for one process; quota_redis.py
keeps it in Redis for several. Both read time from a clock of seconds since
the epoch (UTC days), injected so the tests move it by hand. No I/O here.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Literal, Protocol

from proxy.clock import Clock

DAY_S = 86_400
MINUTE_S = 60.0


@dataclass(frozen=True, slots=True)
class QuotaRemaining:
    minute: int | None
    day: int | None
    #: Seconds until 00:00 UTC, when the day's counter starts again.
    day_resets_in_s: float


@dataclass(frozen=True, slots=True)
class QuotaLimits:
    """A tenant's ``token_quota``; None: no limit of that kind."""

    per_minute: int | None = None
    per_day: int | None = None


@dataclass(frozen=True, slots=True)
class Charge:
    """An admitted request's charge: what to correct, and on which UTC day it was made."""

    tenant: str
    tokens: int
    day: int
    limits: QuotaLimits
    #: What is left once this charge is made (None from a store that does not say).
    remaining: QuotaRemaining | None = None


@dataclass(frozen=True, slots=True)
class QuotaRefused:
    """The estimate does not fit; it would in ``retry_after_s`` (the longer of the two)."""

    retry_after_s: float
    window: Literal["minute", "day"]
    #: What is left now (nothing was charged).
    remaining: QuotaRemaining | None = None


class TokenQuotaStore(Protocol):
    async def charge(
        self, tenant: str, estimate: int, limits: QuotaLimits
    ) -> Charge | QuotaRefused:
        """Charge ``estimate`` tokens if they fit every limit; else charge nothing."""
        ...

    async def correct(self, charge: Charge, actual: int) -> QuotaRemaining:
        """Replace the estimate by the real usage (the difference, either sign); what is left."""
        ...

    async def remaining(self, tenant: str, limits: QuotaLimits) -> QuotaRemaining: ...


class WallClock:
    """Seconds since the epoch: day boundaries are UTC midnights."""

    __slots__ = ()

    def now(self) -> float:
        return time.time()


def minute_wait(tokens: float, estimate: int, per_minute: int) -> float:
    """Seconds until ``estimate`` fits a bucket holding ``tokens`` (60 when it never fits)."""
    if estimate > per_minute:
        return MINUTE_S
    return min(MINUTE_S, (estimate - tokens) * MINUTE_S / per_minute)


class _Tenant:
    __slots__ = ("day", "stamp", "tokens", "used")

    def __init__(self, now: float) -> None:
        self.tokens: float | None = None
        self.stamp = now
        self.day = int(now // DAY_S)
        self.used = 0


def _left(state: _Tenant, limits: QuotaLimits, now: float) -> QuotaRemaining:
    minute = None if state.tokens is None else math.floor(state.tokens)
    day = None if limits.per_day is None else max(0, limits.per_day - state.used)
    return QuotaRemaining(minute, day, (state.day + 1) * DAY_S - now)


class LocalTokenQuotas:
    """``TokenQuotaStore`` in memory, for one process (``state.backend: local``)."""

    __slots__ = ("_clock", "_tenants")

    def __init__(self, clock: Clock | None = None) -> None:
        self._clock: Clock = clock or WallClock()
        self._tenants: dict[str, _Tenant] = {}

    def _state(self, tenant: str, limits: QuotaLimits) -> tuple[_Tenant, float]:
        now = self._clock.now()
        state = self._tenants.get(tenant)
        if state is None:
            state = self._tenants[tenant] = _Tenant(now)
        if limits.per_minute is not None:
            full = float(limits.per_minute)
            tokens = full if state.tokens is None else state.tokens
            refill = max(0.0, now - state.stamp) * full / MINUTE_S
            state.tokens = min(full, tokens + refill)
        state.stamp = now
        day = int(now // DAY_S)
        if day != state.day:
            state.day, state.used = day, 0
        return state, now

    async def charge(
        self, tenant: str, estimate: int, limits: QuotaLimits
    ) -> Charge | QuotaRefused:
        state, now = self._state(tenant, limits)
        refused: QuotaRefused | None = None
        minute = limits.per_minute
        if minute is not None and state.tokens is not None and estimate > state.tokens:
            wait = minute_wait(state.tokens, estimate, minute)
            refused = QuotaRefused(wait, "minute")
        if limits.per_day is not None and state.used + estimate > limits.per_day:
            wait = (state.day + 1) * DAY_S - now
            if refused is None or wait > refused.retry_after_s:
                refused = QuotaRefused(wait, "day")
        if refused is not None:
            return QuotaRefused(refused.retry_after_s, refused.window, _left(state, limits, now))
        if state.tokens is not None:
            state.tokens -= estimate
        state.used += estimate
        return Charge(tenant, estimate, state.day, limits, _left(state, limits, now))

    async def correct(self, charge: Charge, actual: int) -> QuotaRemaining:
        state, now = self._state(charge.tenant, charge.limits)
        diff = actual - charge.tokens
        if charge.limits.per_minute is not None and state.tokens is not None:
            state.tokens = max(0.0, min(float(charge.limits.per_minute), state.tokens - diff))
        if state.day == charge.day:
            state.used = max(0, state.used + diff)
        return _left(state, charge.limits, now)

    async def remaining(self, tenant: str, limits: QuotaLimits) -> QuotaRemaining:
        state, now = self._state(tenant, limits)
        return _left(state, limits, now)

    def __repr__(self) -> str:
        return f"<LocalTokenQuotas {len(self._tenants)} tenants>"
