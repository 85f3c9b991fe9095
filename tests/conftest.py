"""Shared fixtures: a fake upstream and the real proxy, on OS-chosen loopback ports."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from proxy.app import build_app
from proxy.runtime import RUNTIME, Runtime
from proxy.settings import Config
from tests.helpers import wait_for
from tests.upstreams import UPSTREAM, Upstream, build_upstream

#: Real-engine fixtures (llama-server), used by the ``engine``-marked tests.
pytest_plugins = ("tests.engine", "tests.redis_server")

ServerFactory = Callable[..., Awaitable[TestServer]]
ClientFactory = Callable[..., Awaitable[TestClient[web.Request, web.Application]]]


class ProxyUnderTest:
    """The running proxy: its test client and its live runtime."""

    def __init__(self, client: TestClient[web.Request, web.Application]) -> None:
        self.client = client
        self.runtime: Runtime = client.app[RUNTIME]

    @property
    def url(self) -> str:
        return str(self.client.make_url("")).rstrip("/")

    def assert_idle(self) -> None:
        """Every seat, queue slot and tenant place is back to zero."""
        runtime = self.runtime
        assert runtime.pool.total_inflight() == 0, runtime.pool
        assert runtime.dispatcher.total_inflight() == 0, runtime.dispatcher
        assert len(runtime.dispatcher.scheduler) == 0, runtime.dispatcher
        assert not runtime.active

    async def wait_idle(self) -> None:
        """``assert_idle`` once a seat the proxy gave up on is back: after its own
        first-byte, idle or total timeout the replica may still run the attempt, so
        its seat stays taken for ``cancel_grace_ms`` (as a cancelled request's)."""
        runtime = self.runtime
        grace_s = runtime.rules.config.timeouts.cancel_grace_ms / 1000.0
        await wait_for(
            lambda: runtime.pool.total_inflight() == 0 and runtime.dispatcher.total_inflight() == 0,
            timeout_s=grace_s + 10.0,
        )
        self.assert_idle()


@pytest.fixture
async def upstream_server(aiohttp_server: ServerFactory) -> TestServer:
    return await aiohttp_server(build_upstream())


@pytest.fixture
def upstream_state(upstream_server: TestServer) -> Upstream:
    return upstream_server.app[UPSTREAM]


@pytest.fixture
def upstream_url(upstream_server: TestServer) -> str:
    return str(upstream_server.make_url("")).rstrip("/")


@pytest.fixture
def start_proxy(aiohttp_client: ClientFactory) -> Callable[..., Awaitable[ProxyUnderTest]]:
    async def start(config: Config, *, ready: bool = True, **kwargs: Any) -> ProxyUnderTest:
        """Start the proxy; with ``ready``, wait until a replica is warmed and serving."""
        client = await aiohttp_client(build_app(config, seed=1, **kwargs))
        proxy = ProxyUnderTest(client)
        if ready:
            await wait_for(lambda: any(r.serving for r in proxy.runtime.pool.replicas))
        return proxy

    return start
