"""The one door to Redis: a time limit on every call, error counting, up/down.

Every call is bounded by ``state.timeout_ms`` (the socket timeouts and an
``asyncio.timeout`` around the whole call), so a Redis that is down or slow
costs a request at most that long. redis-py retries a call once, on a fresh
connection, only when its connection was closed (``ConnectionError``, never a
timeout): after a Redis restart every connection pooled before it is dead, and
without that retry each would fail one call (503 ``state_unavailable`` under
``reject``) while Redis already answers. Any
failure is counted, flips the state to down (the callback fires once per
transition, for ``admission_state_up``, ``admission_state_errors_total`` and a
log line) and is raised as ``StateDown``, which carries what the caller needs
to fall back: ``on_failure`` and the live instance count last seen. The first
call that succeeds flips it back up: no restart, no reconnect loop here.
While down, calls within ``PROBE_INTERVAL_S`` of the last failure fail at once
without asking Redis (not counted as errors again): a request then costs no
``timeout_ms`` at all, and one call per interval finds out whether Redis is
back. A call during which the task was cancelled raises ``CancelledError``,
never a result or ``StateDown``: a loop that retries on ``StateDown`` would
otherwise outlive its ``cancel()`` (``proxy.tasks.keep_cancellation``).

Scripts are sent by EVALSHA and loaded again on NOSCRIPT (redis-py's
``register_script``), so a restarted Redis with an empty script cache costs
one extra round trip, not an error. Every script is declared with ``lua``, so
that ``warm`` opens a connection and loads them all before the first request:
a process's first call would otherwise open its connection and load its script
(EVALSHA, NOSCRIPT, SCRIPT LOAD, EVALSHA) within one ``timeout_ms``, and on a
loaded host a worker just started counted a Redis that was only cold as down,
switched to its local share (admitting more than the shared limits) and logged
"shared state down" at every deploy.

A call that timed out or was cancelled may still have run on the server: a
lease it took is never renewed and frees within ``lease_ms``; a token it took
is lost. Both err on the side of admitting less, never more. The same holds
for the one retry on a closed connection in the rare case that the first try
ran before the connection closed (a proxy in between, ``CLIENT KILL``; after a
restart Redis has forgotten the first): the retry of a seat's acquire (same
lease id) may be refused for the seat the first took, which then frees within
``lease_ms``; a quota is charged one estimate more.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal

from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.commands.core import AsyncScript
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from proxy.clock import Clock
from proxy.settings import StateConfig
from proxy.tasks import keep_cancellation

OnFailure = Literal["local_share", "reject"]
#: How long ``warm`` keeps trying to reach Redis at start before serving anyway.
WARM_S = 2.0
#: Every script the state modules run (``lua``), for ``warm``.
_SOURCES: list[str] = []


def lua(source: str) -> str:
    """Declare a script run through ``StateClient.run``: ``warm`` loads it at start."""
    _SOURCES.append(source)
    return source


#: While down, how long calls fail without trying Redis after a failure.
PROBE_INTERVAL_S = 0.2
#: Lua prelude of every script: server time in ms, or the test clock's when ARGV[1] is set.
NOW_MS = """
local function now_ms()
  if ARGV[1] ~= '' then return tonumber(ARGV[1]) end
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
end
"""


class StateDown(Exception):
    """Redis did not answer in time; the caller enforces its limit locally or rejects."""

    def __init__(self, message: str, *, on_failure: OnFailure, instances: int) -> None:
        super().__init__(message)
        self.on_failure = on_failure
        #: Live instances last seen (at least 1): ``local_share`` divides each limit by it.
        self.instances = instances

    def local_share(self, limit: float) -> float:
        """This instance's part of a rate (``rate_per_s``, tokens per minute)."""
        return limit / self.instances

    def local_seats(self, limit: int) -> int:
        """This instance's part of a count of places, rounded down but at least one.

        At least one so that a small limit spread over many instances still
        serves; the total may then exceed the limit by at most one per instance.
        """
        return max(1, limit // self.instances)


class StateClient:
    """One Redis connection pool with the failure rules above.

    client = StateClient(config.state)
    bucket = client.script(BUCKET_LUA)
    wait = float(await client.run(bucket, [key], [rate, burst]))
    """

    __slots__ = (
        "_clock",
        "_on_change",
        "_probe_at",
        "_probe_interval_s",
        "_redis",
        "_scripts",
        "config",
        "errors",
        "instances",
        "up",
    )

    def __init__(
        self,
        config: StateConfig,
        *,
        clock: Clock | None = None,
        on_change: Callable[[bool, BaseException | None], None] | None = None,
        probe_interval_s: float = PROBE_INTERVAL_S,
    ) -> None:
        self.config = config
        self._probe_interval_s = probe_interval_s
        timeout = config.timeout_ms / 1000
        self._redis: Redis = Redis.from_url(
            config.redis_url,
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
            retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
            decode_responses=True,
        )
        #: Tests only: a fake clock replaces server TIME, so scripts run on the test's time.
        self._clock = clock
        self._on_change = on_change
        self._scripts: dict[str, AsyncScript] = {}
        self.up = True
        self.errors = 0
        self.instances = 1
        self._probe_at = 0.0

    @property
    def redis(self) -> Redis:
        return self._redis

    def script(self, source: str) -> AsyncScript:
        """The registered script for ``source`` (with the ``now_ms`` prelude)."""
        script = self._scripts.get(source)
        if script is None:
            script = self._scripts[source] = self._redis.register_script(NOW_MS + source)
        return script

    async def warm(self, within_s: float = WARM_S) -> bool:
        """Open a connection and load every declared script (one pipelined round trip),
        trying again until ``within_s``: the first requests' calls then cost one round
        trip each, as every later one does. Each try is bounded by ``within_s``, not by
        ``timeout_ms`` (nothing waits on it but the start). False when Redis did not
        answer in time: nothing is counted or switched here; the first call finds out.
        """
        deadline = time.monotonic() + within_s
        while True:
            try:
                async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                    async with self._redis.pipeline(transaction=False) as pipe:
                        for source in _SOURCES:
                            pipe.script_load(NOW_MS + source)
                        await pipe.execute()
                return True
            except (RedisError, OSError, TimeoutError):
                if time.monotonic() + self._probe_interval_s >= deadline:
                    return False
                await asyncio.sleep(self._probe_interval_s)

    def now_arg(self) -> str:
        """ARGV[1] of every script: empty (server time) unless a test clock is set."""
        return "" if self._clock is None else repr(self._clock.now() * 1000)

    async def run(self, source: str, keys: Sequence[str], args: Sequence[str | float]) -> Any:
        """Run one script within ``timeout_ms``; ``StateDown`` on any failure."""
        if not self.up and time.monotonic() < self._probe_at:
            raise self._down("shared state unavailable (waiting to probe again)")
        script = self.script(source)
        argv = [self.now_arg(), *(str(a) for a in args)]
        try:
            with keep_cancellation():  # redis-py may lose a cancel (see proxy.tasks)
                async with asyncio.timeout(self.config.timeout_ms / 1000):
                    result = await script(keys=list(keys), args=argv, client=self._redis)
        except (RedisError, OSError, TimeoutError) as exc:
            raise self._failed(exc) from exc
        self._succeeded()
        return result

    def _failed(self, exc: BaseException) -> StateDown:
        self.errors += 1
        self._probe_at = time.monotonic() + self._probe_interval_s
        if self.up:
            self.up = False
            if self._on_change is not None:
                self._on_change(False, exc)
        return self._down(f"shared state unavailable: {type(exc).__name__}: {exc}")

    def _down(self, message: str) -> StateDown:
        return StateDown(
            message, on_failure=self.config.on_failure, instances=max(1, self.instances)
        )

    def _succeeded(self) -> None:
        if not self.up:
            self.up = True
            if self._on_change is not None:
                self._on_change(True, None)

    async def aclose(self) -> None:
        await self._redis.aclose()

    def __repr__(self) -> str:
        state = "up" if self.up else "down"
        return f"<StateClient {state}, {self.errors} errors, {self.instances} instances>"
