"""The entrance against a real proxy and a fake upstream: identity, headers, bad input."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from proxy.entrance import MAX_JSON_DEPTH, bearer_token, json_too_deep
from proxy.errors import BadRequest
from proxy.paths import normalise_path, reserved, route_allowed
from proxy.runtime import Rules
from tests.conftest import ProxyUnderTest
from tests.helpers import KEY_A, make_config
from tests.upstreams import ENGINE_SERVER, Upstream

Start = Callable[..., Awaitable[ProxyUnderTest]]
CHAT = "/v1/chat/completions"
AUTH = {"Authorization": f"Bearer {KEY_A}"}


async def test_forwards_with_request_id_and_server_timing(
    start_proxy: Start, upstream_url: str, upstream_state: Upstream
) -> None:
    """A served request carries X-Request-Id and Server-Timing; the key is not forwarded."""
    proxy = await start_proxy(make_config([upstream_url]))
    resp = await proxy.client.post(CHAT, json={"max_tokens": 2}, headers=AUTH)
    assert resp.status == 200
    assert (await resp.json())["usage"]["completion_tokens"] == 2
    assert len(resp.headers["X-Request-Id"]) == 32
    timing = resp.headers["Server-Timing"]
    assert all(f"{name};dur=" in timing for name in ("entrance", "queue", "upstream"))
    sent = upstream_state.seen[-1]
    assert "Authorization" not in sent and KEY_A not in str(dict(sent))
    assert sent["X-Request-Id"] == resp.headers["X-Request-Id"]
    assert 0 < int(sent["X-Request-Timeout-Ms"]) <= 60_000
    assert sent["X-Forwarded-For"] == "127.0.0.1"
    proxy.assert_idle()


async def test_keeps_a_valid_client_request_id_and_replaces_a_bad_one(
    start_proxy: Start, upstream_url: str
) -> None:
    """X-Request-Id of 1..128 visible ASCII is kept; anything else is replaced."""
    proxy = await start_proxy(make_config([upstream_url]))
    resp = await proxy.client.get("/x", headers={**AUTH, "X-Request-Id": "abc-123"})
    assert resp.headers["X-Request-Id"] == "abc-123"
    resp = await proxy.client.get("/x", headers={**AUTH, "X-Request-Id": "a" * 129})
    assert resp.headers["X-Request-Id"] != "a" * 129


async def test_x_api_key_and_client_timeout_header(
    start_proxy: Start, upstream_url: str, upstream_state: Upstream
) -> None:
    """X-API-Key identifies the tenant; X-Request-Timeout-Ms shortens the total budget."""
    proxy = await start_proxy(make_config([upstream_url]))
    resp = await proxy.client.post(
        CHAT, json={}, headers={"X-API-Key": KEY_A, "X-Request-Timeout-Ms": "1500"}
    )
    assert resp.status == 200
    assert 0 < int(upstream_state.seen[-1]["X-Request-Timeout-Ms"]) <= 1500
    assert "X-API-Key" not in upstream_state.seen[-1]


@pytest.mark.parametrize(
    ("headers", "status", "reason"),
    [
        ({}, 401, "unauthenticated"),
        ({"Authorization": "Bearer nope"}, 401, "unauthenticated"),
        ({"Authorization": "Basic abc"}, 401, "unauthenticated"),
        ({**AUTH, "X-Priority": "urgent"}, 400, "bad_request"),
        ({**AUTH, "X-Request-Timeout-Ms": "soon"}, 400, "bad_request"),
        ({**AUTH, "X-Request-Timeout-Ms": "0"}, 400, "bad_request"),
        ({**AUTH, "X-Priority": "batch"}, 403, "priority_not_allowed"),
    ],
)
async def test_bad_headers_are_refused_with_their_reason(
    start_proxy: Start,
    upstream_url: str,
    upstream_state: Upstream,
    headers: dict[str, str],
    status: int,
    reason: str,
) -> None:
    """Each bad header gets its documented status and reason, and reaches no replica."""
    proxy = await start_proxy(make_config([upstream_url]))
    resp = await proxy.client.post(CHAT, json={}, headers=headers)
    assert resp.status == status
    assert resp.headers["X-Admission-Reason"] == reason
    body = await resp.json()
    assert body["error"]["code"] == reason and body["error"]["type"] == "admission_error"
    assert "X-Request-Id" in resp.headers and "Server-Timing" in resp.headers
    assert upstream_state.seen == []
    proxy.assert_idle()


async def test_allowed_priority_is_accepted(start_proxy: Start, upstream_url: str) -> None:
    """A class in allowed_priorities passes."""
    proxy = await start_proxy(make_config([upstream_url]))
    resp = await proxy.client.post(CHAT, json={}, headers={**AUTH, "X-Priority": "interactive"})
    assert resp.status == 200


async def test_anonymous_tenant(start_proxy: Start, upstream_url: str) -> None:
    """With anonymous set to a tenant, a request without a key is served as that tenant."""
    tenants = {"a": {"api_keys": [KEY_A]}, "public": {"queue_capacity": 1}}
    proxy = await start_proxy(make_config([upstream_url], tenants=tenants, anonymous="public"))
    assert (await proxy.client.post(CHAT, json={})).status == 200
    resp = await proxy.client.post(CHAT, json={}, headers={"Authorization": "Bearer wrong"})
    assert resp.status == 401
    # A credential in another form is not "no key": it is refused, not served anonymously.
    resp = await proxy.client.post(CHAT, json={}, headers={"Authorization": "Basic YTpi"})
    assert resp.status == 401
    assert (await resp.json())["error"]["message"] == 'Authorization must be "Bearer <key>"'


async def test_body_too_large_by_content_length_and_by_stream(
    start_proxy: Start, upstream_url: str, upstream_state: Upstream
) -> None:
    """Over max_body_bytes: 413, whether announced in Content-Length or sent chunked."""
    proxy = await start_proxy(make_config([upstream_url], server={"max_body_bytes": 100}))
    resp = await proxy.client.post(CHAT, data=b"x" * 101, headers=AUTH)
    assert resp.status == 413
    assert resp.headers["X-Admission-Reason"] == "body_too_large"

    async def chunks() -> AsyncIterator[bytes]:
        for _ in range(5):
            yield b"y" * 50

    resp = await proxy.client.post(CHAT, data=chunks(), headers=AUTH)
    assert resp.status == 413
    assert upstream_state.seen == []
    proxy.assert_idle()


async def test_invalid_json_on_inference_route(start_proxy: Start, upstream_url: str) -> None:
    """Invalid JSON on an inference route: 400 bad_request."""
    proxy = await start_proxy(make_config([upstream_url]))
    resp = await proxy.client.post(CHAT, data=b"{not json", headers=AUTH)
    assert resp.status == 400
    assert resp.headers["X-Admission-Reason"] == "bad_request"


async def test_slow_body_gets_408(start_proxy: Start, upstream_url: str) -> None:
    """A client that announces a body and sends only part of it gets 408 after entrance_ms."""
    proxy = await start_proxy(make_config([upstream_url], server={"entrance_ms": 200}))
    host, port = proxy.client.server.host, proxy.client.server.port
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(
        f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY_A}\r\n"
        "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{".encode()
    )
    await writer.drain()
    status_line = await asyncio.wait_for(reader.readline(), timeout=5)
    assert b" 408 " in status_line
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=5)
    assert b"X-Admission-Reason: entrance_timeout" in head
    writer.close()
    proxy.assert_idle()


async def test_reserved_paths_are_not_proxied(
    start_proxy: Start, upstream_url: str, upstream_state: Upstream
) -> None:
    """/healthz, /readyz and /metrics answer from the proxy itself, without a key."""
    proxy = await start_proxy(make_config([upstream_url]))
    assert (await proxy.client.get("/healthz")).status == 200
    assert (await proxy.client.get("/readyz")).status == 200
    metrics = await (await proxy.client.get("/metrics")).text()
    assert "admission_replica_limit" in metrics
    assert upstream_state.seen == []


async def test_the_proxys_own_answers_name_no_versions_and_relayed_ones_keep_the_engines(
    start_proxy: Start, upstream_url: str
) -> None:
    """aiohttp's default ``Server: Python/3.x aiohttp/3.x`` tells a scanner which
    known bugs to try: the proxy's own answers, errors and successes, say
    ``admission-proxy``; a relayed answer carries the engine's own header."""
    proxy = await start_proxy(make_config([upstream_url]))
    refused = await proxy.client.get("/x")  # no key: 401
    assert refused.status == 401
    for resp in (refused, await proxy.client.get("/healthz"), await proxy.client.get("/metrics")):
        assert resp.headers["Server"] == "admission-proxy"
    relayed = await proxy.client.post(CHAT, json={}, headers=AUTH)
    assert relayed.status == 200
    assert relayed.headers["Server"] == ENGINE_SERVER
    # An engine that names aiohttp's default (an aiohttp server of the same versions).
    echoed = await proxy.client.post("/v1/embeddings", json={}, headers=AUTH)
    assert echoed.status == 200 and echoed.headers["Server"] == "admission-proxy"


async def test_paths_under_a_route_are_proxied_to_the_replica(
    start_proxy: Start, upstream_url: str, upstream_state: Upstream
) -> None:
    """A path under a configured route goes to a replica, query string included;
    any other gets 404 route_not_allowed and reaches no replica."""
    proxy = await start_proxy(make_config([upstream_url], routes=["/custom", "/v1/models"]))
    resp = await proxy.client.post("/custom/route?x=1", data=b"abc", headers=AUTH)
    assert resp.status == 200
    assert await resp.json() == {"method": "POST", "path": "/custom/route?x=1", "body_bytes": 3}
    resp = await proxy.client.get("/v1/models", headers=AUTH)
    assert resp.status == 200
    seen = len(upstream_state.seen)
    for path in ("/customer", "/v1/chat/completions", "/other"):
        resp = await proxy.client.post(path, json={}, headers=AUTH)
        assert resp.status == 404, path
        assert resp.headers["X-Admission-Reason"] == "route_not_allowed"
        assert (await resp.json())["error"]["code"] == "route_not_allowed"
    assert len(upstream_state.seen) == seen
    proxy.assert_idle()


async def test_the_default_routes_forward_engine_routes_only(
    start_proxy: Start, upstream_url: str, upstream_state: Upstream
) -> None:
    """Without routes: inference and model routes go through; an engine's own
    control route (/sim/faults) and unknown paths get 404 route_not_allowed."""
    proxy = await start_proxy(make_config([upstream_url]))
    for path in ("/v1/embeddings", "/v1/models/some-model", "/tokenize", "/infill"):
        resp = await proxy.client.post(path, json={"input": "x"}, headers=AUTH)
        assert resp.status == 200, path
    seen = len(upstream_state.seen)
    for path in ("/sim/faults", "/health", "/completionx", "/v1/other"):
        resp = await proxy.client.post(path, json={}, headers=AUTH)
        assert resp.status == 404, path
        assert resp.headers["X-Admission-Reason"] == "route_not_allowed"
    assert len(upstream_state.seen) == seen
    counter = proxy.runtime.telemetry.metrics.requests
    assert counter.labels("a", "standard", "rejected", "route_not_allowed").value == 4


async def test_routes_follow_a_reload(
    start_proxy: Start, upstream_url: str, upstream_state: Upstream
) -> None:
    """routes is read from the rules of each request: after a reload opening "/",
    a path refused before is forwarded."""
    proxy = await start_proxy(make_config([upstream_url]))
    assert (await proxy.client.post("/custom", data=b"x", headers=AUTH)).status == 404
    proxy.runtime.apply(Rules.from_config(make_config([upstream_url], routes=["/"])))
    resp = await proxy.client.post("/custom", data=b"x", headers=AUTH)
    assert resp.status == 200
    assert (await resp.json())["path"] == "/custom"
    assert len(upstream_state.seen) == 1
    proxy.assert_idle()


async def test_upstream_status_passes_through(start_proxy: Start, upstream_url: str) -> None:
    """An upstream's own 4xx keeps its status and body, tagged upstream_status."""
    proxy = await start_proxy(make_config([upstream_url], routes=["/status"]))
    resp = await proxy.client.post("/status/422", json={}, headers=AUTH)
    assert resp.status == 422
    assert resp.headers["X-Admission-Reason"] == "upstream_status"
    assert (await resp.json())["error"]["message"] == "status 422"


async def test_rate_limited_with_retry_after_from_the_bucket(
    start_proxy: Start, upstream_url: str
) -> None:
    """rate_per_s 0.5 with burst 2: the third quick request is refused, told to wait 2 s."""
    tenants = {"a": {"api_keys": [KEY_A], "rate_per_s": 0.5, "burst": 2}}
    proxy = await start_proxy(make_config([upstream_url], tenants=tenants))
    statuses = [(await proxy.client.post(CHAT, json={}, headers=AUTH)) for _ in range(3)]
    assert [r.status for r in statuses] == [200, 200, 429]
    refused = statuses[2]
    assert refused.headers["X-Admission-Reason"] == "rate_limited"
    assert refused.headers["Retry-After"] == "2"
    proxy.assert_idle()


# --- the path, the allow-list and the parsers, without sockets -----------------


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("/v1/chat/completions", "/v1/chat/completions"),
        ("/x/../v1/chat/completions", "/v1/chat/completions"),
        ("/v1/./models", "/v1/models"),
        ("/a/b/..", "/a/"),
        ("/a/.", "/a/"),
        ("/v1/%2e%2E/v1/models", "/v1/models"),
        ("/v1/chat/%63ompletions", "/v1/chat/completions"),
        ("/v1/models/a%20b", "/v1/models/a%20b"),
        ("/v1/models/meta-llama%2FLlama-3.1-8B", "/v1/models/meta-llama/Llama-3.1-8B"),
        ("/v1/models/org%2fname%2Flora", "/v1/models/org/name/lora"),
        ("/.well-known/x", "/.well-known/x"),
        ("/v1/models/", "/v1/models/"),
        ("/", "/"),
    ],
)
def test_normalise_path(raw: str, expected: str) -> None:
    """Dot segments resolved, unreserved escapes decoded, other escapes kept as sent."""
    assert normalise_path(raw) == expected


@pytest.mark.parametrize(
    ("raw", "why"),
    [
        ("/..", "above the root"),
        ("/v1/../../admin-secret", "above the root"),
        ("/v1/%2e%2e/%2E%2E/secret", "above the root"),
        ("/v1%2fchat", "encoded slash"),
        ("/v1%2F..%2Fsecret", "encoded slash"),
        ("/v1%5c..", "encoded slash or backslash"),
        ("/v1/models/a%2F..%2F..%2F..%2Fadmin", "climbs out of /v1/models/"),
        ("/v1/models/a%2F..%2F..%2Fchat/completions", "climbs out of /v1/models/"),
        ("/v1/models/a%2F%2Fb", "empty segment"),
        ("/v1/models/a%5Cb", "encoded slash or backslash"),
        ("/v1/modelsx/a%2Fb", "encoded slash"),
        ("/v1\\..\\secret", "backslash"),
        ("/v1//chat/completions", "empty segment"),
        ("/v1/%00", "control character"),
        ("/v1/%0a", "control character"),
        ("/v1/%zz", "malformed"),
        ("/v1/%4", "malformed"),
        ("/caf\u00e9", "visible ASCII"),
        ("/a b", "visible ASCII"),
        ("*", "absolute path"),
    ],
)
def test_normalise_path_refuses(raw: str, why: str) -> None:
    """Each ambiguous or escaping spelling is a BadRequest saying why."""
    with pytest.raises(BadRequest, match=why):
        normalise_path(raw)


@pytest.mark.parametrize(
    ("path", "routes", "allowed"),
    [
        ("/v1/models", {"/v1/models"}, True),
        ("/v1/models/my-model", {"/v1/models"}, True),
        ("/v1/models/", {"/v1/models"}, True),
        ("/v1/modelsx", {"/v1/models"}, False),
        ("/completionx", {"/completion"}, False),
        ("/v1", {"/v1/models"}, False),
        ("/anything/at/all", {"/"}, True),
        ("/", {"/v1"}, False),
    ],
)
def test_route_allowed_by_whole_segments(path: str, routes: set[str], allowed: bool) -> None:
    """A route lets itself and the paths below it through, never a longer name."""
    assert route_allowed(path, routes) is allowed


@pytest.mark.parametrize(
    ("path", "is_reserved"),
    [("/healthz", True), ("/admin/config", True), ("/metrics/x", True), ("/adminx", False)],
)
def test_reserved_paths_by_whole_segments(path: str, is_reserved: bool) -> None:
    """The proxy's own paths and everything below them, not longer names."""
    assert reserved(path) is is_reserved


@pytest.mark.parametrize(
    ("body", "too_deep"),
    [
        (b"[" * 64 + b"]" * 64, False),
        (b"[" * 65 + b"]" * 65, True),
        (b'{"a":' * 65 + b"1" + b"}" * 65, True),
        (b"[" + b"[]," * 1000 + b"[]]", False),  # many brackets, shallow
        (b'{"s": "' + b"[" * 500 + b'"}', False),  # brackets inside a string
        (b'{"s": "\\"[[[' + b"[" * 500 + b'"}', False),  # after an escaped quote
        (b"[" * 100_000, True),
    ],
)
def test_json_depth_scan(body: bytes, too_deep: bool) -> None:
    """Nesting counted outside strings, against the limit, without recursion."""
    assert json_too_deep(body, MAX_JSON_DEPTH) is too_deep


@pytest.mark.parametrize(
    ("header", "token"),
    [
        ("Bearer k1", "k1"),
        ("bearer k1", "k1"),
        ("Bearer\tk1", "k1"),
        ("Bearer \t  k1 ", "k1"),
        ("Bearerk1", None),
        ("Bearer ", None),
        ("Basic k1", None),
        ("", None),
    ],
)
def test_bearer_token(header: str, token: str | None) -> None:
    """Any run of spaces and tabs after the scheme; anything else is no bearer token."""
    assert bearer_token(header) == token
