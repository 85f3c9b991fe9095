"""Per-tenant entrance quotas: a token bucket on an injected clock.

Behind a small interface (``try_take``) so that a shared implementation (a
Redis script for a gateway tier) can replace the local one.
A refused request takes no token, and the refusal says exactly how long until
the next token: that is the ``Retry-After`` of ``rate_limited``.

    bucket = TokenBucket(rate_per_s=5, burst=10, clock=clock)
    wait = bucket.try_take()   # 0.0: admitted; > 0: seconds until a token
"""

from __future__ import annotations

from dataclasses import dataclass

from proxy.clock import Clock


@dataclass(frozen=True, slots=True)
class RateTake:
    """One request's turn at its tenant's bucket, local or shared: ``wait_s`` is 0.0 when
    it took a token, else the seconds until one; ``level`` is the tokens left after it
    (what ``x-ratelimit-remaining-requests`` says), with the bucket's ``burst`` and
    ``rate``. The headers come from this, never from a second look at a bucket, so a
    shared bucket's answer is what the client reads."""

    wait_s: float
    level: float
    burst: float
    rate: float


class TokenBucket:
    __slots__ = ("_clock", "_stamp", "_tokens", "burst", "rate")

    def __init__(self, rate_per_s: float, burst: float, clock: Clock) -> None:
        if rate_per_s <= 0 or burst < 1:
            raise ValueError("rate_per_s must be > 0 and burst >= 1")
        self.rate = rate_per_s
        self.burst = burst
        self._clock = clock
        self._tokens = burst
        self._stamp = clock.now()

    def _refill(self) -> None:
        now = self._clock.now()
        self._tokens = min(self.burst, self._tokens + (now - self._stamp) * self.rate)
        self._stamp = now

    def try_take(self) -> float:
        """Take one token if there is one: 0.0; else the seconds until there is."""
        self._refill()
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return 0.0
        return (1.0 - self._tokens) / self.rate

    def take(self) -> RateTake:
        """``try_take`` with the bucket's state after it, for the answer's headers."""
        wait = self.try_take()
        return RateTake(wait, self._tokens, self.burst, self.rate)

    def level(self) -> float:
        """Tokens in the bucket now (the ``x-ratelimit-remaining-requests`` header)."""
        self._refill()
        return self._tokens

    def reconfigure(self, rate_per_s: float, burst: float) -> None:
        """A reload changes the rate at once, keeping the tokens already earned."""
        self._refill()
        self.rate, self.burst = rate_per_s, burst
        self._tokens = min(self._tokens, burst)

    def __repr__(self) -> str:
        return f"<TokenBucket {self._tokens:.2f}/{self.burst} at {self.rate}/s>"


class EntranceQuotas:
    """One bucket per tenant that has ``rate_per_s``; tenants without one are unlimited."""

    __slots__ = ("_buckets", "_clock")

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._buckets: dict[str, TokenBucket] = {}

    def configure(self, rates: dict[str, tuple[float, float] | None]) -> None:
        """Apply ``tenant -> (rate, burst)`` (None: unlimited); kept buckets keep their tokens."""
        buckets: dict[str, TokenBucket] = {}
        for tenant, spec in rates.items():
            if spec is None:
                continue
            rate, burst = spec
            bucket = self._buckets.get(tenant)
            if bucket is None:
                bucket = TokenBucket(rate, burst, self._clock)
            else:
                bucket.reconfigure(rate, burst)
            buckets[tenant] = bucket
        self._buckets = buckets

    def bucket(self, tenant: str) -> TokenBucket | None:
        return self._buckets.get(tenant)

    def try_take(self, tenant: str) -> float:
        bucket = self._buckets.get(tenant)
        return 0.0 if bucket is None else bucket.try_take()

    def take(self, tenant: str) -> RateTake | None:
        """The tenant's turn at its bucket; None when it has no ``rate_per_s``."""
        bucket = self._buckets.get(tenant)
        return None if bucket is None else bucket.take()
