"""Token quotas on the request path: charge the estimate, settle the real usage.

The counters live behind ``TokenQuotaStore`` (``state/quota.py``: in memory,
or in Redis when several processes share them); this module is the request
path's only caller of its three methods, so swapping the store changes
nothing here. What it adds:

- the estimate a request is charged when it is admitted (``quota_estimate``:
  prompt bytes / 4 plus the output limit, or the tenant's recent mean output
  when the request names none; no cap, so the bound below holds), and what
  it is charged in the end (``actual_tokens``);
- ``Held``: one request's charge until it is settled, exactly once;
- the last use seen per tenant (``QuotaSeen``), projected to now, for
  ``/admin/state`` and ``admission_quota_remaining_tokens``, which are read
  synchronously while the store may be remote.

Why charge at admission: the estimate is taken before the request waits or
runs, in one atomic step of the store, so requests in flight together can
overrun a quota by at most the amount their real usage exceeds their
estimates; a charge made when a stream ends lets every concurrent request
pass before the first one lands.
"""

from __future__ import annotations

import math
from collections.abc import Container
from dataclasses import dataclass
from typing import Any, Literal

from proxy.admitted import BYTES_PER_TOKEN
from proxy.clock import Clock
from proxy.engine_routes import output_limit
from proxy.state.quota import (
    DAY_S,
    MINUTE_S,
    Charge,
    QuotaLimits,
    QuotaRefused,
    QuotaRemaining,
    TokenQuotaStore,
)

Count = Literal["total", "completion"]


def quota_estimate(body_len: int, doc: Any, expected_output: float, count: Count) -> int:
    """Tokens charged at admission: the prompt estimate (unless ``completion``) and the output."""
    output = output_limit(doc)
    completion = output if output is not None else math.ceil(expected_output)
    return completion if count == "completion" else body_len // BYTES_PER_TOKEN + completion


def actual_tokens(
    count: Count,
    prompt_estimate: int,
    status: int,
    input_tokens: int | None,
    output_tokens: int | None,
) -> int:
    """What a request used in the end: 0 unless a replica answered it with a 2xx.

    The completion is the engine's count (usage, TGI's details, llama.cpp's
    timings) or, without any, the streamed content chunks relayed, which is
    also what a client that left mid-stream is charged. The prompt is the
    engine's count, else the estimate.
    """
    if not 200 <= status < 300:
        return 0
    completion = output_tokens or 0
    if count == "completion":
        return completion
    return (input_tokens if input_tokens is not None else prompt_estimate) + completion


@dataclass(slots=True)
class Held:
    """One admitted request's charge, until ``TokenQuotas.settle`` corrects it (once)."""

    charge: Charge
    count: Count
    prompt_estimate: int
    actual: int | None = None

    @property
    def settled(self) -> bool:
        return self.actual is not None


@dataclass(slots=True)
class QuotaSeen:
    """A tenant's quota as the store last reported it, at ``at`` (store clock seconds)."""

    limits: QuotaLimits
    remaining: QuotaRemaining
    at: float

    def minute_left(self, now: float) -> float | None:
        """The minute bucket refilled to ``now`` (exact for one process, close for several)."""
        per_minute, left = self.limits.per_minute, self.remaining.minute
        if per_minute is None or left is None:
            return None
        return min(float(per_minute), left + max(0.0, now - self.at) * per_minute / MINUTE_S)

    def day_left(self, now: float) -> int | None:
        per_day, left = self.limits.per_day, self.remaining.day
        if per_day is None or left is None:
            return None
        same_day = int(now // DAY_S) == int(self.at // DAY_S)
        return left if same_day else per_day


def limits_of(per_minute: int | None, per_day: int | None) -> QuotaLimits | None:
    if per_minute is None and per_day is None:
        return None
    return QuotaLimits(per_minute=per_minute, per_day=per_day)


class TokenQuotas:
    """The request path's side of the token quotas; the counters are in ``store``.

    quotas = TokenQuotas(LocalTokenQuotas(clock), clock)
    outcome, remaining = await quotas.charge("acme", 300, QuotaLimits(per_minute=1000))
    ...                                      # Charge: admitted; QuotaRefused: 429
    remaining = await quotas.settle(held, actual)
    """

    __slots__ = ("_clock", "_seen", "store")

    def __init__(self, store: TokenQuotaStore, clock: Clock) -> None:
        self.store = store
        #: The store's clock (seconds since the epoch): projects ``QuotaSeen`` to now.
        self._clock = clock
        self._seen: dict[str, QuotaSeen] = {}

    async def charge(
        self, tenant: str, estimate: int, limits: QuotaLimits
    ) -> tuple[Charge | QuotaRefused, QuotaRemaining]:
        """Charge ``estimate`` when it fits (nothing otherwise), and what is left after."""
        outcome = await self.store.charge(tenant, estimate, limits)
        if outcome.remaining is None:
            return outcome, await self.remaining(tenant, limits)
        self._saw(tenant, limits, outcome.remaining)
        return outcome, outcome.remaining

    async def settle(self, held: Held, actual: int) -> QuotaRemaining | None:
        """Correct the charge to ``actual``, once; None when already settled."""
        if held.actual is not None:
            return None
        held.actual = actual
        charge = held.charge
        remaining = await self.store.correct(charge, actual)
        self._saw(charge.tenant, charge.limits, remaining)
        return remaining

    async def remaining(self, tenant: str, limits: QuotaLimits) -> QuotaRemaining:
        remaining = await self.store.remaining(tenant, limits)
        self._saw(tenant, limits, remaining)
        return remaining

    def _saw(self, tenant: str, limits: QuotaLimits, remaining: QuotaRemaining) -> None:
        self._seen[tenant] = QuotaSeen(limits, remaining, self._clock.now())

    def use(self, tenant: str, limits: QuotaLimits | None) -> dict[str, Any] | None:
        """``/admin/state``'s ``quota`` of a tenant: per window its limit, use and what is left."""
        if limits is None:
            return None
        now = self._clock.now()
        seen = self._seen.get(tenant)
        windows: dict[str, Any] = {}
        for window, limit, left in (
            ("minute", limits.per_minute, None if seen is None else seen.minute_left(now)),
            ("day", limits.per_day, None if seen is None else seen.day_left(now)),
        ):
            if limit is None:
                continue
            remaining = limit if left is None else min(limit, math.floor(left))
            windows[window] = {"limit": limit, "used": limit - remaining, "remaining": remaining}
        # The status page shows one figure: the day's use when there is a day quota.
        shown = windows.get("day") or windows["minute"]
        unit = "tokens today" if "day" in windows else "tokens this minute"
        return {"used": shown["used"], "limit": shown["limit"], "unit": unit, **windows}

    def remaining_by_window(self, limits: dict[str, QuotaLimits]) -> dict[tuple[str, str], int]:
        """``(tenant, window) -> tokens left`` of every tenant with a quota, for the gauge."""
        gauges: dict[tuple[str, str], int] = {}
        for tenant, tenant_limits in limits.items():
            use = self.use(tenant, tenant_limits)
            if use is None:
                continue
            for window in ("minute", "day"):
                if window in use:
                    gauges[tenant, window] = use[window]["remaining"]
        return gauges

    def keep_tenants(self, keep: Container[str]) -> None:
        """Forget the last reading of tenants not in ``keep`` (a reload removed them);
        their counters stay in the store (a tenant put back keeps its day's use)."""
        for tenant in [t for t in self._seen if t not in keep]:
            del self._seen[tenant]

    def __repr__(self) -> str:
        return f"<TokenQuotas {len(self._seen)} tenants seen, {self.store!r}>"
