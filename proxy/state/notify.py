"""Wake waiting processes when a shared place frees: Redis pub/sub, no polling.

The release script publishes the lease's channel; ``FreedListener`` holds one
subscription per process and calls ``on_freed(channel)`` for each message, so
a process with requests queued for a pool or a tenant tries to acquire again
at once. Its connection has no read timeout (it waits for messages, that is
its job), unlike the client's short-timeout pool.

Messages sent while the subscription was down are lost, so after every
(re)subscription ``on_freed`` is called once per channel: waiters re-check
instead of waiting for a message that already went by. Reconnection backs
off from 50 ms to 1 s. ``run`` belongs to the owner's ``cleanup_ctx`` and
ends at its first ``cancel()``, even one redis-py lost while it subscribed
(``proxy.tasks.keep_cancellation``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence

from redis.asyncio import Redis
from redis.exceptions import RedisError

from proxy.tasks import keep_cancellation

#: Reconnection backoff bounds, seconds.
FIRST_BACKOFF_S = 0.05
MAX_BACKOFF_S = 1.0


class FreedListener:
    """One pub/sub subscription to ``channels``, turned into ``on_freed`` calls."""

    __slots__ = (
        "_channels",
        "_connect_timeout_s",
        "_on_freed",
        "_on_message",
        "_patterns",
        "_url",
        "subscribed",
        "subscriptions",
    )

    def __init__(
        self,
        url: str,
        channels: Sequence[str],
        on_freed: Callable[[str], None],
        *,
        connect_timeout_s: float,
        patterns: Sequence[str] = (),
        on_message: Callable[[str, str], None] | None = None,
    ) -> None:
        """``patterns``: glob subscriptions too (``admission:freed:*``); a message on one
        reports its real channel, a resubscription reports the pattern itself.
        ``on_message``: also told each message's channel and data (``worker_admin.py``)."""
        self._url = url
        self._channels = list(channels)
        self._patterns = list(patterns)
        self._on_freed = on_freed
        self._on_message = on_message
        self._connect_timeout_s = connect_timeout_s
        #: Set while subscribed: a publish from now on is heard.
        self.subscribed = asyncio.Event()
        #: Successful subscriptions so far (1 + reconnections).
        self.subscriptions = 0

    async def run(self) -> None:
        """Listen until cancelled, resubscribing after every connection loss."""
        backoff = FIRST_BACKOFF_S
        while True:
            before = self.subscriptions
            with contextlib.suppress(RedisError, OSError, TimeoutError), keep_cancellation():
                await self._listen()
            backoff = FIRST_BACKOFF_S if self.subscriptions != before else backoff
            await asyncio.sleep(backoff)
            backoff = min(MAX_BACKOFF_S, backoff * 2)

    async def _listen(self) -> None:
        redis = Redis.from_url(
            self._url,
            socket_connect_timeout=self._connect_timeout_s,
            decode_responses=True,
        )
        try:
            async with redis.pubsub(ignore_subscribe_messages=True) as pubsub:
                # A cancel lost here would leave the loop below waiting for messages.
                with keep_cancellation():
                    if self._channels:
                        await pubsub.subscribe(*self._channels)
                    if self._patterns:
                        await pubsub.psubscribe(*self._patterns)
                    # The subscription is confirmed once its reply is read; until then a
                    # publish may be missed, so the channels are only reported open after it.
                    for _ in range(len(self._channels) + len(self._patterns)):
                        await pubsub.get_message(timeout=self._connect_timeout_s)
                self.subscriptions += 1
                self.subscribed.set()
                for channel in (*self._channels, *self._patterns):
                    self._on_freed(channel)
                async for message in pubsub.listen():
                    if message.get("type") in ("message", "pmessage"):
                        self._on_freed(str(message["channel"]))
                        if self._on_message is not None:
                            self._on_message(str(message["channel"]), str(message["data"]))
        finally:
            self.subscribed.clear()
            await redis.aclose()

    def __repr__(self) -> str:
        state = "subscribed" if self.subscribed.is_set() else "connecting"
        count = len(self._channels) + len(self._patterns)
        return f"<FreedListener {count} channels, {state}>"
