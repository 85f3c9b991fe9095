"""The fleet's retry budget on Redis: proxy/retries.py's ``RetryBudget`` shared.

Retries allowed in the window: ``ratio`` x requests dispatched in it plus
``min_per_s`` x the window, counted in one-second buckets (hash fields
``q<second>`` and ``r<second>``), as the local budget counts them; fields
older than the window are dropped by the scripts themselves.
"""

from __future__ import annotations

from proxy.retries import BUDGET_WINDOW_S
from proxy.state.client import StateClient, lua
from proxy.state.keys import StateKeys

_PRELUDE = """
local second = math.floor(now_ms() / 1000)
local window = tonumber(ARGV[2])
local oldest = second - window
local q, r, first_retry = 0, 0, nil
local fields = redis.call('HGETALL', KEYS[1])
for i = 1, #fields, 2 do
  local s = tonumber(string.sub(fields[i], 2))
  if s <= oldest then
    redis.call('HDEL', KEYS[1], fields[i])
  elseif string.sub(fields[i], 1, 1) == 'q' then
    q = q + tonumber(fields[i + 1])
  else
    r = r + tonumber(fields[i + 1])
    if first_retry == nil or s < first_retry then first_retry = s end
  end
end
redis.call('PEXPIRE', KEYS[1], (window + 2) * 1000)
"""

_RECORD = lua(
    _PRELUDE
    + """
redis.call('HINCRBY', KEYS[1], 'q' .. second, tonumber(ARGV[3]))
return 1
"""
)

_SPEND = lua(
    _PRELUDE
    + """
local ratio, floor_per_s = tonumber(ARGV[3]), tonumber(ARGV[4])
if r + 1 > ratio * q + floor_per_s * window then
  if first_retry == nil then return '1.0' end
  return tostring(math.max(0.001, first_retry + window - now_ms() / 1000))
end
redis.call('HINCRBY', KEYS[1], 'r' .. second, 1)
return '0'
"""
)


class SharedRetryBudget:
    """``record_request`` per dispatch; ``try_spend`` per retry (0.0: spent, else refill)."""

    __slots__ = ("_client", "_key", "window_s")

    def __init__(self, client: StateClient, keys: StateKeys, window_s: int = BUDGET_WINDOW_S):
        self._client = client
        self._key = keys.retry_budget()
        self.window_s = window_s

    async def record_request(self, count: int = 1) -> None:
        """``count`` requests were dispatched (their first attempts)."""
        await self._client.run(_RECORD, [self._key], [self.window_s, count])

    async def try_spend(self, ratio: float, min_per_s: float) -> float:
        """Take one retry: 0.0; else the seconds until the oldest counted retry leaves."""
        answer = await self._client.run(_SPEND, [self._key], [self.window_s, ratio, min_per_s])
        return float(answer)

    def __repr__(self) -> str:
        return f"<SharedRetryBudget {self._key} over {self.window_s} s>"
