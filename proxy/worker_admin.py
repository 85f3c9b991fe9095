"""``serve --workers N``: an admin change made in one worker is made in all.

The N workers listen on one port (``SO_REUSEPORT``), so the kernel hands an
admin request to any one of them: a drain (the status page's button), an
undrain, ``POST /admin/reload`` or ``POST /admin/rollback`` changed that one
worker, and the others kept sending the drained replica new requests. The
workers already share a Redis (N > 1 needs ``state.backend: redis``), so the
worker that takes the request applies it and tells the group's other
workers (``StateKeys.admin_channel``). The group is one ``serve --workers``
parent's children (``workers.WORKER_GROUP_ENV``): separate pods on the same
Redis are separate gateways, each drained through its own admin port.

- **Drains are state, not messages.** The group's drained replicas are a
  Redis hash (``StateKeys.admin_drained``); a change is written there, then
  announced on the channel, and each worker sets its replicas from the hash
  whenever it hears an announcement *and* whenever it (re)subscribes. Pub/sub
  drops what is sent while a worker is not subscribed (one starting, one
  restarted after a crash, one reconnecting); read from the hash, a drain
  reaches it all the same.
- **A Redis restart loses the hash** (Redis runs without persistence): the
  hash always holds a marker field (``HELD``) once the group drained or
  undrained anything, so a hash found without it was lost, not emptied by
  undrains. A worker that finds it lost (when it resubscribes, or when its
  instance heartbeat finds Redis forgot it) keeps its own drains and writes
  them back, then announces it so the others read them (one started since the
  loss drains too); before, a worker started after the restart served a
  drained replica while the group's ``/admin/state`` still said draining.
- **Reload and rollback are messages**: each worker reads its own file, and
  a rollback names the config it makes current (its SHA-256), so a worker
  whose previous config is another one (it missed a reload) does not roll
  back, and says so. One sent while a worker was not subscribed is lost; the
  file watcher still brings every worker to the file's content.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from collections.abc import Container, Coroutine
from typing import Any

import structlog
from aiohttp import web
from redis.asyncio import Redis
from redis.exceptions import RedisError
from redis.typing import EncodableT

from proxy.errors import NoPreviousConfig
from proxy.reload import Reloader
from proxy.runtime import Runtime
from proxy.settings import ConfigError
from proxy.state.notify import FreedListener
from proxy.state.shared import SharedState
from proxy.workers import WORKER_COUNT_ENV

log = structlog.get_logger(__name__)

#: The group's drained replicas outlive no group by long: a week after the last drain.
DRAINED_TTL_MS = 7 * 24 * 3600 * 1000
#: Bound on an admin change's Redis calls: rare, and not on any request's path.
ADMIN_TIMEOUT_S = 2.0
#: The drained hash's marker field (never a replica name: those are never empty).
HELD = ""


def set_draining(runtime: Runtime, name: str, draining: bool) -> bool:
    """Drain or undrain replica ``name`` here; False when this process has no such replica."""
    replica = runtime.pool.get(name)
    if replica is None:
        return False
    replica.draining = draining
    if not draining:
        runtime.dispatcher.pump()
    return True


class WorkerAdmin:
    """Publishes this worker's admin changes to its group, and applies the others'."""

    __slots__ = (
        "_channel", "_drained", "_redis", "_reloader", "_runtime", "_state", "_syncing", "_tasks",
        "listener",
    )  # fmt: skip

    def __init__(
        self, state: SharedState, group: str, runtime: Runtime, reloader: Reloader | None
    ) -> None:
        self._state = state
        self._runtime = runtime
        self._reloader = reloader
        self._channel = state.keys.admin_channel(group)
        self._drained = state.keys.admin_drained(group)
        # Its own connections: the request path's have ``state.timeout_ms`` socket
        # timeouts (50 ms by default), which a busy machine overran.
        self._redis: Redis = Redis.from_url(
            state.config.redis_url,
            socket_timeout=ADMIN_TIMEOUT_S,
            socket_connect_timeout=ADMIN_TIMEOUT_S,
            decode_responses=True,
        )
        self._tasks: set[asyncio.Task[None]] = set()
        #: One sync at a time: one that read the hash earlier must not apply after a later one.
        self._syncing = asyncio.Lock()
        # ``on_freed`` is told at every (re)subscription and every message: each
        # time, the drains are read again (what was missed while unsubscribed too).
        self.listener = FreedListener(
            state.config.redis_url, [self._channel], lambda channel: self._spawn(self._sync()),
            connect_timeout_s=ADMIN_TIMEOUT_S, on_message=self._heard,
        )  # fmt: skip
        # The group's own workers are live instances, whether or not Redis shows them
        # yet: with Redis down from the start (or right after a first heartbeat that saw
        # only this worker), local_share divides by them, not by 1 (each worker would
        # admit every limit whole, N times over).
        with contextlib.suppress(ValueError):
            count = int(os.environ.get(WORKER_COUNT_ENV, "1"))
            state.registry.floor = max(1, count)
            state.client.instances = max(state.client.instances, count)
        # Redis forgot this instance (a restart): it forgot the drains too.
        lost = state.registry.on_lost

        def on_lost() -> None:
            if lost is not None:
                lost()
            self._spawn(self._sync())

        state.registry.on_lost = on_lost

    def __repr__(self) -> str:
        return f"<WorkerAdmin {self._channel}, {self.listener!r}>"

    async def publish(self, op: str, **fields: str) -> bool:
        """Tell the other workers of the group; False (and a warning) when Redis did not take it."""
        message = json.dumps({"op": op, "from": self._state.instance_id, **fields})
        replica = fields.get("replica")
        try:
            async with (
                asyncio.timeout(ADMIN_TIMEOUT_S),
                self._redis.pipeline(transaction=True) as pipe,
            ):
                if op == "drain" and replica is not None:
                    pipe.hset(self._drained, mapping={replica: "1", HELD: "1"})
                    pipe.pexpire(self._drained, DRAINED_TTL_MS)
                elif op == "undrain" and replica is not None:
                    pipe.hdel(self._drained, replica)
                    pipe.hset(self._drained, HELD, "1")
                    pipe.pexpire(self._drained, DRAINED_TTL_MS)
                pipe.publish(self._channel, message)
                await pipe.execute()
        except (RedisError, OSError, TimeoutError) as exc:
            log.warning("admin change not passed on to the other workers", op=op,
                        error=f"{type(exc).__name__}: {exc}")  # fmt: skip
            return False
        return True

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _sync(self) -> None:
        """Set this worker's replicas drained or not as the group's hash says.

        A replica a reload retired stays drained whatever the hash says.
        """
        async with self._syncing:
            try:
                async with asyncio.timeout(ADMIN_TIMEOUT_S):
                    drained = await self._redis.hgetall(self._drained)
                    if not drained:
                        await self._write_back()
                        return
            except (RedisError, OSError, TimeoutError):
                return  # read again at the next announcement or resubscription
            self._apply_drains(drained)

    async def _write_back(self) -> None:
        """The hash is gone (a Redis restart, or never written): put back this worker's
        drains, never taking one away, and tell the others when there were any.

        Only while the hash is still gone (WATCH): another worker's undrain written
        since this one read it must stand (its announcement makes this one read again);
        an unconditional write-back drained that replica again for the whole group."""
        mine: dict[EncodableT, EncodableT] = {
            str(r.name): "1" for r in self._runtime.pool.replicas if r.draining and not r.retired
        }
        if not mine:
            return
        replicas = sorted(str(name) for name in mine)
        mine[HELD] = "1"
        async with self._redis.pipeline(transaction=True) as pipe:
            await pipe.watch(self._drained)
            if await pipe.exists(self._drained):
                return
            pipe.multi()  # type: ignore[no-untyped-call]
            pipe.hset(self._drained, mapping=mine)
            pipe.pexpire(self._drained, DRAINED_TTL_MS)
            pipe.publish(self._channel, json.dumps({"op": "sync", "from": self._state.instance_id}))
            await pipe.execute()
        log.info("group drains written back to redis", replicas=replicas)

    def _apply_drains(self, drained: Container[bytes | str]) -> None:
        for replica in self._runtime.pool.replicas:
            wanted = replica.name in drained
            if not replica.retired and replica.draining != wanted:
                set_draining(self._runtime, replica.name, wanted)
                log.info("admin change from the worker group", replica=replica.name,
                         op="drain" if wanted else "undrain")  # fmt: skip

    def _heard(self, channel: str, data: str) -> None:
        try:
            message: Any = json.loads(data)
        except ValueError:
            return
        if not isinstance(message, dict) or message.get("from") == self._state.instance_id:
            return  # not ours to read, or this worker's own change
        op = message.get("op")
        if op in ("reload", "rollback"):  # drains: ``_sync``, on every message
            self._spawn(self._apply_config(op, message.get("sha256")))

    async def _apply_config(self, op: str, sha256: object) -> None:
        reloader = self._reloader
        if reloader is None:
            return
        if op == "reload":
            result = await reloader.reload("admin (another worker)", if_changed=True)
            log.info("admin change from another worker", op=op, ok=result.ok)
            return
        previous = reloader.history.previous
        if previous is None or previous.sha256 != sha256:
            log.warning("rollback from another worker not applied: this worker's previous "
                        "config is another one", wanted=sha256)  # fmt: skip
            return
        with contextlib.suppress(NoPreviousConfig):
            try:
                await reloader.rollback()
            except ConfigError as exc:
                log.error("rollback from another worker refused",
                          problems=[i.message for i in exc.issues])  # fmt: skip
                return
            log.info("admin change from another worker", op=op, sha256=sha256)

    async def close(self) -> None:
        """Let the changes being applied finish (a reload takes a moment)."""
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._redis.aclose()


#: The app's group link; None outside ``serve --workers N``.
WORKER_ADMIN: web.AppKey[WorkerAdmin | None] = web.AppKey("worker_admin")
