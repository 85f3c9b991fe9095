"""TLS to replicas: a real https upstream whose certificates the test issues (trustme).

The upstream is a small aiohttp app served over TLS on an OS-chosen loopback
port, its certificate signed by a private CA made here; for mutual TLS it
demands a client certificate from the same CA and records who presented one.
"""

from __future__ import annotations

import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import trustme
import yaml
from aiohttp import web
from aiohttp.test_utils import TestServer

from proxy.settings import ConfigError, load_config, parse_config
from tests.conftest import ProxyUnderTest
from tests.helpers import KEY_A, make_config, wait_for

Start = Callable[..., Awaitable[ProxyUnderTest]]
ServerFactory = Callable[..., Awaitable[TestServer]]
CHAT = "/v1/chat/completions"
AUTH = {"Authorization": f"Bearer {KEY_A}"}
CLIENT_NAME = "proxy.client.test"


@dataclass
class Seen:
    """What the TLS upstream received, by path, and the client names it was shown."""

    paths: list[str] = field(default_factory=list)
    client_names: list[str] = field(default_factory=list)


SEEN = web.AppKey("seen", Seen)


async def _answer(request: web.Request) -> web.Response:
    seen = request.app[SEEN]
    seen.paths.append(request.path)
    peer = request.transport.get_extra_info("peercert") if request.transport else None
    if peer:
        seen.client_names += [value for kind, value in peer.get("subjectAltName", ())]
    await request.read()
    if request.path == "/v1/models":
        return web.json_response({"data": [{"id": "tls-model"}]})
    if request.path == "/metrics":
        return web.Response(text="vllm:num_requests_waiting 0\nvllm:kv_cache_usage_perc 0.1\n")
    return web.json_response({"choices": [{"text": "ok"}], "path": request.path})


def _tls_app() -> web.Application:
    app = web.Application()
    app[SEEN] = Seen()
    app.router.add_route("*", "/{tail:.*}", _answer)
    return app


def _server_context(ca: trustme.CA, *, require_client_cert: bool) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1", "localhost").configure_cert(context)
    if require_client_cert:
        ca.configure_trust(context)
        context.verify_mode = ssl.CERT_REQUIRED
    return context


@dataclass
class TlsFiles:
    ca: Path
    cert: Path
    key: Path


@pytest.fixture
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture
def files(ca: trustme.CA, tmp_path: Path) -> TlsFiles:
    """The private CA's bundle and a client certificate it signed, as PEM files."""
    client = ca.issue_cert(CLIENT_NAME)
    out = TlsFiles(tmp_path / "ca.pem", tmp_path / "client.pem", tmp_path / "client.key")
    ca.cert_pem.write_to_path(str(out.ca))
    for i, pem in enumerate(client.cert_chain_pems):
        pem.write_to_path(str(out.cert), append=i > 0)
    client.private_key_pem.write_to_path(str(out.key))
    return out


async def _serve(
    aiohttp_server: ServerFactory, ca: trustme.CA, *, require_client_cert: bool = False
) -> TestServer:
    context = _server_context(ca, require_client_cert=require_client_cert)
    return await aiohttp_server(_tls_app(), ssl=context)


def _url(server: TestServer) -> str:
    url = str(server.make_url("")).rstrip("/")
    assert url.startswith("https://")
    return url


def _replica(url: str, **tls: object) -> dict[str, Any]:
    return {"name": "r0", "url": url, "max_concurrency": 2, "metrics_url": url + "/metrics", **tls}


async def test_private_ca_without_ca_file_fails_verification_clearly(
    aiohttp_server: ServerFactory, ca: trustme.CA, start_proxy: Start
) -> None:
    """No ca_file: the system store does not know the private CA, so a request gets
    502 upstream_connect_error saying the certificate failed verification."""
    server = await _serve(aiohttp_server, ca)
    config = make_config(
        [], replicas=[_replica(_url(server))], warmup={"requests": 0},
        health={"interval_ms": 60_000},
    )  # fmt: skip
    proxy = await start_proxy(config)
    resp = await proxy.client.post(CHAT, json={}, headers=AUTH)
    assert resp.status == 502
    assert resp.headers["X-Admission-Reason"] == "upstream_connect_error"
    message = (await resp.json())["error"]["message"]
    assert "TLS certificate verification failed" in message, message
    assert server.app[SEEN].paths == []
    proxy.assert_idle()


async def test_private_ca_failure_shows_in_readyz_and_admin_state(
    aiohttp_server: ServerFactory, ca: trustme.CA, start_proxy: Start
) -> None:
    """No ca_file, warm-up on: the replica never comes up; /readyz lists it as starting
    and /admin/state says why (certificate verification)."""
    server = await _serve(aiohttp_server, ca)
    config = make_config([], replicas=[_replica(_url(server))], health={"interval_ms": 50})
    proxy = await start_proxy(config, ready=False)
    r0 = proxy.runtime.pool.replicas[0]
    await wait_for(lambda: r0.starting and r0.probe_error is not None and not r0.warming)
    ready = await proxy.client.get("/readyz")
    assert ready.status == 503
    assert (await ready.json())["starting"] == ["r0"]
    state = (await (await proxy.client.get("/admin/state")).json())["replicas"]["r0"]
    assert state["starting"] is True
    assert "TLS certificate verification failed" in state["probe_error"]
    assert server.app[SEEN].paths == []


async def test_private_ca_with_ca_file_serves_and_is_healthy(
    aiohttp_server: ServerFactory, ca: trustme.CA, files: TlsFiles, start_proxy: Start
) -> None:
    """ca_file set: warm-up, probes, metrics scrapes and requests all verify against
    the private CA; the replica is healthy and the request goes through."""
    server = await _serve(aiohttp_server, ca)
    replica = _replica(_url(server), ca_file=str(files.ca))
    config = make_config([], replicas=[replica], health={"interval_ms": 50})
    proxy = await start_proxy(config)
    r0 = proxy.runtime.pool.replicas[0]
    resp = await proxy.client.post(CHAT, json={}, headers=AUTH)
    assert resp.status == 200, await resp.text()
    assert (await resp.json())["path"] == CHAT
    seen = server.app[SEEN].paths
    await wait_for(lambda: "/health" in seen and "/metrics" in seen)
    assert "/v1/completions" in seen  # the warm-up
    assert r0.healthy_once and not r0.starting and r0.probe_error is None
    assert proxy.runtime.health.engine_reading("r0") is not None
    assert (await proxy.client.get("/readyz")).status == 200
    proxy.assert_idle()


async def test_mutual_tls_needs_the_client_certificate(
    aiohttp_server: ServerFactory, ca: trustme.CA, files: TlsFiles, start_proxy: Start
) -> None:
    """A replica that requires a client certificate: without cert_file/key_file the
    proxy's requests are refused (502); with them they pass and the replica sees
    the proxy's certificate."""
    server = await _serve(aiohttp_server, ca, require_client_cert=True)
    url = _url(server)
    without = make_config(
        [], replicas=[_replica(url, ca_file=str(files.ca))], warmup={"requests": 0},
        health={"interval_ms": 60_000},
    )  # fmt: skip
    proxy = await start_proxy(without)
    resp = await proxy.client.post(CHAT, json={}, headers=AUTH)
    assert resp.status == 502
    assert server.app[SEEN].paths == []
    assert server.app[SEEN].client_names == []

    tls = {"ca_file": str(files.ca), "cert_file": str(files.cert), "key_file": str(files.key)}
    config = make_config([], replicas=[_replica(url, **tls)], health={"interval_ms": 50})
    proxy = await start_proxy(config)
    resp = await proxy.client.post(CHAT, json={}, headers=AUTH)
    assert resp.status == 200, await resp.text()
    assert CHAT in server.app[SEEN].paths
    assert CLIENT_NAME in server.app[SEEN].client_names
    proxy.assert_idle()


async def test_reload_reads_changed_tls_files(
    aiohttp_server: ServerFactory, files: TlsFiles, start_proxy: Start, tmp_path: Path
) -> None:
    """ca_file holds the wrong CA: the replica stays starting. The right CA written to
    the same path and a reload give it a new context: it comes up and serves."""
    right = trustme.CA()
    server = await _serve(aiohttp_server, right)
    path = tmp_path / "proxy.yaml"
    document = {
        "replicas": [_replica(_url(server), ca_file=str(files.ca))],
        "tenants": {"a": {"api_keys": [KEY_A]}},
        "health": {"interval_ms": 50},
    }
    path.write_text(yaml.safe_dump(document))
    proxy = await start_proxy(load_config(path), ready=False, config_path=str(path))
    r0 = proxy.runtime.pool.replicas[0]
    await wait_for(lambda: r0.starting and not r0.warming)
    before = r0.ssl

    reloaded = await proxy.client.post("/admin/reload")
    assert (await reloaded.json())["result"] == "ok"
    assert r0.ssl is before, "unchanged files keep the context (and pooled connections)"

    right.cert_pem.write_to_path(str(files.ca))
    reloaded = await proxy.client.post("/admin/reload")
    assert (await reloaded.json())["result"] == "ok"
    assert r0.ssl is not before
    await wait_for(lambda: r0.serving)
    assert (await proxy.client.post(CHAT, json={}, headers=AUTH)).status == 200
    proxy.assert_idle()


def _config_issues(replica: dict[str, Any]) -> dict[str, str]:
    document = {"replicas": [replica], "tenants": {"a": {"api_keys": [KEY_A]}}}
    with pytest.raises(ConfigError) as caught:
        parse_config(yaml.safe_dump(document))
    return {issue.path: issue.message for issue in caught.value.issues}


def test_tls_files_are_checked_at_validation(files: TlsFiles, tmp_path: Path) -> None:
    """Missing, unreadable or unpaired TLS files, or TLS keys on an http replica, are
    refused when the config is validated, each at its YAML path."""
    https = "https://127.0.0.1:8443"
    missing = str(tmp_path / "nope.pem")
    issues = _config_issues(_replica(https, ca_file=missing))
    assert "No such file" in issues["replicas[0].ca_file"]

    not_pem = tmp_path / "garbage.pem"
    not_pem.write_text("not a certificate\n")
    issues = _config_issues(_replica(https, ca_file=str(not_pem)))
    assert "cannot load CA bundle" in issues["replicas[0].ca_file"]

    issues = _config_issues(_replica(https, cert_file=str(files.cert)))
    assert "required with cert_file" in issues["replicas[0].key_file"]

    issues = _config_issues(_replica(https, cert_file=str(files.cert), key_file=str(files.ca)))
    assert "cannot load client certificate" in issues["replicas[0].cert_file"]

    http = {"name": "r0", "url": "http://127.0.0.1:8000", "max_concurrency": 2}
    issues = _config_issues({**http, "ca_file": str(files.ca)})
    assert "https" in issues["replicas[0].ca_file"]

    good = {"ca_file": str(files.ca), "cert_file": str(files.cert), "key_file": str(files.key)}
    document = {"replicas": [_replica(https, **good)], "tenants": {"a": {"api_keys": [KEY_A]}}}
    assert parse_config(yaml.safe_dump(document)).replicas[0].cert_file == str(files.cert)


async def test_https_to_a_plain_http_port_is_a_clear_handshake_failure(
    upstream_url: str, files: TlsFiles, start_proxy: Start
) -> None:
    """An https:// url whose port speaks plain HTTP: 502 upstream_connect_error saying
    the TLS handshake failed, not a bare connection error."""
    url = upstream_url.replace("http://", "https://")
    config = make_config(
        [], replicas=[_replica(url, ca_file=str(files.ca))], warmup={"requests": 0},
        health={"interval_ms": 60_000},
    )  # fmt: skip
    proxy = await start_proxy(config)
    resp = await proxy.client.post(CHAT, json={}, headers=AUTH)
    assert resp.status == 502
    assert resp.headers["X-Admission-Reason"] == "upstream_connect_error"
    message = (await resp.json())["error"]["message"]
    assert "TLS handshake failed" in message, message
    proxy.assert_idle()
