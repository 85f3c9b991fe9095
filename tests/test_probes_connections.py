"""Hostile connections against a live proxy: malformed heads, slow heads, idle and surplus sockets.

Raw sockets throughout, since a client library would normalise what these
probes send. The parser probes run against ``python -m proxy serve`` in a
subprocess (its stdout and stderr captured to files), once with aiohttp's C
parser and once with the pure-Python one; the connection limits run against
the same listener in-process (``ProxyRunner``), where a test can count the
open connections. Every probe asserts the status, the reason, the headers and
that nothing reached the replica; the parser probes also grep every captured
output and every answer for the API keys they carried.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import re
import resource
import secrets
import signal
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from aiohttp import web
from multidict import CIMultiDict
from structlog.testing import capture_logs

from proxy.app import build_app, build_runtime
from proxy.lifecycle import bound_port
from proxy.listener import Listener, ProxyRunner
from proxy.reload import Reloader
from proxy.runtime import RUNTIME, Runtime
from proxy.settings import DEFAULT_HEADER_MS, ConfigError, load_config
from tests.helpers import KEY_A, make_config, samples_by_label, wait_for
from tests.upstreams import Upstream

CHAT = "/v1/chat/completions"
CLI = [sys.executable, "-m", "proxy"]
REQUEST_ID = re.compile(r"[0-9a-f]{32}")
BAD_REQUEST_BODY = {
    "error": {"message": "malformed HTTP request", "type": "admission_error", "code": "bad_request"}
}
#: Seconds any single exchange may take before the test gives up on it.
EXCHANGE_S = 20.0

#: Requests the HTTP parser refuses, each carrying an API key where the
#: parser's own error message would quote it.
GET = "GET /v1/models HTTP/1.1\r\nHost: p\r\n"
MALFORMED: dict[str, str] = {
    "DEL in a header value": GET + "Authorization: Bearer {key}\x7f\r\n\r\n",
    "LF-only line endings": "GET /v1/models HTTP/1.1\nHost: p\nAuthorization: Bearer {key}\n\n",
    "obs-fold continuation": GET + "Authorization: Bearer\r\n {key}\r\n\r\n",
    "over-long header line": GET + "Authorization: Bearer {key}" + "k" * 9000 + "\r\n\r\n",
    "NUL in a header value": GET + "X-API-Key: {key}\x00\r\n\r\n",
    "bare CR in a header value": GET + "X-API-Key: {key}\rX\r\n\r\n",
    "space before the colon": GET + "Authorization : Bearer {key}\r\n\r\n",
    "header without a colon": GET + "Authorization Bearer {key}\r\n\r\n",
    "key as the method": "{key}\x01 / HTTP/1.1\r\nHost: p\r\n\r\n",
    "bad version, key in the query": "GET /v1/models?api_key={key} HTTP/9.x\r\nHost: p\r\n\r\n",
    "over-long request line": "GET /{key}" + "k" * 9000 + " HTTP/1.1\r\nHost: p\r\n\r\n",
    "key as Content-Length": f"POST {CHAT} HTTP/1.1\r\nHost: p\r\nContent-Length: {{key}}\r\n\r\n",
}


@dataclass
class Answer:
    status: int
    headers: CIMultiDict[str]
    body: bytes
    raw: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def _parse(raw: bytes) -> Answer:
    head, sep, body = raw.partition(b"\r\n\r\n")
    assert sep, f"no complete response head in {raw[:200]!r}"
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers: CIMultiDict[str] = CIMultiDict()
    for line in lines:
        name, _, value = line.partition(":")
        headers.add(name.strip(), value.strip())
    length = int(headers.get("Content-Length", len(body)))
    return Answer(int(status_line.split()[1]), headers, body[:length], raw)


async def _read_to_eof(reader: asyncio.StreamReader) -> bytes:
    """Everything the proxy sends until it closes the connection."""
    data = b""
    async with asyncio.timeout(EXCHANGE_S):
        while chunk := await reader.read(65536):
            data += chunk
    return data


async def _read_response(reader: asyncio.StreamReader) -> Answer:
    """One response on a connection that stays open (the body has a Content-Length)."""
    async with asyncio.timeout(EXCHANGE_S):
        head = await reader.readuntil(b"\r\n\r\n")
        answer = _parse(head)
        body = await reader.readexactly(int(answer.headers["Content-Length"]))
    return Answer(answer.status, answer.headers, body, head + body)


async def _broken_chunk_after_the_head(port: int, key: str, secret: str) -> Answer:
    """A chunked POST whose head waits for "100 Continue", then a chunk-size line of
    garbage holding ``secret``; the final answer, read to the connection's end."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(
            f"POST {CHAT} HTTP/1.1\r\nHost: p\r\nAuthorization: Bearer {key}\r\n"
            "Expect: 100-continue\r\nTransfer-Encoding: chunked\r\n\r\n".encode()
        )
        async with asyncio.timeout(EXCHANGE_S):
            interim = await reader.readuntil(b"\r\n\r\n")
        assert interim.startswith(b"HTTP/1.1 100"), interim
        writer.write(f"ZZ{secret}\r\n\r\n".encode())
        return _parse(await _read_to_eof(reader))
    finally:
        writer.close()


async def _exchange(port: int, raw: bytes) -> Answer:
    """Send ``raw`` on a new connection; the answer, read to the connection's end."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(raw)
        await writer.drain()
        return _parse(await _read_to_eof(reader))
    finally:
        writer.close()


def _chat_request(key: str, *, request_id: str | None = None, version: str = "1.1") -> bytes:
    """A chat completion; with ``version`` 1.0 the proxy closes the connection after it."""
    body = b'{"max_tokens": 2}'
    extra = f"X-Request-Id: {request_id}\r\n" if request_id else ""
    return (
        f"POST {CHAT} HTTP/{version}\r\nHost: p\r\nAuthorization: Bearer {key}\r\n{extra}"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body


def _client_requests(upstream: Upstream) -> int:
    """Requests the replica got from clients (not the proxy's own warm-up)."""
    return sum(1 for h in upstream.seen if h.get("X-Request-Id") != "admission-warmup")


def _requests_total(metrics_text: str, reason: str) -> float:
    return samples_by_label(metrics_text, "admission_requests_total", "reason").get(reason, 0.0)


# -- the parser's refusals, against the real process ---------------------------------------------


@dataclass
class LiveProxy:
    process: asyncio.subprocess.Process
    url: str
    stdout: Path
    stderr: Path

    async def stop(self) -> None:
        if self.process.returncode is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.process.wait(), timeout=15)
            except TimeoutError:
                self.process.kill()
                await self.process.wait()


async def _serve(tmp_path: Path, config: dict[str, Any], env: dict[str, str]) -> LiveProxy:
    """``python -m proxy serve --port 0``, output to files; returns once a replica serves."""
    path = tmp_path / "proxy.yaml"
    path.write_text(yaml.safe_dump(config))
    stdout, stderr = tmp_path / "stdout.log", tmp_path / "stderr.log"
    with stdout.open("wb") as out, stderr.open("wb") as err:
        process = await asyncio.create_subprocess_exec(
            *CLI, "serve", "--config", str(path), "--host", "127.0.0.1", "--port", "0",
            stdout=out, stderr=err, env={**os.environ, **env},
        )  # fmt: skip
    proxy = None
    try:
        async with asyncio.timeout(30):
            while proxy is None:
                assert process.returncode is None, stderr.read_text()
                for line in stdout.read_text().split("\n")[:-1]:  # whole lines only
                    event = json.loads(line)
                    if event.get("event") == "listening":
                        url = f"http://127.0.0.1:{event['port']}"
                        proxy = LiveProxy(process, url, stdout, stderr)
                await asyncio.sleep(0.05)
            async with aiohttp.ClientSession() as session:
                while (await session.get(proxy.url + "/readyz")).status != 200:
                    await asyncio.sleep(0.05)
    except BaseException:
        process.kill()
        await process.wait()
        raise
    return proxy


@pytest.mark.parametrize("parser", ["c", "python"])
async def test_malformed_requests_get_the_proxys_answer_and_no_key_is_echoed_or_logged(
    tmp_path: Path, upstream_url: str, upstream_state: Upstream, parser: str
) -> None:
    """Each malformed head: 400 bad_request, the error body, a fresh X-Request-Id,
    Connection: close, nothing forwarded, counted and logged once; a good key and an
    unknown key work as usual; no key in any answer, stdout line or stderr."""
    good_key = f"sk-good-{secrets.token_hex(12)}"
    unknown_key = f"sk-unknown-{secrets.token_hex(12)}"
    config = {
        "replicas": [{"name": "r0", "url": upstream_url, "max_concurrency": 2}],
        "tenants": {"a": {"api_keys": [good_key]}},
    }
    env = {"AIOHTTP_NO_EXTENSIONS": "1"} if parser == "python" else {}
    env["PYTHONUNBUFFERED"] = "1"
    proxy = await _serve(tmp_path, config, env)
    port = int(proxy.url.rsplit(":", 1)[1])
    keys = [good_key, unknown_key]
    answers: list[Answer] = []
    try:
        before = _client_requests(upstream_state)
        ids: dict[str, str] = {}  # request id -> probe
        for name, template in MALFORMED.items():
            key = f"sk-probe-{secrets.token_hex(12)}"
            keys.append(key)
            answer = await _exchange(port, template.format(key=key).encode("latin-1"))
            answers.append(answer)
            assert answer.status == 400, (name, answer.raw[:300])
            assert answer.headers["X-Admission-Reason"] == "bad_request", name
            assert answer.headers["Connection"] == "close", name
            assert answer.headers["Content-Type"].startswith("application/json"), name
            assert REQUEST_ID.fullmatch(answer.headers["X-Request-Id"]), name
            assert answer.json() == BAD_REQUEST_BODY, name
            assert answer.headers["Server"] == "admission-proxy", name  # no versions
            ids[answer.headers["X-Request-Id"]] = name
        assert len(ids) == len(MALFORMED), "every answer has its own request id"
        # A broken chunk after a good head: the head is handed on first (the proxy sends
        # "100 Continue"), so the entrance, not the listener, reads the broken chunk.
        key = f"sk-chunk-{secrets.token_hex(12)}"
        keys.append(key)
        chunk = await _broken_chunk_after_the_head(port, good_key, key)
        answers.append(chunk)
        assert chunk.status == 400 and chunk.headers["X-Admission-Reason"] == "bad_request"
        assert chunk.json()["error"]["code"] == "bad_request"
        chunk_id = chunk.headers["X-Request-Id"]
        assert _client_requests(upstream_state) == before, "a malformed request reached a replica"

        good = await _exchange(port, _chat_request(good_key, version="1.0"))
        unknown = await _exchange(port, _chat_request(unknown_key, version="1.0"))
        answers += [good, unknown]
        assert good.status == 200
        assert unknown.status == 401
        assert unknown.headers["X-Admission-Reason"] == "unauthenticated"
        assert _client_requests(upstream_state) == before + 1
        async with aiohttp.ClientSession() as session:
            metrics = await (await session.get(proxy.url + "/metrics")).text()
        assert _requests_total(metrics, "bad_request") == len(MALFORMED) + 1
    finally:
        await proxy.stop()
    assert proxy.process.returncode == 0

    stdout, stderr = proxy.stdout.read_text(), proxy.stderr.read_text()
    forwarded = [v for headers in upstream_state.seen for v in headers.values()]
    for key in keys:
        assert key not in stdout, "an API key in stdout"
        assert key not in stderr, "an API key in stderr"
        assert not any(key.encode() in a.raw for a in answers), "an API key in an answer"
        assert not any(key in value for value in forwarded), "a client's key sent upstream"
    assert "Traceback" not in stderr and "Traceback" not in stdout
    events = [json.loads(line) for line in stdout.splitlines()]
    refused = [e for e in events if e["event"] == "request" and e["reason"] == "bad_request"]
    assert {e["request_id"] for e in refused} == {*ids, chunk_id}
    assert all((e["status"], e["outcome"]) == (400, "rejected") for e in refused)
    assert all(e["tenant"] == "unknown" for e in refused if e["request_id"] != chunk_id)
    logged = [e for e in events if e["event"] == "answered by the listener"]
    assert {e["request_id"] for e in logged} - {chunk_id} == set(ids)
    assert all(re.fullmatch(r"[A-Za-z]+", e["error"]) for e in logged), logged
    # The two parsers name the same mistake differently: the one asked for ran.
    lf_only = next(e["error"] for e in logged if ids[e["request_id"]] == "LF-only line endings")
    assert lf_only == {"c": "BadStatusLine", "python": "BadHttpMessage"}[parser]


@pytest.mark.parametrize("parser", ["c", "python"])
async def test_a_header_value_that_is_not_utf8_is_forwarded_without_those_bytes(
    tmp_path: Path, upstream_url: str, upstream_state: Upstream, parser: str
) -> None:
    """A header the proxy forwards, holding bytes that are not UTF-8: the request is
    served, and the replica gets the value without those bytes, with either parser.
    (aiohttp's C header writer dropped them; the pure-Python one raised, a 500.)"""
    config = {
        "replicas": [{"name": "r0", "url": upstream_url, "max_concurrency": 2}],
        "tenants": {"a": {"api_keys": [KEY_A]}},
    }
    env = {"AIOHTTP_NO_EXTENSIONS": "1"} if parser == "python" else {}
    proxy = await _serve(tmp_path, config, {**env, "PYTHONUNBUFFERED": "1"})
    port = int(proxy.url.rsplit(":", 1)[1])
    body = b'{"max_tokens": 2}'
    raw = (
        f"POST {CHAT} HTTP/1.1\r\nHost: p\r\nAuthorization: Bearer {KEY_A}\r\n".encode()
        + b"X-Custom: ab\xffcd\xc3\xa9\r\nX-Forwarded-For: 10.0.0.1\xfe\r\n"
        + f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
        + body
    )
    try:
        got = await _exchange(port, raw)
    finally:
        await proxy.stop()
    assert got.status == 200, got.raw[:500]
    sent = upstream_state.seen[-1]
    assert sent["X-Custom"] == "abcd\u00e9"
    assert sent["X-Forwarded-For"] == "10.0.0.1, 127.0.0.1"
    assert "Traceback" not in proxy.stderr.read_text() + proxy.stdout.read_text()


@pytest.mark.parametrize("parser", ["c", "python"])
async def test_a_query_string_outside_visible_ascii_is_refused_by_either_parser(
    tmp_path: Path, upstream_url: str, upstream_state: Upstream, parser: str
) -> None:
    """Raw bytes above ASCII in the query string, UTF-8 or not: 400 bad_request with the
    error body and X-Request-Id, nothing forwarded, with either parser. (The C parser
    refused them; the pure-Python one let them through: a UTF-8 one reached the replica,
    one that is not UTF-8 could not be written to it, a 500.)"""
    config = {
        "replicas": [{"name": "r0", "url": upstream_url, "max_concurrency": 2}],
        "tenants": {"a": {"api_keys": [KEY_A]}},
    }
    env = {"AIOHTTP_NO_EXTENSIONS": "1"} if parser == "python" else {}
    proxy = await _serve(tmp_path, config, {**env, "PYTHONUNBUFFERED": "1"})
    port = int(proxy.url.rsplit(":", 1)[1])
    before = _client_requests(upstream_state)
    body = b'{"max_tokens": 2}'
    answers = []
    try:
        for query in (b"q=\xc3\xa9", b"q=\xff\xfe"):
            raw = (
                b"POST "
                + CHAT.encode()
                + b"?"
                + query
                + b" HTTP/1.1\r\nHost: p\r\n"
                + f"Authorization: Bearer {KEY_A}\r\nContent-Length: {len(body)}\r\n".encode()
                + b"Connection: close\r\n\r\n"
                + body
            )
            answers.append(await _exchange(port, raw))
    finally:
        await proxy.stop()
    for got in answers:
        assert got.status == 400 and got.headers["X-Admission-Reason"] == "bad_request", got.raw
        assert got.json()["error"]["code"] == "bad_request"
        assert REQUEST_ID.fullmatch(got.headers["X-Request-Id"])
    assert _client_requests(upstream_state) == before
    assert "Traceback" not in proxy.stderr.read_text() + proxy.stdout.read_text()


# -- connection limits, in-process --------------------------------------------------------------


@dataclass
class Running:
    runtime: Runtime
    listener: Listener
    port: int
    access: io.StringIO

    def requests_total(self, reason: str) -> float:
        return sum(
            child.value
            for labels, child in self.runtime.telemetry.metrics.requests._children.items()
            if labels[3] == reason
        )

    def requests_counted(self) -> float:
        return sum(c.value for c in self.runtime.telemetry.metrics.requests._children.values())


StartListener = Callable[..., Awaitable[Running]]


@pytest.fixture
async def start_listener(upstream_url: str) -> AsyncIterator[StartListener]:
    """The proxy behind ``ProxyRunner`` on a loopback port, with the given ``server`` keys."""
    runners: list[web.AppRunner] = []

    async def start(**server: int) -> Running:
        config = make_config([upstream_url], server=server)
        access = io.StringIO()
        app = build_app(config, seed=1, access_log=access)
        runner = ProxyRunner(app, config.server, handler_cancellation=True, access_log=None)
        await runner.setup()
        runners.append(runner)
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = bound_port(site)
        assert port is not None
        runtime = app[RUNTIME]
        await wait_for(lambda: any(r.serving for r in runtime.pool.replicas))
        assert isinstance(runner.server, Listener)
        return Running(runtime, runner.server, port, access)

    yield start
    for runner in runners:
        await runner.cleanup()


async def test_a_broken_chunk_after_the_head_is_answered_400_at_once(
    start_listener: StartListener, upstream_state: Upstream
) -> None:
    """A chunked body whose chunk-size line is garbage (with a key in it), sent after the
    head was handed on: 400 bad_request "malformed HTTP request body", not a wait for
    entrance_ms (408); nothing forwarded; the key in no answer and no log."""
    proxy = await start_listener()
    key = f"sk-chunk-{secrets.token_hex(12)}"
    before = _client_requests(upstream_state)
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
    try:
        with capture_logs() as logs:
            writer.write(
                f"POST {CHAT} HTTP/1.1\r\nHost: p\r\nAuthorization: Bearer {KEY_A}\r\n"
                "Transfer-Encoding: chunked\r\n\r\n".encode()
            )
            await wait_for(lambda: bool(proxy.runtime.active))  # the entrance reads the body
            writer.write(f"ZZ{key}\r\n\r\n".encode())
            got = await _read_response(reader)
            await wait_for(lambda: not proxy.runtime.active)
    finally:
        writer.close()
    assert got.status == 400 and got.headers["X-Admission-Reason"] == "bad_request"
    assert got.json()["error"]["message"] == "malformed HTTP request body"
    assert key.encode() not in got.raw
    assert key not in repr(logs) and key not in proxy.access.getvalue()
    assert _client_requests(upstream_state) == before


@pytest.mark.parametrize("coding", ["gzip", "deflate"])
async def test_a_body_that_does_not_decode_is_answered_400_and_logged_no_error(
    start_listener: StartListener, upstream_state: Upstream, coding: str
) -> None:
    """A body labelled gzip (or deflate) that is not: 400 bad_request "malformed HTTP
    request body", nothing forwarded, and no error-level log line (the rest of the body,
    read after the answer, fails again; that used to log "server error" for each such
    client, which an operator's alert on errors would page for)."""
    proxy = await start_listener()
    before = _client_requests(upstream_state)
    body = b"not compressed at all"
    raw = (
        f"POST {CHAT} HTTP/1.1\r\nHost: p\r\nAuthorization: Bearer {KEY_A}\r\n"
        f"Content-Encoding: {coding}\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode() + body
    with capture_logs() as logs:
        got = await _exchange(proxy.port, raw)
        await wait_for(lambda: proxy.listener.open == 0)
    assert got.status == 400 and got.headers["X-Admission-Reason"] == "bad_request"
    assert got.json()["error"]["message"] == "malformed HTTP request body"
    assert [entry for entry in logs if entry["log_level"] == "error"] == []
    assert _client_requests(upstream_state) == before


@pytest.mark.parametrize(
    "request_line",
    ["OPTIONS * HTTP/1.1", "CONNECT gpu.internal:443 HTTP/1.1", "GET gpu.internal:443 HTTP/1.1"],
)
async def test_a_target_that_is_not_a_path_gets_the_proxys_400(
    start_listener: StartListener, upstream_state: Upstream, request_line: str
) -> None:
    """``OPTIONS *`` and authority-form targets match no route: the proxy's 400
    bad_request with its error body and X-Request-Id (not aiohttp's plain 404), counted
    once, and nothing reaches a replica."""
    proxy = await start_listener()
    before = _client_requests(upstream_state)
    raw = f"{request_line}\r\nHost: p\r\nX-API-Key: {KEY_A}\r\nConnection: close\r\n\r\n"
    got = await _exchange(proxy.port, raw.encode())
    assert got.status == 400 and got.headers["X-Admission-Reason"] == "bad_request"
    assert got.json()["error"]["code"] == "bad_request"
    assert REQUEST_ID.fullmatch(got.headers["X-Request-Id"])
    assert KEY_A.encode() not in got.raw
    assert _client_requests(upstream_state) == before
    await wait_for(lambda: '"reason": "bad_request"' in proxy.access.getvalue())


async def test_a_connection_that_sends_nothing_is_closed_after_header_ms(
    start_listener: StartListener,
) -> None:
    """header_ms 1000: a silent connection is closed, unanswered and uncounted, after >= 1 s."""
    proxy = await start_listener(header_ms=1000, keepalive_ms=30_000)
    started = time.monotonic()
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
    try:
        assert await _read_to_eof(reader) == b""
    finally:
        writer.close()
    assert time.monotonic() - started >= 1.0
    assert proxy.requests_counted() == 0
    await wait_for(lambda: proxy.listener.open == 0)


async def test_slowloris_headers_are_answered_408_after_header_ms(
    start_listener: StartListener, upstream_state: Upstream
) -> None:
    """A header line every 0.25 s does not extend header_ms 2000: 408 entrance_timeout at
    >= 2 s, the error body, Connection: close, then the connection ends; nothing forwarded.

    The client stops trickling at 1.5 s: a line sent after the proxy has closed would be
    answered by the kernel with a reset that can discard the 408 before it is read. Had
    the trickle restarted the clock, the answer would come at 3.5 s at the earliest."""
    header_ms = 2000
    proxy = await start_listener(header_ms=header_ms)
    before = _client_requests(upstream_state)
    started = time.monotonic()
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
    answer = asyncio.ensure_future(_read_to_eof(reader))
    try:
        writer.write(f"POST {CHAT} HTTP/1.1\r\nHost: p\r\nX-API-Key: {KEY_A}\r\n".encode())
        for i in range(6):  # a line at 0.25 s, 0.5 s, ... 1.5 s
            await asyncio.sleep(0.25)
            if answer.done():
                break
            writer.write(f"X-Pad-{i}: {'x' * 10}\r\n".encode())
            await writer.drain()
        raw = await answer
    finally:
        writer.close()
    elapsed = time.monotonic() - started
    got = _parse(raw)
    assert got.status == 408
    assert got.headers["X-Admission-Reason"] == "entrance_timeout"
    assert got.headers["Connection"] == "close"
    assert REQUEST_ID.fullmatch(got.headers["X-Request-Id"])
    assert got.json()["error"] == {
        "message": f"request headers not received within {header_ms} ms",
        "type": "admission_error",
        "code": "entrance_timeout",
    }
    assert KEY_A.encode() not in raw
    assert elapsed >= header_ms / 1000
    assert _client_requests(upstream_state) == before
    assert proxy.requests_total("entrance_timeout") == 1
    line = json.loads(proxy.access.getvalue().splitlines()[-1])
    assert (line["status"], line["reason"], line["tenant"], line["method"], line["path"]) == (
        408, "entrance_timeout", "unknown", "-", "-",
    )  # fmt: skip
    # Timed from the connection's start, not from the last line (that would be >= 3500).
    assert header_ms <= line["total_ms"] < 3500


async def test_a_partial_request_line_is_answered_408_and_closed(
    start_listener: StartListener,
) -> None:
    """Half a request line, then nothing: 408 entrance_timeout after header_ms, then closed."""
    proxy = await start_listener(header_ms=1000)
    started = time.monotonic()
    got = await _exchange(proxy.port, b"GET /v1/chat/comp")
    assert got.status == 408 and got.headers["X-Admission-Reason"] == "entrance_timeout"
    assert got.headers["Connection"] == "close"
    assert time.monotonic() - started >= 1.0
    await wait_for(lambda: proxy.listener.open == 0)


async def test_an_idle_kept_alive_connection_is_closed_after_keepalive_ms(
    start_listener: StartListener,
) -> None:
    """Two requests on one connection (the second's head in two reads) are served; then,
    idle, the connection lives keepalive_ms (2000), not header_ms (500)."""
    proxy = await start_listener(header_ms=500, keepalive_ms=2000)
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
    try:
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: p\r\n\r\n")
        assert (await _read_response(reader)).status == 200
        writer.write(b"GET /healthz HTTP/1.1\r\n")
        await writer.drain()
        await asyncio.sleep(0.1)
        writer.write(b"Host: p\r\n\r\n")
        got = await _read_response(reader)
        idle_since = time.monotonic()
        assert got.status == 200 and got.headers.get("Connection") != "close"
        assert await _read_to_eof(reader) == b""
    finally:
        writer.close()
    assert time.monotonic() - idle_since >= 2.0
    assert proxy.requests_counted() == 0  # reserved paths; nothing answered by the listener


async def test_the_next_request_on_a_kept_alive_connection_has_its_own_header_clock(
    start_listener: StartListener,
) -> None:
    """keepalive_ms 500, header_ms 1500: a second head started at once but left partial is
    answered 408 at >= 1.5 s from its first byte, not dropped by the keep-alive timer."""
    proxy = await start_listener(header_ms=1500, keepalive_ms=500)
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
    try:
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: p\r\n\r\n")
        assert (await _read_response(reader)).status == 200
        first_byte = time.monotonic()
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: p\r\n")
        got = _parse(await _read_to_eof(reader))
    finally:
        writer.close()
    assert got.status == 408 and got.headers["X-Admission-Reason"] == "entrance_timeout"
    assert time.monotonic() - first_byte >= 1.5


async def test_a_connection_beyond_max_connections_gets_503_until_one_is_freed(
    start_listener: StartListener, upstream_state: Upstream
) -> None:
    """max_connections 50: with 50 open, the 51st is answered 503 overloaded_connections
    (error body, Retry-After, Connection: close), its request not forwarded; once one of
    the 50 closes, a new connection is served."""
    proxy = await start_listener(header_ms=60_000, max_connections=50)
    held = [await asyncio.open_connection("127.0.0.1", proxy.port) for _ in range(50)]
    try:
        await wait_for(lambda: proxy.listener.open == 50)
        assert repr(proxy.listener) == "<Listener 50 open, at most 50>"
        before = _client_requests(upstream_state)
        got = await _exchange(proxy.port, _chat_request(KEY_A, request_id="client-id-1"))
        assert got.status == 503
        assert got.headers["X-Admission-Reason"] == "overloaded_connections"
        assert got.headers["Connection"] == "close"
        assert got.headers["Retry-After"] == "1"
        assert got.headers["X-Request-Id"] == "client-id-1"
        assert got.json()["error"]["code"] == "overloaded_connections"
        assert got.json()["error"]["type"] == "admission_error"
        assert _client_requests(upstream_state) == before
        assert proxy.requests_total("overloaded_connections") == 1

        held.pop()[1].close()
        await wait_for(lambda: proxy.listener.open == 49)
        served = await _exchange(proxy.port, _chat_request(KEY_A, version="1.0"))
        assert served.status == 200
        assert _client_requests(upstream_state) == before + 1
    finally:
        for _, writer in held:
            writer.close()


def _raise_open_files(needed: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft >= needed:
        return
    if hard != resource.RLIM_INFINITY and hard < needed:
        pytest.skip(f"needs {needed} open files; the hard limit is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))


async def test_a_request_is_served_while_1000_idle_sockets_are_open(
    start_listener: StartListener,
) -> None:
    """1,000 idle client sockets (both ends in this process) do not keep a request out."""
    _raise_open_files(4096)
    proxy = await start_listener(header_ms=60_000)
    held = []
    try:
        for _ in range(1000):
            held.append(await asyncio.open_connection("127.0.0.1", proxy.port))
        await wait_for(lambda: proxy.listener.open == 1000, timeout_s=20)
        async with aiohttp.ClientSession() as session:
            response = await session.post(
                f"http://127.0.0.1:{proxy.port}{CHAT}",
                json={"max_tokens": 2},
                headers={"Authorization": f"Bearer {KEY_A}"},
            )
            assert response.status == 200
            assert (await response.json())["object"] == "chat.completion"
    finally:
        for _, writer in held:
            writer.close()


def test_listener_keys_default_to_documented_values() -> None:
    server = make_config(["http://127.0.0.1:9"]).server
    assert (server.header_ms, server.keepalive_ms, server.max_connections) == (5000, 15000, 4096)


@pytest.mark.parametrize("key", ["header_ms", "keepalive_ms", "max_connections"])
@pytest.mark.parametrize("value", [0, -1, 1.5, "many"])
def test_listener_keys_must_be_positive_integers(key: str, value: object) -> None:
    """Refused at load with the key's YAML path, like every other config mistake."""
    with pytest.raises(ConfigError) as caught:
        make_config(["http://127.0.0.1:9"], server={key: value})
    assert [issue.path for issue in caught.value.issues] == [f"server.{key}"]


async def test_a_reload_that_changes_listener_limits_says_it_needs_a_restart(
    tmp_path: Path,
) -> None:
    """The listener reads its limits once: a reload applies the rest, keeps the running
    limits (so /admin/config shows what is in effect) and logs which keys wait."""
    path = tmp_path / "proxy.yaml"
    document = {
        "replicas": [{"name": "r0", "url": "http://127.0.0.1:9", "max_concurrency": 1}],
        "tenants": {"a": {"api_keys": ["sk-a"]}},
    }
    path.write_text(yaml.safe_dump(document))
    runtime = build_runtime(load_config(path), access_log=False)
    reloader = Reloader(runtime, path)
    changed = {**document, "server": {"header_ms": 2000, "max_connections": 10}}
    changed["tenants"] = {"a": {"api_keys": ["sk-a"], "weight": 3}}
    path.write_text(yaml.safe_dump(changed))
    with capture_logs() as logs:
        assert (await reloader.reload("test")).ok
    warned = [e["key"] for e in logs if e["event"].startswith("setting changed")]
    assert warned == ["server.header_ms", "server.max_connections"]
    assert runtime.rules.config.server.header_ms == DEFAULT_HEADER_MS
    assert runtime.rules.config.tenants["a"].weight == 3
