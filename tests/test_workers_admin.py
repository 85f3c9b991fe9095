"""``serve --workers N``: an admin change reaches every worker, not the one the kernel
picked for the request.

The workers share one port (``SO_REUSEPORT``); each fresh connection goes to any
of them. A drain, an undrain and a rollback through the admin API are passed on
over the group's Redis channel (``proxy/worker_admin.py``), so every worker
answers the same afterwards. Checked by reading through many fresh connections:
with two workers, ``READS`` reads in a row all reach the one worker that took
the change by chance about once in 10^11.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from tests.fleet import ProxyProcess, start_serve, write_config
from tests.helpers import KEY_A, KEY_B
from tests.redis_server import RedisServer

pytestmark = pytest.mark.redis

READS = 40
#: Bound on every wait below (two worker processes on a busy 2-core machine).
WAIT_S = 20.0


def fresh_session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True))


async def every_worker_shows(proxy: ProxyProcess, path: str, holds: Callable[[str], bool]) -> None:
    """Read ``path`` through fresh connections until ``READS`` answers in a row satisfy
    ``holds``; fail after ``WAIT_S`` (the change reached only some workers)."""
    deadline = time.monotonic() + WAIT_S
    in_a_row = 0
    async with fresh_session() as session:
        while in_a_row < READS:
            assert time.monotonic() < deadline, f"only {in_a_row} reads in a row agreed"
            async with session.get(proxy.url + path) as resp:
                assert resp.status == 200
                in_a_row = in_a_row + 1 if holds(await resp.text()) else 0


async def post(proxy: ProxyProcess, path: str) -> Any:
    """An admin POST through a fresh connection (any worker): its JSON answer."""
    async with fresh_session() as session, session.post(proxy.url + path) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


def draining(text: str) -> bool:
    state: dict[str, Any] = yaml.safe_load(text)
    return bool(state["replicas"]["r0"]["draining"])


def tenants(text: str) -> set[str]:
    return set(yaml.safe_load(text)["tenants"])


async def test_drain_undrain_and_rollback_reach_every_worker(
    tmp_path: Path, upstream_url: str, redis_server: RedisServer
) -> None:
    """Two workers: a drain through the admin API shows in every worker's
    /admin/state, in a worker started again after a crash too, then the undrain;
    a reload (SIGHUP, every worker) adds tenant b, and a rollback through the
    admin API takes it away in every worker."""
    config: dict[str, Any] = {
        "replicas": [{"name": "r0", "url": upstream_url, "max_concurrency": 4}],
        "tenants": {"a": {"api_keys": [KEY_A]}},
        "server": {"shutdown_grace_ms": 2000},
        "state": {"backend": "redis", "redis_url": redis_server.url},
    }
    path = write_config(tmp_path / "c.yaml", config)
    proxy = await start_serve(path, workers=2)
    try:
        assert len({line["pid"] for line in proxy.listening()}) == 2
        assert await post(proxy, "/admin/replicas/r0/drain") == {"replica": "r0", "draining": True}
        await every_worker_shows(proxy, "/admin/state", draining)
        # A worker started after the drain (one that died, started again) drains too:
        # the group's drains are state it reads when it subscribes, not a message it missed.
        # (Its log says so: the group's /admin/state shows draining while any worker does.)
        applied = "admin change from the worker group"
        before = len(proxy.named(applied))
        os.kill(proxy.listening()[0]["pid"], signal.SIGKILL)
        await proxy.wait_listening(3)
        async with asyncio.timeout(WAIT_S):
            while len(proxy.named(applied)) == before:
                await asyncio.sleep(0.05)
        assert proxy.named(applied)[-1]["op"] == "drain"
        await every_worker_shows(proxy, "/admin/state", draining)
        await post(proxy, "/admin/replicas/r0/undrain")
        await every_worker_shows(proxy, "/admin/state", lambda text: not draining(text))

        config["tenants"]["b"] = {"api_keys": [KEY_B]}
        write_config(path, config)
        proxy.signal(signal.SIGHUP)
        await every_worker_shows(proxy, "/admin/config", lambda text: tenants(text) == {"a", "b"})
        assert (await post(proxy, "/admin/rollback"))["result"] == "ok"
        await every_worker_shows(proxy, "/admin/config", lambda text: tenants(text) == {"a"})
    finally:
        assert await proxy.stop() == 0


async def test_drains_survive_a_redis_restart(
    tmp_path: Path, upstream_url: str, redis_server: RedisServer
) -> None:
    """Redis restarts without persistence and forgets the group's drained hash: the
    workers write their drains back, so a worker started after the restart (one that
    died) drains the replica too. Before, it served it, while the group's merged
    /admin/state still said draining (any worker draining shows)."""
    config: dict[str, Any] = {
        "replicas": [{"name": "r0", "url": upstream_url, "max_concurrency": 4}],
        "tenants": {"a": {"api_keys": [KEY_A]}},
        "server": {"shutdown_grace_ms": 2000},
        "state": {"backend": "redis", "redis_url": redis_server.url, "lease_ms": 1500},
    }
    proxy = await start_serve(write_config(tmp_path / "c.yaml", config), workers=2)
    applied = "admin change from the worker group"
    try:
        assert await post(proxy, "/admin/replicas/r0/drain") == {"replica": "r0", "draining": True}
        await every_worker_shows(proxy, "/admin/state", draining)
        redis_server.stop()
        redis_server.start()
        before = len(proxy.named(applied))
        os.kill(proxy.listening()[0]["pid"], signal.SIGKILL)
        await proxy.wait_listening(3)
        async with asyncio.timeout(WAIT_S):  # the new worker drains r0 as it starts
            while len(proxy.named(applied)) == before:
                await asyncio.sleep(0.05)
        assert proxy.named(applied)[-1]["op"] == "drain"
    finally:
        assert await proxy.stop() == 0
