"""The proxy as a process: the CLI, graceful shutdown on SIGTERM, reload on SIGHUP."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from proxy.app import build_app
from proxy.reload import RELOADER
from proxy.runtime import RUNTIME
from tests.helpers import KEY_A, make_config
from tests.test_control import samples

CHAT = "/v1/chat/completions"
AUTH = {"Authorization": f"Bearer {KEY_A}"}
CLI = [sys.executable, "-m", "proxy"]


async def _start_proxy(config_path: Path) -> tuple[asyncio.subprocess.Process, str]:
    """``python -m proxy serve --port 0``; the port is read from the 'listening' log line."""
    proc = await asyncio.create_subprocess_exec(
        *CLI, "serve", "--config", str(config_path), "--host", "127.0.0.1", "--port", "0",
        stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdout is not None
    async with asyncio.timeout(15):
        while True:
            line = await proc.stdout.readline()
            assert line, "proxy exited before listening"
            event = json.loads(line)
            if event.get("event") == "listening":
                return proc, f"http://127.0.0.1:{event['port']}"


async def _read_events(proc: asyncio.subprocess.Process, events: list[dict[str, Any]]) -> None:
    """Collect the process's JSON log lines until it closes stdout (keeps the pipe drained)."""
    assert proc.stdout is not None
    while line := await proc.stdout.readline():
        events.append(json.loads(line))


def _write_config(path: Path, upstream_url: str, **sections: Any) -> None:
    config = {
        "replicas": [{"name": "r0", "url": upstream_url, "max_concurrency": 2}],
        "tenants": {"a": {"api_keys": [KEY_A]}},
        **sections,
    }
    path.write_text(yaml.safe_dump(config))


#: A stream the fake upstream keeps open for hours: one token every 100 ms.
ENDLESS = {"stream": True, "max_tokens": 1_000_000, "gap_ms": 100}


async def _open_endless_stream(session: aiohttp.ClientSession, url: str) -> aiohttp.ClientResponse:
    stream = await session.post(url + CHAT, json=ENDLESS, headers=AUTH)
    assert stream.status == 200
    await stream.content.readuntil(b"tok0 ")  # tokens are flowing through the proxy
    return stream


async def _until_not_ready(session: aiohttp.ClientSession, url: str) -> None:
    """The first signal has been handled: /readyz answers 503."""
    async with asyncio.timeout(5):
        while (await session.get(url + "/readyz")).status != 503:
            await asyncio.sleep(0.01)


async def _until_queued(session: aiohttp.ClientSession, url: str, depth: int) -> None:
    """Poll /admin/state (loopback needs no token) until tenant a has ``depth`` queued."""
    async with asyncio.timeout(5):
        while True:
            state = await (await session.get(url + "/admin/state")).json()
            if state["tenants"]["a"]["queued"] == depth:
                return
            await asyncio.sleep(0.01)


async def test_sigterm_drains_in_flight_and_refuses_the_queue(
    tmp_path: Path, upstream_url: str
) -> None:
    """SIGTERM: /readyz 503 at once, queued and new requests 503 shutting_down, the stream
    in flight finishes, and the process exits 0 within the grace period."""
    config = {
        "replicas": [{"name": "r0", "url": upstream_url, "max_concurrency": 1}],
        "server": {"shutdown_grace_ms": 5000},
        "tenants": {"a": {"api_keys": [KEY_A], "queue_capacity": 4}},
    }
    path = tmp_path / "proxy.yaml"
    path.write_text(yaml.safe_dump(config))
    proc, url = await _start_proxy(path)
    try:
        async with aiohttp.ClientSession() as session:
            stream = await session.post(
                url + CHAT,
                json={"stream": True, "max_tokens": 10, "gap_ms": 100},
                headers=AUTH,
            )
            assert stream.status == 200
            queued = asyncio.ensure_future(session.post(url + CHAT, json={}, headers=AUTH))
            await _until_queued(session, url, 1)
            proc.send_signal(signal.SIGTERM)
            async with asyncio.timeout(5):
                while (await session.get(url + "/readyz")).status != 503:
                    await asyncio.sleep(0.01)
            refused = await queued
            assert refused.status == 503
            assert refused.headers["X-Admission-Reason"] == "shutting_down"
            assert refused.headers["Retry-After"] == "1"
            late = await session.post(url + CHAT, json={}, headers=AUTH)
            assert late.status == 503 and late.headers["Connection"] == "close"
            body = await stream.read()
            assert body.endswith(b"data: [DONE]\n\n")
        assert await asyncio.wait_for(proc.wait(), timeout=10) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_sigterm_ends_within_the_grace_when_a_stream_stays_open(
    tmp_path: Path, upstream_url: str
) -> None:
    """A stream that would run for hours: SIGTERM waits the whole grace period, then the
    stream is cut (logged as failed/shutting_down, not as a client that left) and the
    process exits 0 (within the grace plus a hang guard, not 60 s)."""
    grace_s = 1.5
    path = tmp_path / "proxy.yaml"
    _write_config(path, upstream_url, server={"shutdown_grace_ms": int(grace_s * 1000)})
    proc, url = await _start_proxy(path)
    events: list[dict[str, Any]] = []
    reader = asyncio.ensure_future(_read_events(proc, events))
    try:
        async with aiohttp.ClientSession() as session:
            stream = await _open_endless_stream(session, url)
            signalled = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(proc.wait(), timeout=grace_s + 5) == 0
            took = time.monotonic() - signalled
            assert took >= grace_s
            with contextlib.suppress(aiohttp.ClientPayloadError):
                await asyncio.wait_for(stream.read(), timeout=5)  # ends: the proxy is gone
        await asyncio.wait_for(reader, timeout=5)
        assert any(e["event"] == "grace period over" for e in events), events
        cut = [e for e in events if e.get("path") == CHAT]
        # The proxy cut it, not the client: failed with reason shutting_down, status as sent.
        assert len(cut) == 1, cut
        assert (cut[0]["outcome"], cut[0]["reason"], cut[0]["status"]) == (
            "failed",
            "shutting_down",
            200,
        ), cut
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        reader.cancel()


@pytest.mark.parametrize("second", [signal.SIGTERM, signal.SIGINT])
async def test_a_second_signal_exits_at_once(
    tmp_path: Path, upstream_url: str, second: signal.Signals
) -> None:
    """SIGTERM starts a 60 s grace with a stream open; a second SIGTERM or SIGINT ends the
    process at once with exit status 1 (well before the grace)."""
    path = tmp_path / "proxy.yaml"
    _write_config(path, upstream_url, server={"shutdown_grace_ms": 60_000})
    proc, url = await _start_proxy(path)
    reader = asyncio.ensure_future(_read_events(proc, []))
    try:
        async with aiohttp.ClientSession() as session:
            await _open_endless_stream(session, url)
            proc.send_signal(signal.SIGTERM)
            await _until_not_ready(session, url)
            proc.send_signal(second)
            assert await asyncio.wait_for(proc.wait(), timeout=10) == 1
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        reader.cancel()


async def test_sighup_reloads_the_config_file(tmp_path: Path, upstream_url: str) -> None:
    """SIGHUP after the file changed: the new tenant's key is accepted at once and the
    reload is counted as ok (one count per 'config reloaded' line, one of them SIGHUP's)."""
    path = tmp_path / "proxy.yaml"
    _write_config(path, upstream_url)
    proc, url = await _start_proxy(path)
    events: list[dict[str, Any]] = []
    reader = asyncio.ensure_future(_read_events(proc, events))
    new_key = {"Authorization": "Bearer sk-added-by-sighup"}
    try:
        async with aiohttp.ClientSession() as session:
            assert (await session.post(url + CHAT, json={}, headers=new_key)).status == 401
            tenants = {"a": {"api_keys": [KEY_A]}, "c": {"api_keys": ["sk-added-by-sighup"]}}
            _write_config(path, upstream_url, tenants=tenants)
            proc.send_signal(signal.SIGHUP)
            async with asyncio.timeout(10):
                while not any(e.get("trigger") == "sighup" for e in events):
                    await asyncio.sleep(0.01)
            assert (await session.post(url + CHAT, json={}, headers=new_key)).status == 200
            text = await (await session.get(url + "/metrics")).text()
            reloaded = [e for e in events if e["event"] == "config reloaded"]
            assert samples(text, "admission_config_reloads_total")[(("result", "ok"),)] == len(
                reloaded
            )
            proc.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(proc.wait(), timeout=10) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        reader.cancel()


async def test_check_config_cli(tmp_path: Path) -> None:
    """check-config: exit 0 with the effective config, exit 2 with every error's path."""
    good = await asyncio.create_subprocess_exec(
        *CLI, "check-config", "config/example.yaml", stdout=asyncio.subprocess.PIPE
    )
    out, _ = await good.communicate()
    assert good.returncode == 0
    assert yaml.safe_load(out)["retry"]["jitter"] == "full"
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "replicas:\n  - name: r\n    url: ftp://x\n    max_concurrency: 0\ntenants: {}\n"
    )
    proc = await asyncio.create_subprocess_exec(
        *CLI, "check-config", str(bad), stderr=asyncio.subprocess.PIPE
    )
    _, err = await proc.communicate()
    assert proc.returncode == 2
    text = err.decode()
    for path in ("replicas[0].url", "replicas[0].max_concurrency", "tenants"):
        assert f"\n{path}:" in text, text


async def test_serve_refuses_an_invalid_config(tmp_path: Path) -> None:
    """serve with an invalid config exits 2 and names the field."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("replicas: []\ntenants: {a: {api_keys: [k]}}\n")
    proc = await asyncio.create_subprocess_exec(
        *CLI, "serve", "--config", str(bad), stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "ADMISSION_SERVER__PORT": "0"},
    )  # fmt: skip
    _, err = await proc.communicate()
    assert proc.returncode == 2
    assert b"replicas:" in err


def test_the_runtime_is_built_whole_and_frozen() -> None:
    """Every part exists before start (the GPU sampler too, no reloader without a
    file), and nothing outside the runtime can replace one afterwards."""
    app = build_app(make_config(["http://127.0.0.1:9"]), access_log=False)
    runtime = app[RUNTIME]
    assert app[RELOADER] is None
    assert runtime.gpu.snapshot == {}
    with pytest.raises(dataclasses.FrozenInstanceError):
        runtime.shutting_down = True  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        runtime.gpu = runtime.gpu  # type: ignore[misc]
    runtime.begin_shutdown()
    assert runtime.shutting_down
