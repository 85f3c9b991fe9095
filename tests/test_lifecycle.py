"""The proxy as a process: the CLI, and graceful shutdown on SIGTERM."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path

import aiohttp
import yaml

from tests.helpers import KEY_A

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
