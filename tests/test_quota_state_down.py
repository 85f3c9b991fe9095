"""A token-quota tenant while shared state is down, ``on_failure: reject``.

Redis down with ``reject`` answers 503 ``state_unavailable`` (the error body,
``X-Admission-Reason``, ``Retry-After``). For a tenant with a ``token_quota``
the refusal's own ``x-ratelimit-*`` headers ask the quota store once more,
which fails again: that must not turn the refusal into a bare 500 (it did,
for every refusal of such a tenant while Redis was down).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import pytest

from tests.conftest import ProxyUnderTest
from tests.helpers import KEY_A, make_config
from tests.redis_server import RedisServer

pytestmark = pytest.mark.redis

Start = Callable[..., Awaitable[ProxyUnderTest]]
CHAT = "/v1/chat/completions"
BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


async def test_a_quota_tenant_gets_state_unavailable_when_redis_is_down(
    start_proxy: Start, upstream_url: str, redis_server: RedisServer
) -> None:
    state = {
        "backend": "redis",
        "redis_url": redis_server.url,
        "on_failure": "reject",
        "timeout_ms": 2000,
    }
    tenants = {"a": {"api_keys": [KEY_A], "token_quota": {"per_day": 100_000}}}
    proxy = await start_proxy(make_config([upstream_url], tenants=tenants, state=state))
    headers = {"Authorization": f"Bearer {KEY_A}"}
    async with proxy.client.post(CHAT, json=BODY, headers=headers) as ok:
        assert ok.status == 200
        assert ok.headers["x-ratelimit-limit-tokens"] == "100000"
    redis_server.stop()
    async with proxy.client.post(CHAT, json=BODY, headers=headers) as refused:
        text = await refused.text()
        assert (refused.status, refused.headers.get("X-Admission-Reason")) == (
            503,
            "state_unavailable",
        ), text
        assert refused.headers["Retry-After"] and refused.headers["X-Request-Id"]
    proxy.assert_idle()
