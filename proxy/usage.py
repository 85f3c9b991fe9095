"""Who has been using less than their fair share lately: decayed token counters.

Why: fair queuing decides the order of *waiting* tickets, but without
preemption a light tenant that arrives while a flood holds every seat still
waits for a seat to free; under a 10x neighbour that wait is its whole p99.
Replicas may therefore offer a few ``headroom`` seats above their knee that
only a tenant below its fair share may take. "Below its share" has to be a
rate over the recent past, not a count of seats held now: a light tenant's
Poisson bursts briefly hold more than its seat share, and must stay protected
while they do, whereas a flooding tenant sits above its share all the time.

Each tenant and the fleet keep one exponentially decayed sum of dispatched
cost (tokens); the ratio of the two is the tenant's recent fraction of the
work. Both decay with the same time constant, so the ratio needs no clock
alignment beyond bringing both up to ``now``. O(1) per dispatch and per query.
"""

from __future__ import annotations

import math

#: Time constant of the decay: a few seconds of seat turnover, so a flood is
#: recognised within a second or two and a past burst is forgotten as fast.
DEFAULT_TAU_S = 2.0


class _Decayed:
    __slots__ = ("at", "value")

    def __init__(self) -> None:
        self.value = 0.0
        self.at = 0.0

    def read(self, now: float, tau_s: float) -> float:
        if now > self.at:
            self.value *= math.exp((self.at - now) / tau_s)
            self.at = now
        return self.value


class RecentUsage:
    """Decayed dispatched cost per tenant and in total."""

    __slots__ = ("_fleet", "_tau_s", "_tenants")

    def __init__(self, tau_s: float = DEFAULT_TAU_S) -> None:
        self._tau_s = tau_s
        self._fleet = _Decayed()
        self._tenants: dict[str, _Decayed] = {}

    def record(self, tenant: str, cost: float, now: float) -> None:
        counter = self._tenants.get(tenant)
        if counter is None:
            counter = self._tenants[tenant] = _Decayed()
            counter.at = now
        counter.value = counter.read(now, self._tau_s) + cost
        self._fleet.value = self._fleet.read(now, self._tau_s) + cost

    def fraction(self, tenant: str, now: float) -> float:
        """The tenant's share of the recent work, 0 for a tenant not seen lately."""
        total = self._fleet.read(now, self._tau_s)
        counter = self._tenants.get(tenant)
        if counter is None or total <= 0.0:
            return 0.0
        return counter.read(now, self._tau_s) / total

    def forget_idle(self, now: float, below: float = 1e-3) -> None:
        """Drop tenants whose counters decayed to nothing (bounded memory)."""
        tau = self._tau_s
        idle = [t for t, c in self._tenants.items() if c.read(now, tau) < below]
        for tenant in idle:
            del self._tenants[tenant]

    def __len__(self) -> int:
        return len(self._tenants)
