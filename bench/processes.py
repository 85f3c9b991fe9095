"""Benchmark servers as child processes: start, wait until ready, measure CPU, stop.

Each server is a child in a session of its own (the terminal's Ctrl-C reaches
only the benchmark, which stops its children in ``finally``), on a loopback
port the OS picked, with stdout discarded (the proxy's access log must never
fill a pipe) and stderr kept in a file for the error message when it fails.
CPU figures come from ``/proc``: Linux only, like the deployments.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
STOP_TIMEOUT_S = 5.0
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
    name: str
    url: str
    ready_path: str
    process: subprocess.Popen[bytes]
    stderr_path: Path

    def cpu(self) -> float:
        return cpu_seconds(self.process.pid)

    def stderr_tail(self, lines: int = 20) -> str:
        text = self.stderr_path.read_text(errors="replace") if self.stderr_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


def start_server(
    name: str, argv: Sequence[str], port: int, ready_path: str, workdir: Path,
    env: dict[str, str] | None = None,
) -> Server:  # fmt: skip
    stderr_path = workdir / f"{name}.stderr"
    with stderr_path.open("wb") as stderr:
        # stdout (the proxy's access log) goes nowhere, so no pipe can fill;
        # a session of its own keeps the terminal's Ctrl-C for us to handle.
        process = subprocess.Popen(
            argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=stderr, env=env,
            start_new_session=True,
        )  # fmt: skip
    return Server(name, f"http://127.0.0.1:{port}", ready_path, process, stderr_path)


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


async def wait_ready(session: aiohttp.ClientSession, server: Server, timeout_s: float) -> None:
    """Poll the server's readiness path until it answers 200; fail early if it exits."""
    deadline = time.monotonic() + timeout_s
    while True:
        if server.process.poll() is not None:
            raise RuntimeError(
                f"{server.name} exited with {server.process.returncode}:\n{server.stderr_tail()}"
            )
        try:
            async with session.get(server.url + server.ready_path) as response:
                if response.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{server.name} not ready after {timeout_s:.0f} s")
        await asyncio.sleep(0.05)
