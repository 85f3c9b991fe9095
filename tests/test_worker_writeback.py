"""A worker's write-back of the group's drains after a Redis restart never undoes
a change made since it found the hash gone."""

from __future__ import annotations

from redis.asyncio import Redis

from proxy.app import build_runtime
from proxy.clock import FakeClock
from proxy.settings import StateConfig
from proxy.state.shared import SharedState
from proxy.worker_admin import HELD, WorkerAdmin, set_draining
from tests.helpers import make_config
from tests.redis_server import RedisServer


async def test_a_write_back_does_not_undo_an_undrain_made_since_the_hash_was_read(
    redis_server: RedisServer,
) -> None:
    config = make_config(["http://127.0.0.1:9"])
    runtime = build_runtime(config, access_log=False)
    state = SharedState(
        StateConfig(backend="redis", redis_url=redis_server.url, timeout_ms=2000),
        FakeClock(start=1_000_000.0),
    )
    admin = WorkerAdmin(state, "g", runtime, None)
    redis = Redis.from_url(redis_server.url, decode_responses=True)
    try:
        assert set_draining(runtime, "r0", True)
        # This worker read the hash empty (Redis restarted); then, before its write-back,
        # another worker undrained r0: the hash now holds only the marker.
        key = state.keys.admin_drained("g")
        await redis.hset(key, HELD, "1")
        await admin._write_back()
        assert await redis.hgetall(key) == {HELD: "1"}
    finally:
        await redis.aclose()
        await admin.close()
        await state.client.aclose()
