"""Proxy processes for the multi-process tests: ``serve`` (or ``serve --workers N``) as
a real child process, its JSON log lines collected, its port read from them."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import yaml

CLI = [sys.executable, "-m", "proxy"]
#: Bound on a process start (2 cores shared by many: generous).
START_TIMEOUT_S = 20.0


class ProxyProcess:
    """One ``serve`` process (a supervisor with ``workers`` > 1) and its log events."""

    def __init__(self, proc: asyncio.subprocess.Process, workers: int) -> None:
        self.proc = proc
        self.workers = workers
        self.events: list[dict[str, Any]] = []
        self._listening = asyncio.Event()
        self._reader = asyncio.create_task(self._read())
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def listening(self) -> list[dict[str, Any]]:
        return [e for e in self.events if e.get("event") == "listening"]

    def named(self, event: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e.get("event") == event]

    async def _read(self) -> None:
        assert self.proc.stdout is not None
        while line := await self.proc.stdout.readline():
            with contextlib.suppress(ValueError):
                self.events.append(json.loads(line))
            if len(self.listening()) >= self.workers:
                self._listening.set()

    async def wait_listening(self, count: int | None = None) -> None:
        """Until ``count`` (default: every worker) 'listening' lines have come."""
        want = self.workers if count is None else count
        async with asyncio.timeout(START_TIMEOUT_S):
            while len(self.listening()) < want:
                if self._reader.done():
                    raise AssertionError(f"proxy exited before listening: {self.events[-5:]}")
                await asyncio.sleep(0.02)
        self.port = int(self.listening()[0]["port"])

    def signal(self, signum: int) -> None:
        self.proc.send_signal(signum)

    async def stop(self) -> int:
        """SIGTERM, bounded wait (SIGKILL after it); the exit code."""
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
            try:
                async with asyncio.timeout(START_TIMEOUT_S):
                    await self.proc.wait()
            except TimeoutError:
                # Its workers too: they hold the stdout pipe, and asyncio's wait() waits for
                # every holder to close it.
                for pid in {self.proc.pid, *(int(e["pid"]) for e in self.listening())}:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                async with asyncio.timeout(START_TIMEOUT_S):
                    await self.proc.wait()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(5):
                await self._reader
        assert self.proc.returncode is not None
        return self.proc.returncode


async def start_serve(
    config_path: Path, *, workers: int = 1, port: int = 0, extra: tuple[str, ...] = ()
) -> ProxyProcess:
    """``python -m proxy serve`` on loopback, started and listening."""
    args = [*CLI, "serve", "--config", str(config_path), "--host", "127.0.0.1"]
    args += ["--port", str(port), *extra]
    if workers != 1:
        args += ["--workers", str(workers)]
    proc = await asyncio.create_subprocess_exec(*args, stdout=asyncio.subprocess.PIPE)
    process = ProxyProcess(proc, workers)
    try:
        await process.wait_listening()
    except BaseException:
        await process.stop()
        raise
    return process


def write_config(path: Path, config: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(config))
    return path
