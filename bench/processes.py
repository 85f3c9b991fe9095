"""Benchmark servers as child processes: start, find, wait until ready, measure CPU, stop.

The one process harness of every benchmark. Each server is a child in a
session of its own (the terminal's Ctrl-C reaches only the benchmark, which
stops its children in ``finally``), on a loopback port (chosen here with
``free_port``, or port 0 and read back from the line the child logs when it
listens: ``logged_url`` with ``sim_url`` or ``proxy_url``). Its stdout is
discarded or kept in a file (the proxy's access log must never fill a pipe),
its stderr kept in a file for the error message when it fails. CPU figures
come from ``/proc``: Linux only, like the deployments.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import aiohttp
from redis.asyncio import Redis
from redis.exceptions import RedisError

from bench.common import scrubbed_env

ROOT = Path(__file__).resolve().parent.parent
START_TIMEOUT_S = 20.0
STOP_TIMEOUT_S = 5.0
POLL_S = 0.05
_SIM_LISTENING = re.compile(rb"serving \S+ on (http://\S+)")
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def listen_overflows() -> int:
    """The kernel's count of connections dropped from full accept queues (all sockets)."""
    lines = [line.split() for line in Path("/proc/net/netstat").read_text().splitlines()]
    for names, values in zip(lines[::2], lines[1::2], strict=False):
        if names[0] == "TcpExt:" and "ListenOverflows" in names:
            return int(values[names.index("ListenOverflows")])
    return 0


def cpu_seconds(pid: int) -> float:
    """User plus system CPU of a process, all its threads (``/proc/<pid>/stat``); 0 once gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    fields = stat[stat.rindex(")") + 2 :].split()  # the name may hold spaces
    utime, stime = int(fields[11]), int(fields[12])  # fields 14 and 15 of proc(5)
    return (utime + stime) / CLOCK_TICKS


@dataclass(slots=True)
class Server:
    """One server process and where it listens (``url`` once known)."""

    name: str
    url: str
    ready_path: str
    process: subprocess.Popen[bytes]
    stderr_path: Path
    #: Where its stdout goes when it is kept (the proxy's access log); None: discarded.
    stdout_path: Path | None = None

    def cpu(self) -> float:
        return cpu_seconds(self.process.pid)

    def stderr_tail(self, lines: int = 20) -> str:
        text = ""
        for path in (self.stderr_path, self.stdout_path):
            if path is not None and path.exists():
                text += path.read_text(errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    def check_alive(self) -> None:
        if self.process.poll() is not None:
            raise RuntimeError(
                f"{self.name} exited with {self.process.returncode}:\n{self.stderr_tail()}"
            )


def spawn(
    name: str, argv: Sequence[str], workdir: Path, *, env: dict[str, str] | None = None,
    keep_stdout: bool = False, url: str = "", ready_path: str = "",
) -> Server:  # fmt: skip
    """Start ``argv`` from the repository root; ``keep_stdout``: into ``<name>.stdout``."""
    stderr_path = workdir / f"{name}.stderr"
    stdout_path = workdir / f"{name}.stdout" if keep_stdout else None
    with contextlib.ExitStack() as files:
        stderr = files.enter_context(stderr_path.open("wb"))
        stdout = (
            files.enter_context(stdout_path.open("wb"))
            if stdout_path is not None
            else subprocess.DEVNULL
        )
        # A session of its own keeps the terminal's Ctrl-C for us to handle.
        process = subprocess.Popen(
            argv, cwd=ROOT, stdout=stdout, stderr=stderr, env=env, start_new_session=True
        )
    return Server(name, url, ready_path, process, stderr_path, stdout_path)


def start_server(
    name: str, argv: Sequence[str], port: int, ready_path: str, workdir: Path,
    env: dict[str, str] | None = None,
) -> Server:  # fmt: skip
    """A server on a port chosen beforehand (``free_port``); stdout discarded."""
    return spawn(
        name, argv, workdir, env=env, url=f"http://127.0.0.1:{port}", ready_path=ready_path
    )


def start_upstream_and_passthrough(
    workdir: Path, started: list[Server], upstream_name: str = "upstream"
) -> Server:
    """The fast upstream and the bare pass-through in front of it, the baseline pair of
    the overhead-style benchmarks; both appended to ``started`` (stopped by the caller,
    in reverse order). Returns the upstream."""
    python = sys.executable
    port = free_port()
    upstream = start_server(
        upstream_name, [python, "-m", "bench.fast_upstream", "--port", str(port)],
        port, "/health", workdir,
    )  # fmt: skip
    started.append(upstream)
    port = free_port()
    started.append(start_server(
        "passthrough",
        [python, "-m", "bench.passthrough", "--port", str(port), "--upstream", upstream.url],
        port, "/health", workdir,
    ))  # fmt: skip
    return upstream


def start_redis(workdir: Path) -> tuple[Server, int]:
    """A loopback ``redis-server`` without persistence, for ``state.backend: redis``; returns
    it and its port (``wait_redis`` waits until it answers). Stopped by the caller."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server is not installed")
    port = free_port()
    argv = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    return start_server("redis", argv, port, "", workdir), port


async def wait_redis(server: Server, port: int, timeout_s: float = START_TIMEOUT_S) -> None:
    """Until the Redis on ``port`` answers PING; fail early if it exits."""
    client = Redis(host="127.0.0.1", port=port, socket_connect_timeout=1.0)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            server.check_alive()
            with contextlib.suppress(RedisError, OSError):
                if await client.ping():
                    return
            if time.monotonic() > deadline:
                raise RuntimeError(f"{server.name} not answering after {timeout_s:.0f} s")
            await asyncio.sleep(POLL_S)
    finally:
        await client.aclose()


def stop_server(server: Server) -> None:
    """SIGTERM (the servers shut down gracefully), SIGKILL if that takes too long."""
    if server.process.poll() is not None:
        return
    server.process.send_signal(signal.SIGTERM)
    try:
        server.process.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        server.process.kill()
        server.process.wait()


def sim_url(text: bytes) -> str | None:
    """The URL an ``admission-proxy sim`` logs on stderr when it listens."""
    match = _SIM_LISTENING.search(text)
    return match.group(1).decode() if match else None


def proxy_url(text: bytes) -> str | None:
    """The URL of the proxy's ``listening`` JSON event (stdout)."""
    for line in text.splitlines():
        if b'"listening"' not in line:
            continue
        with contextlib.suppress(ValueError):
            event = json.loads(line)
            if event.get("event") == "listening":
                return f"http://127.0.0.1:{int(event['port'])}"
    return None


def _logged(path: Path, parse: Callable[[bytes], str | None]) -> str | None:
    return parse(path.read_bytes()) if path.exists() else None


async def logged_url(server: Server, path: Path, parse: Callable[[bytes], str | None]) -> str:
    """Poll the server's log until it names its URL, or fail with its log."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        server.check_alive()
        url = _logged(path, parse)
        if url is not None:
            return url
        await asyncio.sleep(POLL_S)
    raise RuntimeError(f"{server.name} did not listen within {START_TIMEOUT_S:.0f} s")


async def wait_ready(
    session: aiohttp.ClientSession,
    server: Server,
    timeout_s: float = START_TIMEOUT_S,
    path: str | None = None,
) -> None:
    """Poll ``path`` (the server's readiness path) until it answers 200; fail early if it exits."""
    deadline = time.monotonic() + timeout_s
    while True:
        server.check_alive()
        with contextlib.suppress(aiohttp.ClientError):
            async with session.get(server.url + (path or server.ready_path)) as response:
                if response.status == 200:
                    return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{server.name} not ready after {timeout_s:.0f} s")
        await asyncio.sleep(POLL_S)


async def sim_stats(session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    """A simulated replica's own counters (``GET /sim/stats``)."""
    async with session.get(url + "/sim/stats") as response:
        response.raise_for_status()
        stats: dict[str, Any] = await response.json()
    return stats


class Closing:
    """What ``with`` closes on the way out, however the block ends (harnesses of processes)."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class Sims(Closing):
    """A set of simulated replicas (``admission-proxy sim``), all stopped on exit."""

    def __init__(self, workdir: Path, label: str) -> None:
        self._workdir = workdir
        self._label = label
        self.sims: list[Server] = []

    def __repr__(self) -> str:
        return f"<Sims {self._label}: {[sim.url for sim in self.sims]}>"

    @property
    def urls(self) -> list[str]:
        return [sim.url for sim in self.sims]

    def _spawn(self, index: int, sim_args: Sequence[str]) -> Server:
        argv = [sys.executable, "-m", "proxy", "sim", "--port", "0", "--seed", str(index),
                *sim_args]  # fmt: skip
        return spawn(f"{self._label}-sim-{index}", argv, self._workdir, env=scrubbed_env())

    async def start(self, count: int, sim_args: Sequence[str]) -> list[Server]:
        """``count`` replicas with seeds 0, 1, ...; returns once each has logged its URL."""
        for index in range(count):
            self.sims.append(self._spawn(index, sim_args))
        for sim in self.sims:
            sim.url = await logged_url(sim, sim.stderr_path, sim_url)
        return self.sims

    def close(self) -> None:
        for sim in reversed(self.sims):
            stop_server(sim)
        self.sims.clear()
