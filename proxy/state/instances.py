"""Live gateway processes: each heartbeats its id into a ZSET scored by expiry.

The count is ``admission_instances`` and the divisor of ``on_failure:
local_share``; the client keeps the last count seen, since it is needed
precisely when Redis cannot be asked. A process that dies stops counting
after ``ttl_ms``. The count never falls faster than that either: after a
Redis restart the registry refills one heartbeat at a time, and a divisor
read from it meanwhile would hand each process too large a share. A
heartbeat that finds this instance missing although it beat within
``ttl_ms`` means Redis lost its state (a restart): ``on_lost`` is told.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

from proxy.state.client import StateClient, StateDown, lua
from proxy.state.keys import StateKeys

_BEAT = lua(
    """
local now = now_ms()
local known = redis.call('ZSCORE', KEYS[1], ARGV[2])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if ARGV[3] == '1' then
  redis.call('ZADD', KEYS[1], now + tonumber(ARGV[4]), ARGV[2])
else
  redis.call('ZREM', KEYS[1], ARGV[2])
end
redis.call('PEXPIRE', KEYS[1], 2 * tonumber(ARGV[4]))
return {redis.call('ZCARD', KEYS[1]), known and 1 or 0}
"""
)


class InstanceRegistry:
    """This process's heartbeat, and the fleet's live count."""

    __slots__ = (
        "_beat_at", "_client", "_high_at", "_key", "floor", "instance_id", "on_lost", "ttl_ms",
    )  # fmt: skip

    def __init__(self, client: StateClient, keys: StateKeys, instance_id: str, ttl_ms: int):
        self._client = client
        self._key = keys.instances()
        self.instance_id = instance_id
        self.ttl_ms = ttl_ms
        #: When this instance last beat, and last saw the count it reports now (monotonic).
        self._beat_at: float | None = None
        self._high_at = 0.0
        #: Told when Redis no longer knew this instance within its ttl (a restart).
        self.on_lost: Callable[[], None] | None = None
        #: The fewest live instances there can be: a ``serve --workers N`` worker's N
        #: (its siblings register a moment after it; a count of 1 then would make
        #: ``local_share`` admit every limit whole if Redis went down right after).
        self.floor = 1

    async def heartbeat(self) -> int:
        """Say this instance is alive for ``ttl_ms`` more; returns the live count."""
        return await self._beat(alive=True)

    async def leave(self) -> int:
        """A clean shutdown: stop counting at once rather than after ``ttl_ms``."""
        return await self._beat(alive=False)

    async def _beat(self, *, alive: bool) -> int:
        args = [self.instance_id, "1" if alive else "0", self.ttl_ms]
        count, known = await self._client.run(_BEAT, [self._key], args)
        count = int(count)
        now = time.monotonic()
        ttl_s = self.ttl_ms / 1000
        forgotten = alive and not int(known) and self._beat_at is not None
        if forgotten and now - (self._beat_at or 0.0) < ttl_s and self.on_lost is not None:
            self.on_lost()
        self._beat_at = now if alive else None
        if count >= self._client.instances or now - self._high_at > ttl_s or not alive:
            self._client.instances = max(self.floor, count)
            self._high_at = now
        return count

    async def run(self) -> None:
        """Heartbeat every third of ``ttl_ms`` until cancelled (owned by ``cleanup_ctx``)."""
        while True:
            with contextlib.suppress(StateDown):
                await self.heartbeat()
            await asyncio.sleep(self.ttl_ms / 3000)

    def __repr__(self) -> str:
        return f"<InstanceRegistry {self.instance_id}, {self._client.instances} live>"
