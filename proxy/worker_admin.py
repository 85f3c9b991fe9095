"""``serve --workers N``: an admin change made in one worker is made in all.

The N workers listen on one port (``SO_REUSEPORT``), so the kernel hands an
admin request to any one of them: a drain (the status page's button), an
undrain, ``POST /admin/reload`` or ``POST /admin/rollback`` changed that one
worker, and the others kept sending the drained replica new requests. The
workers already share a Redis (N > 1 needs ``state.backend: redis``), so the
worker that takes the request applies it and publishes it on the group's
channel (``StateKeys.admin_channel``); every other worker of the group hears
it and applies it too. The group is one ``serve --workers`` parent's
children (``workers.WORKER_GROUP_ENV``): separate pods on the
same Redis are separate gateways, each drained through its own admin port.

A rollback names the config it makes current (its SHA-256); a worker whose
previous config is another one (it missed a reload) does not roll back, and
says so. Messages are best effort, as pub/sub is: one published while a
worker was reconnecting is lost, and the answer's worker logs that it could
not publish.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

import structlog
from aiohttp import web
from redis.exceptions import RedisError

from proxy.errors import NoPreviousConfig
from proxy.reload import Reloader
from proxy.runtime import Runtime
from proxy.settings import ConfigError
from proxy.state.notify import FreedListener
from proxy.state.shared import SharedState

log = structlog.get_logger(__name__)


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

    __slots__ = ("_channel", "_reloader", "_runtime", "_state", "_tasks", "listener")

    def __init__(
        self, state: SharedState, group: str, runtime: Runtime, reloader: Reloader | None
    ) -> None:
        self._state = state
        self._runtime = runtime
        self._reloader = reloader
        self._channel = state.keys.admin_channel(group)
        self._tasks: set[asyncio.Task[None]] = set()
        self.listener = FreedListener(
            state.config.redis_url, [self._channel], lambda channel: None,
            connect_timeout_s=max(0.05, state.config.timeout_ms / 1000), on_message=self._heard,
        )  # fmt: skip

    def __repr__(self) -> str:
        return f"<WorkerAdmin {self._channel}, {self.listener!r}>"

    async def publish(self, op: str, **fields: str) -> bool:
        """Tell the other workers of the group; False (and a warning) when Redis did not take it."""
        message = json.dumps({"op": op, "from": self._state.instance_id, **fields})
        try:
            async with asyncio.timeout(self._state.config.timeout_ms / 1000):
                await self._state.client.redis.publish(self._channel, message)
        except (RedisError, OSError, TimeoutError) as exc:
            log.warning("admin change not passed on to the other workers", op=op,
                        error=f"{type(exc).__name__}: {exc}")  # fmt: skip
            return False
        return True

    def _heard(self, channel: str, data: str) -> None:
        try:
            message: Any = json.loads(data)
        except ValueError:
            return
        if not isinstance(message, dict) or message.get("from") == self._state.instance_id:
            return  # not ours to read, or this worker's own change
        op = message.get("op")
        if op in ("drain", "undrain"):
            replica = message.get("replica")
            if isinstance(replica, str) and set_draining(self._runtime, replica, op == "drain"):
                log.info("admin change from another worker", op=op, replica=replica)
        elif op in ("reload", "rollback"):
            task = asyncio.create_task(self._apply_config(op, message.get("sha256")))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

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


#: The app's group link; None outside ``serve --workers N``.
WORKER_ADMIN: web.AppKey[WorkerAdmin | None] = web.AppKey("worker_admin")
