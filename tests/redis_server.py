"""A real ``redis-server`` for the shared-state tests, on a free loopback port.

The server runs without persistence in a temporary directory, never on 6379,
so a system Redis (the Debian package's own service) is never touched. Tests
that need Redis down mid-way call ``stop()`` and ``start()``: the restart
keeps the port, so clients built from ``url`` reconnect by themselves, and
it comes back empty (scripts cache included), like a real restart without
persistence.

Where ``redis-server`` is not on PATH the fixture skips with the reason;
``scripts/test`` installs it on Debian when it can.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

#: How long a start may take before the test fails (generous: 2 cores shared by many).
START_TIMEOUT_S = 20.0


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _answers_ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    """One ``redis-server`` process; ``stop``/``start`` keep its port."""

    __slots__ = ("_binary", "_dir", "_process", "port")

    def __init__(self, binary: str, directory: Path) -> None:
        self._binary = binary
        self._dir = directory
        self._process: subprocess.Popen[bytes] | None = None
        self.port = _free_port()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def start(self) -> None:
        """Start the server and wait (bounded) until it answers PING."""
        args = [self._binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", ""]
        args += ["--appendonly", "no", "--dir", str(self._dir), "--loglevel", "warning"]
        self._process = subprocess.Popen(
            args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=self._dir
        )
        deadline = time.monotonic() + START_TIMEOUT_S
        while not _answers_ping(self.port):
            if self._process.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self._process.returncode}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server did not answer PING in {START_TIMEOUT_S} s")
            time.sleep(0.02)

    def stop(self) -> None:
        """Kill the server (a crash, not a shutdown: nothing is saved) and wait for it."""
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            process.kill()
            process.wait(timeout=START_TIMEOUT_S)

    def __repr__(self) -> str:
        return f"<RedisServer 127.0.0.1:{self.port} {'up' if self.running else 'down'}>"


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A fresh, empty redis-server per test; skipped where none is installed."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server not installed (scripts/test installs it on Debian as root)")
    server = RedisServer(binary, tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.stop()
