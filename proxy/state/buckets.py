"""Tenants' ``rate_per_s`` buckets shared by every process: proxy/quotas.py on Redis.

Same answer as the local ``TokenBucket.take``: 0.0 when a token was taken,
else the seconds until the next one (the ``Retry-After`` of
``rate_limited``), and the tokens left (``x-ratelimit-remaining-requests``);
a refusal takes nothing. The hash holds ``tokens`` and
``stamp`` (ms) and expires once the bucket would be full again, since a
missing bucket reads as a full one.
"""

from __future__ import annotations

from proxy.quotas import RateTake
from proxy.state.client import StateClient, lua
from proxy.state.keys import StateKeys

_TAKE = lua(
    """
local now = now_ms()
local rate, burst = tonumber(ARGV[2]), tonumber(ARGV[3])
local b = redis.call('HMGET', KEYS[1], 'tokens', 'stamp')
local tokens, stamp = tonumber(b[1]) or burst, tonumber(b[2]) or now
tokens = math.min(burst, tokens + math.max(0, now - stamp) * rate / 1000)
local wait = 0
if tokens >= 1 then tokens = tokens - 1 else wait = (1 - tokens) / rate end
redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'stamp', tostring(now))
redis.call('PEXPIRE', KEYS[1], math.ceil(burst / rate * 1000) + 1000)
return {tostring(wait), tostring(tokens)}
"""
)


class SharedBuckets:
    """One bucket per tenant in Redis; rate and burst come with each call (reload-proof)."""

    __slots__ = ("_client", "_keys")

    def __init__(self, client: StateClient, keys: StateKeys) -> None:
        self._client = client
        self._keys = keys

    async def take(self, tenant: str, rate_per_s: float, burst: float) -> RateTake:
        """Take one token (``wait_s`` 0.0), else the seconds until there is one; with the
        tokens left, as the bucket shared by every process has them."""
        key = self._keys.bucket(tenant)
        wait, tokens = await self._client.run(_TAKE, [key], [rate_per_s, burst])
        return RateTake(float(wait), float(tokens), burst, rate_per_s)

    async def try_take(self, tenant: str, rate_per_s: float, burst: float) -> float:
        """Take one token: 0.0; else the seconds until there is one."""
        return (await self.take(tenant, rate_per_s, burst)).wait_s

    def __repr__(self) -> str:
        return f"<SharedBuckets {self._keys.prefix}>"
