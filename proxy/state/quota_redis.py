"""``TokenQuotaStore`` on Redis: the same rules as quota.py, shared by every process.

Both of a tenant's keys carry its hash tag, so one script checks and charges
the minute bucket and the day counter together. The day counter is a hash
field named by the UTC day number (days since the epoch, from server time);
the key expires an hour after that day ends.
"""

from __future__ import annotations

import math

from proxy.state.client import StateClient, lua
from proxy.state.keys import StateKeys
from proxy.state.quota import Charge, QuotaLimits, QuotaRefused, QuotaRemaining

#: Reads the bucket (refilled to now) and the day's use; ARGV[3], ARGV[4]: per_minute, per_day.
_READ = """
local now = now_ms()
local per_min, per_day = tonumber(ARGV[3]), tonumber(ARGV[4])
local day = math.floor(now / 86400000)
local tokens = nil
if per_min then
  local b = redis.call('HMGET', KEYS[1], 'tokens', 'stamp')
  local stamp = tonumber(b[2]) or now
  local refill = math.max(0, now - stamp) * per_min / 60000
  tokens = math.min(per_min, (tonumber(b[1]) or per_min) + refill)
end
local used = tonumber(redis.call('HGET', KEYS[2], tostring(day))) or 0
local function save(new_tokens, new_used)
  if per_min then
    redis.call('HSET', KEYS[1], 'tokens', tostring(new_tokens), 'stamp', tostring(now))
    redis.call('PEXPIRE', KEYS[1], 61000)
  end
  redis.call('HSET', KEYS[2], tostring(day), new_used)
  redis.call('HDEL', KEYS[2], tostring(day - 1))
  redis.call('PEXPIRE', KEYS[2], math.ceil((day + 1) * 86400000 + 3600000 - now))
end
"""

_CHARGE = lua(
    _READ
    + """
local est = tonumber(ARGV[2])
local wait, window = 0, ''
if per_min and est > tokens then
  window = 'minute'
  if est > per_min then wait = 60 else wait = math.min(60, (est - tokens) * 60 / per_min) end
end
if per_day and used + est > per_day then
  local left = ((day + 1) * 86400000 - now) / 1000
  if window == '' or left > wait then wait, window = left, 'day' end
end
local left = tostring(((day + 1) * 86400000 - now) / 1000)
if window ~= '' then return {0, tostring(wait), window, day, tostring(tokens or ''), used, left} end
save(tokens and tokens - est, used + est)
return {1, '0', '', day, tostring(tokens and tokens - est or ''), used + est, left}
"""
)

_CORRECT = lua(
    _READ
    + """
local diff, charged_day = tonumber(ARGV[2]), tonumber(ARGV[5])
if per_min then tokens = math.max(0, math.min(per_min, tokens - diff)) end
if day == charged_day then used = math.max(0, used + diff) end
save(tokens, used)
return {tostring(tokens or ''), used, tostring(((day + 1) * 86400000 - now) / 1000)}
"""
)

_REMAINING = lua(
    _READ
    + """
return {tostring(tokens or ''), used, tostring(((day + 1) * 86400000 - now) / 1000)}
"""
)


def _limit(value: int | None) -> str:
    return "" if value is None else str(value)


def _remaining(limits: QuotaLimits, tokens: str, used: str | int, resets: str) -> QuotaRemaining:
    """A script's reply (bucket tokens or '', the day's use, seconds to midnight)."""
    minute = math.floor(float(tokens)) if tokens != "" else None
    day = None if limits.per_day is None else max(0, limits.per_day - int(used))
    return QuotaRemaining(minute, day, float(resets))


class RedisTokenQuotas:
    """Token quotas of every tenant, exact across processes and instances."""

    __slots__ = ("_client", "_keys")

    def __init__(self, client: StateClient, keys: StateKeys) -> None:
        self._client = client
        self._keys = keys

    def _tenant_keys(self, tenant: str) -> list[str]:
        return [self._keys.quota_minute(tenant), self._keys.quota_day(tenant)]

    async def charge(
        self, tenant: str, estimate: int, limits: QuotaLimits
    ) -> Charge | QuotaRefused:
        args: list[str | float] = [estimate, _limit(limits.per_minute), _limit(limits.per_day)]
        granted, wait, window, day, tokens, used, resets = await self._client.run(
            _CHARGE, self._tenant_keys(tenant), args
        )
        left = _remaining(limits, tokens, used, resets)
        if int(granted):
            return Charge(tenant, estimate, int(day), limits, left)
        return QuotaRefused(float(wait), "minute" if window == "minute" else "day", left)

    async def correct(self, charge: Charge, actual: int) -> QuotaRemaining:
        limits = charge.limits
        args: list[str | float] = [
            actual - charge.tokens,
            _limit(limits.per_minute),
            "",
            charge.day,
        ]
        tokens, used, resets = await self._client.run(
            _CORRECT, self._tenant_keys(charge.tenant), args
        )
        return _remaining(limits, tokens, used, resets)

    async def remaining(self, tenant: str, limits: QuotaLimits) -> QuotaRemaining:
        args: list[str | float] = [0, _limit(limits.per_minute), _limit(limits.per_day)]
        tokens, used, resets = await self._client.run(_REMAINING, self._tenant_keys(tenant), args)
        return _remaining(limits, tokens, used, resets)

    def __repr__(self) -> str:
        return f"<RedisTokenQuotas {self._keys.prefix}>"
