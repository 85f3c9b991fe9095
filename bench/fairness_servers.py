"""The fairness benchmark's server processes: simulated replicas and the proxy.

Each replica is its own ``admission-proxy sim`` process and the proxy its own
``admission-proxy serve`` process, so that on a small machine the load
generator, the proxy and the "GPUs" are scheduled by the OS as separate
programs (as deployed) rather than sharing one event loop, whose lag would
show up as TTFT. Every child binds port 0; the port is read back from the
line it logs when it listens (the sim on stderr, the proxy's ``listening``
JSON event on stdout). The proxy's stdout (one access-log line per request)
goes to a file in the run's temporary folder, never to a pipe that could fill.

Children are started inside ``Fleet`` and stopped, in reverse order, when it
closes, also on Ctrl-C; a child's own session keeps the terminal's SIGINT for
the benchmark to handle. Nothing here measures anything.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from types import TracebackType
from typing import Any

import aiohttp

from bench.common import Readings, scrubbed_env

ROOT = Path(__file__).resolve().parent.parent
START_TIMEOUT_S = 20.0
STOP_TIMEOUT_S = 5.0
IDLE_TIMEOUT_S = 15.0
POLL_S = 0.05
_SIM_LISTENING = re.compile(rb"serving \S+ on (http://\S+)")


@dataclass(slots=True)
class Child:
    """One server process and where it listens."""

    name: str
    process: subprocess.Popen[bytes]
    stdout_path: Path
    stderr_path: Path
    url: str = ""

    def log_tail(self, lines: int = 20) -> str:
        text = ""
        for path in (self.stderr_path, self.stdout_path):
            if path.exists():
                text += path.read_text(errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    def check_alive(self) -> None:
        if self.process.poll() is not None:
            raise RuntimeError(
                f"{self.name} exited with {self.process.returncode}:\n{self.log_tail()}"
            )


def _command() -> list[str]:
    return [sys.executable, "-m", "proxy"]


class Fleet:
    """The replicas for the whole run and one proxy at a time, all stopped on exit."""

    def __init__(self, workdir: Path) -> None:
        self._workdir = workdir
        self.sims: list[Child] = []
        self.proxy: Child | None = None
        self._proxies_started = 0

    def __repr__(self) -> str:
        proxy = "a proxy" if self.proxy is not None else "no proxy"
        return f"<Fleet {len(self.sims)} sims, {proxy}>"

    def _spawn(self, name: str, argv: list[str]) -> Child:
        stdout_path = self._workdir / f"{name}.stdout"
        stderr_path = self._workdir / f"{name}.stderr"
        with stdout_path.open("wb") as out, stderr_path.open("wb") as err:
            process = subprocess.Popen(
                argv, cwd=ROOT, stdout=out, stderr=err, env=scrubbed_env(),
                start_new_session=True,
            )  # fmt: skip
        return Child(name, process, stdout_path, stderr_path)

    async def start_sims(self, count: int, sim_args: list[str]) -> list[Child]:
        for index in range(count):
            argv = [*_command(), "sim", "--port", "0", "--seed", str(index), *sim_args]
            child = self._spawn(f"sim-{index}", argv)
            self.sims.append(child)
            child.url = await _read_url(child, child.stderr_path, _sim_url)
        return self.sims

    async def start_proxy(self, config_yaml: str) -> Child:
        """A fresh proxy with this config (the previous one must be stopped)."""
        assert self.proxy is None, "one proxy at a time"
        self._proxies_started += 1
        name = f"proxy-{self._proxies_started}"
        config_path = self._workdir / f"{name}.yaml"
        config_path.write_text(config_yaml)
        self.proxy = child = self._spawn(
            name, [*_command(), "serve", "--config", str(config_path), "--port", "0"]
        )
        child.url = await _read_url(child, child.stdout_path, _proxy_url)
        return child

    def stop_proxy(self) -> Path | None:
        """Stop the proxy; returns its access log (stdout) for the caller to read."""
        child, self.proxy = self.proxy, None
        if child is None:
            return None
        _stop(child)
        return child.stdout_path

    def close(self) -> None:
        self.stop_proxy()
        for child in reversed(self.sims):
            _stop(child)
        self.sims.clear()

    def __enter__(self) -> Fleet:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _sim_url(text: bytes) -> str | None:
    match = _SIM_LISTENING.search(text)
    return match.group(1).decode() if match else None


def _proxy_url(text: bytes) -> str | None:
    for line in text.splitlines():
        if b'"listening"' not in line:
            continue
        with contextlib.suppress(ValueError):
            event = json.loads(line)
            if event.get("event") == "listening":
                return f"http://127.0.0.1:{int(event['port'])}"
    return None


def _logged_url(path: Path, parse: Callable[[bytes], str | None]) -> str | None:
    return parse(path.read_bytes()) if path.exists() else None


async def _read_url(child: Child, path: Path, parse: Callable[[bytes], str | None]) -> str:
    """Poll the child's log until it names its URL, or fail with its log."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        child.check_alive()
        url = _logged_url(path, parse)
        if url is not None:
            return url
        await asyncio.sleep(POLL_S)
    raise RuntimeError(f"{child.name} did not listen within {START_TIMEOUT_S:.0f} s")


def _stop(child: Child) -> None:
    if child.process.poll() is not None:
        return
    child.process.send_signal(signal.SIGTERM)
    try:
        child.process.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        child.process.kill()
        child.process.wait()


async def wait_ready(session: aiohttp.ClientSession, child: Child, path: str) -> None:
    """Until ``GET path`` answers 200 (``/health`` of a sim, ``/readyz`` of the proxy)."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        child.check_alive()
        with contextlib.suppress(aiohttp.ClientError):
            async with session.get(child.url + path) as response:
                if response.status == 200:
                    return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{child.name} not ready after {START_TIMEOUT_S:.0f} s")
        await asyncio.sleep(POLL_S)


async def _sim_stats(session: aiohttp.ClientSession, sim: Child) -> dict[str, Any]:
    async with session.get(sim.url + "/sim/stats") as response:
        response.raise_for_status()
        stats: dict[str, Any] = await response.json()
        return stats


async def wait_sims_idle(session: aiohttp.ClientSession, sims: list[Child]) -> None:
    """Until every engine has nothing running or waiting (the last run's aborts landed).

    An engine that does not answer is asked again until ``IDLE_TIMEOUT_S``; if
    no reading came back by then the run goes on, saying so (a missing reading
    must not lose the whole benchmark)."""
    deadline = time.monotonic() + IDLE_TIMEOUT_S
    while True:
        busy = 0
        readings = Readings()
        for sim in sims:
            sim.check_alive()
            stats = await readings.take(f"{sim.name} idle", partial(_sim_stats, session, sim))
            if stats is not None:
                busy += int(stats.get("running", 0)) + int(stats.get("waiting", 0))
        if not busy and not readings.missing:
            return
        if time.monotonic() > deadline:
            if busy:
                raise RuntimeError(f"replicas still busy ({busy}) after {IDLE_TIMEOUT_S:.0f} s")
            for missing in readings.missing:
                print(f"  {missing}; going on", flush=True)
            return
        await asyncio.sleep(POLL_S * 2)
