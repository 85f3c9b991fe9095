"""Hostile requests against a live proxy, sent as raw bytes on a socket.

A client library would normalise what these probes depend on (dot segments,
escapes, header bytes), so each probe is written out by hand. The replica is
a small aiohttp app mounted under a path prefix (``/prefix``) that records
every request it receives: a probe the proxy must refuse may leave no trace
there, and one it forwards must arrive at exactly the normalised path.

Every answer is checked for what section 6 owes a client: ``X-Request-Id``
(the probe's own), and on an error ``X-Admission-Reason`` with the JSON error
body carrying the same reason. No tenant key or admin token may appear in an
answer, the access log or the process output.
"""

from __future__ import annotations

import asyncio
import io
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from proxy.entrance import MAX_JSON_DEPTH
from tests.conftest import ProxyUnderTest, ServerFactory
from tests.helpers import KEY_A, make_config, wait_for

Start = Callable[..., Awaitable[ProxyUnderTest]]
ADMIN_TOKEN = "admin-token-probe-7f3a"
PREFIX = "/prefix"
CHAT = "/v1/chat/completions"
GOOD_BODY = b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}'
KEY = f"X-API-Key: {KEY_A}".encode()
ADMIN = f"Authorization: Bearer {ADMIN_TOKEN}".encode()


# --- the replica that records everything ----------------------------------------


@dataclass
class Seen:
    """Every request the replica received: method, raw path and query, request id."""

    requests: list[tuple[str, str, str | None]] = field(default_factory=list)

    def of(self, request_id: str) -> list[tuple[str, str]]:
        return [(m, p) for m, p, rid in self.requests if rid == request_id]


SEEN: web.AppKey[Seen] = web.AppKey("seen", Seen)


async def record(request: web.Request) -> web.Response:
    request.app[SEEN].requests.append(
        (request.method, request.raw_path, request.headers.get("X-Request-Id"))
    )
    await request.read()
    if request.path == f"{PREFIX}/v1/models":
        return web.json_response({"object": "list", "data": [{"id": "m"}]})
    return web.json_response(
        {
            "id": "x",
            "object": "chat.completion",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        }
    )


def recording_replica() -> web.Application:
    app = web.Application()
    app[SEEN] = Seen()
    app.router.add_route("*", "/{tail:.*}", record)
    return app


# --- raw HTTP ---------------------------------------------------------------------


@dataclass
class Answer:
    status: int
    headers: dict[str, str]  # lower-case names
    body: bytes
    raw: bytes

    def error(self) -> dict[str, str]:
        parsed: dict[str, dict[str, str]] = json.loads(self.body)
        return parsed["error"]


async def exchange(port: int, head: bytes, body: bytes = b"") -> Answer:
    """Send one request as written (``Connection: close``) and read the whole answer."""
    request = head + b"\r\nContent-Length: " + str(len(body)).encode()
    request += b"\r\nConnection: close\r\n\r\n" + body
    async with asyncio.timeout(10):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(request)
            await writer.drain()
            raw = await reader.read()
        finally:
            writer.close()
    status_line, _, rest = raw.partition(b"\r\n")
    header_block, _, payload = rest.partition(b"\r\n\r\n")
    headers: dict[str, str] = {}
    for line in header_block.split(b"\r\n"):
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    return Answer(int(status_line.split()[1]), headers, payload, raw)


def request_head(method: str, target: str, *headers: bytes) -> bytes:
    lines = [f"{method} {target} HTTP/1.1".encode(), b"Host: proxy", *headers]
    return b"\r\n".join(lines)


# --- the probes -------------------------------------------------------------------


@dataclass(frozen=True)
class Probe:
    method: str
    target: str
    headers: tuple[bytes, ...]
    status: int
    #: The reason an error answer carries; None for a success.
    reason: str | None
    body: bytes = b""
    #: The path (and query) the replica must receive, or None: nothing may reach it.
    reaches: str | None = None
    allow: str | None = None


PROBES: dict[str, Probe] = {
    # Path traversal past the replica's prefix: refused, whatever the spelling.
    "traversal": Probe("GET", "/v1/../../admin-secret", (KEY,), 400, "bad_request"),
    "traversal-encoded-dots": Probe(
        "GET", "/v1/%2e%2e/%2E%2e/admin-secret", (KEY,), 400, "bad_request"
    ),
    "traversal-encoded-slash": Probe(
        "GET", "/v1/models%2f..%2f..%2fadmin-secret", (KEY,), 400, "bad_request"
    ),
    "traversal-encoded-backslash": Probe(
        "GET", "/v1/models%5c..%5cadmin-secret", (KEY,), 400, "bad_request"
    ),
    "empty-segment": Probe("GET", "/v1//models", (KEY,), 400, "bad_request"),
    "encoded-nul": Probe("GET", "/v1/models/%00", (KEY,), 400, "bad_request"),
    # Dots that stay inside: judged and forwarded as the path they resolve to.
    "dots-to-inference-route-bad-json": Probe(
        "POST", f"/x/..{CHAT}", (KEY,), 400, "bad_request", body=b"{not json"
    ),
    "dots-to-inference-route": Probe(
        "POST", f"/x/..{CHAT}", (KEY,), 200, None, body=GOOD_BODY, reaches=PREFIX + CHAT
    ),
    "encoded-dot-segment": Probe(
        "POST", "/v1/chat/%2e/completions", (KEY,), 200, None, body=GOOD_BODY,
        reaches=PREFIX + CHAT,
    ),
    "reserved-prefix-climbed-out-of": Probe(
        "GET", "/healthz/../v1/models", (KEY,), 200, None, reaches=f"{PREFIX}/v1/models"
    ),
    "query-kept-as-sent": Probe(
        "GET", "/v1/models?x=%2e%2e/y", (KEY,), 200, None, reaches=f"{PREFIX}/v1/models?x=%2e%2e/y"
    ),
    "absolute-form-target": Probe(
        "GET", "http://evil.example/v1/models", (KEY,), 200, None, reaches=f"{PREFIX}/v1/models"
    ),
    # The allow-list: engine control routes and reserved paths are not forwarded.
    "engine-control-route": Probe(
        "POST", "/sim/faults", (KEY,), 404, "route_not_allowed", body=b'{"error_rate": 1}'
    ),
    "engine-control-route-via-dots": Probe(
        "POST", "/v1/../sim/faults", (KEY,), 404, "route_not_allowed", body=b"{}"
    ),
    "engine-control-route-via-escape": Probe(
        "POST", "/%73im/faults", (KEY,), 404, "route_not_allowed", body=b"{}"
    ),
    "longer-name-than-a-route": Probe("POST", "/completionx", (KEY,), 404, "route_not_allowed"),
    "admin-via-dots": Probe("GET", "/v1/../admin/config", (KEY,), 404, "route_not_allowed"),
    "scanner-without-key": Probe("POST", "/sim/faults", (), 401, "unauthenticated", body=b"{}"),
    # Inputs that used to crash a handler.
    "nested-json-100000": Probe("POST", CHAT, (KEY,), 400, "bad_request", body=b"[" * 100_000),
    "nested-json-object": Probe(
        "POST", CHAT, (KEY,), 400, "bad_request",
        body=b'{"a":' * (MAX_JSON_DEPTH + 1) + b"1" + b"}" * (MAX_JSON_DEPTH + 1),
    ),
    "timeout-4301-digits": Probe(
        "POST", CHAT, (KEY, b"X-Request-Timeout-Ms: " + b"9" * 4301), 400, "bad_request",
        body=GOOD_BODY,
    ),
    "timeout-superscript-two": Probe(
        "POST", CHAT, (KEY, "X-Request-Timeout-Ms: \u00b2".encode()), 400, "bad_request",
        body=GOOD_BODY,
    ),
    "timeout-arabic-indic-digits": Probe(
        "POST", CHAT, (KEY, "X-Request-Timeout-Ms: \u0665\u0660\u0660".encode()), 400,
        "bad_request", body=GOOD_BODY,
    ),
    "timeout-eleven-digits": Probe(
        "POST", CHAT, (KEY, b"X-Request-Timeout-Ms: 10000000000"), 400, "bad_request",
        body=GOOD_BODY,
    ),
    "timeout-ascii": Probe(
        "POST", CHAT, (KEY, b"X-Request-Timeout-Ms: 5000"), 200, None, body=GOOD_BODY,
        reaches=PREFIX + CHAT,
    ),
    "unknown-priority": Probe(
        "POST", CHAT, (KEY, b"X-Priority: <zz-probe-class>"), 400, "bad_request", body=GOOD_BODY
    ),
    "empty-body-on-inference-route": Probe("POST", CHAT, (KEY,), 400, "bad_request"),
    "json-array-on-inference-route": Probe("POST", CHAT, (KEY,), 400, "bad_request", body=b"[]"),
    # Credentials.
    "bearer-tab-key": Probe(
        "POST", CHAT, (f"Authorization: Bearer\t{KEY_A}".encode(),), 200, None, body=GOOD_BODY,
        reaches=PREFIX + CHAT,
    ),
    "bearer-without-key": Probe(
        "POST", CHAT, (b"Authorization: Bearer",), 401, "unauthenticated", body=GOOD_BODY
    ),
    "basic-credentials": Probe(
        "POST", CHAT, (b"Authorization: Basic YTpi",), 401, "unauthenticated", body=GOOD_BODY
    ),
    "key-not-utf8": Probe(
        "POST", CHAT, (b"X-API-Key: \xff\xfe",), 401, "unauthenticated", body=GOOD_BODY
    ),
    # Reserved paths: their own answers, never a replica's.
    "healthz": Probe("GET", "/healthz", (), 200, None),
    "readyz": Probe("GET", "/readyz", (), 200, None),
    "metrics": Probe("GET", "/metrics", (), 200, None),
    "healthz-post": Probe("POST", "/healthz", (), 405, "method_not_allowed", allow="GET, HEAD"),
    "admin-method-mismatch": Probe(
        "GET", "/admin/reload", (ADMIN,), 405, "method_not_allowed", allow="POST"
    ),
    "admin-unknown-path": Probe("GET", "/admin/nope", (ADMIN,), 404, "not_found"),
    "admin-unknown-replica": Probe(
        "POST", "/admin/replicas/nope/drain", (ADMIN,), 404, "not_found"
    ),
    "admin-wrong-token": Probe(
        "GET", "/admin/config", (b"Authorization: Bearer wrong",), 401, "unauthenticated"
    ),
    "admin-token-not-ascii": Probe(
        "GET", "/admin/config", ("Authorization: Bearer \u00e9".encode(),), 401,
        "unauthenticated",
    ),
    "admin-bearer-tab-token": Probe(
        "GET", "/admin/state", (f"Authorization: Bearer\t{ADMIN_TOKEN}".encode(),), 200, None
    ),
}  # fmt: skip


@pytest.fixture
async def replica(aiohttp_server: ServerFactory) -> TestServer:
    return await aiohttp_server(recording_replica())


@pytest.fixture
async def proxy(
    start_proxy: Start, replica: TestServer, monkeypatch: pytest.MonkeyPatch, log: io.StringIO
) -> ProxyUnderTest:
    monkeypatch.setenv("ADMISSION_ADMIN_TOKEN", ADMIN_TOKEN)
    url = str(replica.make_url(PREFIX))
    return await start_proxy(make_config([url]), access_log=log)


@pytest.fixture
def log() -> io.StringIO:
    return io.StringIO()


def assert_answer_contract(answer: Answer, request_id: str, reason: str | None) -> None:
    """X-Request-Id always; on an error, the reason header and the section 6 body."""
    assert answer.headers.get("x-request-id") == request_id, answer.raw[:400]
    if answer.status < 400:
        assert "x-admission-reason" not in answer.headers
        return
    assert answer.headers.get("x-admission-reason") == reason, answer.raw[:400]
    error = answer.error()
    assert error["code"] == reason and error["type"] == "admission_error"
    assert error["message"]


def assert_no_secret(*texts: str | bytes) -> None:
    for text in texts:
        data = text.encode() if isinstance(text, str) else text
        assert KEY_A.encode() not in data and ADMIN_TOKEN.encode() not in data


@pytest.mark.parametrize("name", list(PROBES))
async def test_probe(
    name: str,
    proxy: ProxyUnderTest,
    replica: TestServer,
    log: io.StringIO,
    capfd: pytest.CaptureFixture[str],
) -> None:
    """Each probe: its status and reason, X-Request-Id, nothing at the replica unless
    it is forwarded (then at exactly the normalised path), no secret in any output."""
    probe = PROBES[name]
    request_id = f"probe-{name}"
    head = request_head(
        probe.method, probe.target, *probe.headers, f"X-Request-Id: {request_id}".encode()
    )
    answer = await exchange(proxy.client.server.port or 0, head, probe.body)
    assert answer.status == probe.status, answer.raw[:400]
    assert_answer_contract(answer, request_id, probe.reason)
    if probe.allow is not None:
        assert answer.headers["allow"] == probe.allow
    if answer.status >= 400:  # an error echoes nothing the client sent
        for header in probe.headers:
            value = header.partition(b":")[2].strip()
            assert len(value) < 8 or value not in answer.body, header
    await wait_for(lambda: not proxy.runtime.active)
    seen = replica.app[SEEN]
    expected = [(probe.method, probe.reaches)] if probe.reaches is not None else []
    assert seen.of(request_id) == expected
    assert all(path.startswith(PREFIX + "/") for _, path, _ in seen.requests), seen.requests
    proxy.assert_idle()
    access_log = proxy.runtime.telemetry.access_log
    assert access_log is not None
    access_log.flush()
    out, err = capfd.readouterr()
    assert_no_secret(answer.raw, log.getvalue(), out, err)
    if not probe.target.startswith(("/healthz", "/readyz", "/metrics", "/admin")):
        (line,) = [json.loads(text) for text in log.getvalue().splitlines()]
        assert line["request_id"] == request_id and line["status"] == probe.status
        if probe.reason is not None:
            assert line["reason"] == probe.reason


async def test_unexpected_error_is_a_500_with_the_contract(
    proxy: ProxyUnderTest, replica: TestServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bug in the entrance or in an admin handler: 500 internal_error with the
    error body, X-Request-Id and X-Admission-Reason, no traceback, nothing leaked."""

    def broken(*args: object) -> float:
        raise RuntimeError("a bug: Traceback secret-detail")

    monkeypatch.setattr("proxy.entrance.estimate_cost", broken)
    monkeypatch.setattr("proxy.admin.admin_state", broken)
    port = proxy.client.server.port or 0
    for head, body in (
        (request_head("POST", CHAT, KEY, b"X-Request-Id: bug-1"), GOOD_BODY),
        (request_head("GET", "/admin/state", ADMIN, b"X-Request-Id: bug-1"), b""),
    ):
        answer = await exchange(port, head, body)
        assert answer.status == 500
        assert_answer_contract(answer, "bug-1", "internal_error")
        assert b"secret-detail" not in answer.raw and b"Traceback" not in answer.raw
    await wait_for(lambda: not proxy.runtime.active)
    assert replica.app[SEEN].of("bug-1") == []
    proxy.assert_idle()


@pytest.mark.parametrize(
    ("method", "target", "body"),
    [("GET", "/v1/models", b""), ("POST", "/tokenize", b"{}"), ("POST", CHAT, GOOD_BODY)],
)
async def test_shutting_down_refuses_every_request(
    proxy: ProxyUnderTest, replica: TestServer, method: str, target: str, body: bytes
) -> None:
    """Once shutdown has begun, seatless requests too get 503 shutting_down,
    Retry-After 1 and Connection: close, and reach no replica."""
    proxy.runtime.begin_shutdown()
    head = request_head(method, target, KEY, b"X-Request-Id: late-1")
    answer = await exchange(proxy.client.server.port or 0, head, body)
    assert answer.status == 503
    assert_answer_contract(answer, "late-1", "shutting_down")
    assert answer.headers["retry-after"] == "1"
    assert answer.headers["connection"] == "close"
    await wait_for(lambda: not proxy.runtime.active)
    assert replica.app[SEEN].of("late-1") == []
    proxy.assert_idle()


@pytest.mark.parametrize(
    ("target", "headers", "reason"),
    [
        ("/sim/faults", (b"X-Request-Timeout-Ms: soon", b"X-Priority: batch"), "unauthenticated"),
        (CHAT, (KEY, b"X-Request-Timeout-Ms: soon", b"X-Priority: batch"), "bad_request"),
        ("/v1/../..", (KEY, b"X-Priority: batch"), "bad_request"),
        ("/sim/faults", (KEY, b"X-Request-Timeout-Ms: soon"), "bad_request"),
        ("/sim/faults", (KEY, b"X-Priority: batch"), "priority_not_allowed"),
        ("/sim/faults", (KEY, b"Content-Type: application/json"), "route_not_allowed"),
    ],
)
async def test_order_of_checks(
    proxy: ProxyUnderTest, target: str, headers: tuple[bytes, ...], reason: str
) -> None:
    """401, then every 400 on headers (the path among them), then 403, then the
    route: a request failing several checks gets the first one's answer."""
    head = request_head("POST", target, *headers, b"X-Request-Id: order-1")
    answer = await exchange(proxy.client.server.port or 0, head, b"{}")
    assert_answer_contract(answer, "order-1", reason)
