"""``serve --workers N``: N processes on one port, signals passed on, refused without Redis."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from functools import partial
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from proxy.workers import _end_with_parent
from tests.fleet import CLI, start_serve, write_config
from tests.helpers import KEY_A
from tests.redis_server import RedisServer
from tests.upstreams import Upstream

CHAT = "/v1/chat/completions"
AUTH = {"Authorization": f"Bearer {KEY_A}"}
BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def _config(upstream_url: str, **sections: Any) -> dict[str, Any]:
    return {
        "replicas": [{"name": "r0", "url": upstream_url, "max_concurrency": 4}],
        "tenants": {"a": {"api_keys": [KEY_A]}},
        "server": {"shutdown_grace_ms": 2000},
        **sections,
    }


@pytest.mark.parametrize("command", ["check-config", "serve"])
async def test_several_workers_without_redis_are_refused(tmp_path: Path, command: str) -> None:
    """--workers 2 with state.backend local: exit 2, and the message says Redis is needed."""
    path = write_config(tmp_path / "c.yaml", _config("http://127.0.0.1:9"))
    args = [str(path)] if command == "check-config" else ["--config", str(path), "--port", "0"]
    proc = await asyncio.create_subprocess_exec(
        *CLI, command, *args, "--workers", "2",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    async with asyncio.timeout(20):
        out, err = await proc.communicate()
    assert proc.returncode == 2
    assert b"--workers 2 needs state.backend: redis" in err, err
    assert out == b""


async def test_check_config_accepts_several_workers_with_redis(tmp_path: Path) -> None:
    """--workers 3 with state.backend redis passes check-config."""
    config = _config("http://127.0.0.1:9", state={"backend": "redis"})
    path = write_config(tmp_path / "c.yaml", config)
    proc = await asyncio.create_subprocess_exec(
        *CLI, "check-config", str(path), "--workers", "3", stdout=asyncio.subprocess.PIPE
    )
    async with asyncio.timeout(20):
        await proc.communicate()
    assert proc.returncode == 0


@pytest.mark.redis
async def test_workers_share_one_port_and_stop_on_sigterm(
    tmp_path: Path, upstream_url: str, redis_server: RedisServer
) -> None:
    """Two workers listen on one port (two pids), both answer, SIGTERM to the parent stops both."""
    config = _config(upstream_url, state={"backend": "redis", "redis_url": redis_server.url})
    proxy = await start_serve(write_config(tmp_path / "c.yaml", config), workers=2)
    try:
        lines = proxy.listening()
        assert len({line["pid"] for line in lines}) == 2
        assert {line["port"] for line in lines} == {proxy.port}
        async with aiohttp.ClientSession() as session:
            for _ in range(8):
                async with session.post(proxy.url + CHAT, json=BODY, headers=AUTH) as resp:
                    assert resp.status == 200
    finally:
        code = await proxy.stop()
    assert code == 0
    for line in lines:
        with pytest.raises(ProcessLookupError):
            os.kill(line["pid"], 0)


@pytest.mark.redis
async def test_a_worker_that_dies_is_started_again(
    tmp_path: Path, upstream_url: str, redis_server: RedisServer
) -> None:
    """SIGKILL of one worker: the parent starts another on the same port; SIGTERM ends all."""
    config = _config(upstream_url, state={"backend": "redis", "redis_url": redis_server.url})
    proxy = await start_serve(write_config(tmp_path / "c.yaml", config), workers=2)
    try:
        victim = proxy.listening()[0]["pid"]
        os.kill(victim, signal.SIGKILL)
        await proxy.wait_listening(3)
        third = proxy.listening()[2]
        assert third["port"] == proxy.port and third["pid"] != victim
        assert proxy.named("worker exited")[0]["pid"] == victim
    finally:
        assert await proxy.stop() == 0


async def test_a_reload_leaves_the_state_section_for_a_restart(
    start_proxy: Any, upstream_url: str, tmp_path: Path
) -> None:
    """The shared state is built once: a reload changing state.* logs it as needing a
    restart and keeps the running value."""
    from structlog.testing import capture_logs

    from proxy.settings import load_config
    from tests.test_control import _document, _reload, _write

    path = tmp_path / "proxy.yaml"
    document = _document(upstream_url, weight=1)
    _write(path, document)
    proxy = await start_proxy(load_config(path), config_path=str(path))
    with capture_logs() as logs:
        await _reload(proxy, path, {**document, "state": {"lease_ms": 3000}})
    restart = {e["key"]: (e["running"], e["configured"]) for e in logs if "key" in e}
    assert restart == {"state.lease_ms": (10_000, 3000)}
    assert proxy.runtime.rules.config.state.lease_ms == 10_000


@pytest.mark.redis
async def test_workers_started_with_redis_down_share_the_seats(
    tmp_path: Path, upstream_url: str, upstream_state: Upstream, redis_server: RedisServer
) -> None:
    """Redis down from the start (local_share): each of 2 workers takes half of r0's 2
    seats, not all of them (before: each divided by the 1 instance it had seen, and the
    engine got up to 4 requests at once). Sampled at the upstream while 8 requests,
    spread over the workers by fresh connections, hold their seats."""
    redis_server.stop()
    config = _config(upstream_url, state={"backend": "redis", "redis_url": redis_server.url})
    config["replicas"][0]["max_concurrency"] = 2
    config["budgets"] = {"queue_ms": 30_000, "first_byte_ms": 30_000, "total_ms": 60_000}
    config["tenants"]["a"]["queue_capacity"] = 16
    proxy = await start_serve(write_config(tmp_path / "c.yaml", config), workers=2)
    body = {**BODY, "hang_ms": 300}
    peak = 0

    async def one() -> int:
        connector = aiohttp.TCPConnector(force_close=True)
        async with (
            aiohttp.ClientSession(connector=connector) as session,
            session.post(proxy.url + CHAT, json=body, headers=AUTH) as resp,
        ):
            await resp.read()
            return resp.status

    try:
        calls = [asyncio.create_task(one()) for _ in range(8)]
        async with asyncio.timeout(60):
            while not all(call.done() for call in calls):
                peak = max(peak, upstream_state.active)
                await asyncio.sleep(0.005)
        assert [call.result() for call in calls] == [200] * 8
        assert 1 <= peak <= 2
    finally:
        assert await proxy.stop() == 0


def _gone(pid: int) -> bool:
    """The process exited (a zombie not reaped yet counts as exited)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


@pytest.mark.redis
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
async def test_workers_end_when_the_parent_is_killed(
    tmp_path: Path, upstream_url: str, redis_server: RedisServer
) -> None:
    """SIGKILL of the parent: its workers get SIGTERM from the kernel and exit (before:
    they kept serving on the port, unsupervised, next to a parent started again)."""
    config = _config(upstream_url, state={"backend": "redis", "redis_url": redis_server.url})
    proxy = await start_serve(write_config(tmp_path / "c.yaml", config), workers=2)
    workers = [int(line["pid"]) for line in proxy.listening()]
    try:
        proxy.proc.kill()
        async with asyncio.timeout(30):
            while not all(_gone(pid) for pid in workers):
                await asyncio.sleep(0.05)
        assert len(proxy.named("shutdown requested")) == 2
    finally:
        for pid in workers:
            if not _gone(pid):
                os.kill(pid, signal.SIGKILL)
        await proxy.stop()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_worker_whose_parent_died_before_it_ran_is_ended() -> None:
    # The supervisor installs its SIGTERM handler before spawning, and a forked child
    # keeps it until exec: the SIGTERM sent for a parent already gone (and a parent
    # death signal arriving before exec) was caught by that copy and the worker ran.
    caught: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: caught.append(signum))
    try:
        gone = partial(_end_with_parent, os.getppid())  # never the child's parent
        child = subprocess.Popen([sys.executable, "-c", "pass"], preexec_fn=gone)
        code = child.wait(timeout=60)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert code == -signal.SIGTERM
    assert caught == []
