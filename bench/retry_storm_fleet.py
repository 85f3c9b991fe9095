"""The retry-storm benchmark's servers: simulated replicas as child processes, the proxy in-process.

Each replica is its own ``admission-proxy sim`` process (bound to port 0 on
loopback; the URL is read back from the line it logs on stderr), so that on a
small machine the "GPUs" are scheduled apart from the proxy and the load
generator. The proxy runs in the benchmark's own event loop (``build_app``
behind an ``AppRunner``), which gives the benchmark its ``Runtime`` for the
readiness check; its access log goes to an in-memory stream that the benchmark
reads per request (attempts, outcome). Nothing here measures anything.

Every child is started inside ``Sims`` and stopped (SIGTERM, then SIGKILL)
when it closes, also on Ctrl-C; a child's own session keeps the terminal's
SIGINT for the benchmark to handle.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import re
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import aiohttp
from aiohttp import web

from bench.common import scrubbed_env
from proxy.app import build_app
from proxy.lifecycle import bound_port
from proxy.runtime import RUNTIME, Runtime
from proxy.settings import Config

ROOT = Path(__file__).resolve().parent.parent
START_TIMEOUT_S = 20.0
STOP_TIMEOUT_S = 5.0
POLL_S = 0.05
#: The proxy's listen backlog: open-loop arrivals open connections in bursts, and
#: a dropped SYN costs its request a 1 s retransmit (docs/BENCHMARKS.md, overhead).
LISTEN_BACKLOG = 2048
_SIM_LISTENING = re.compile(rb"serving \S+ on (http://\S+)")


@dataclass(slots=True)
class Sim:
    """One simulated replica process and where it listens."""

    name: str
    process: subprocess.Popen[bytes]
    stderr_path: Path
    url: str = ""

    def check_alive(self) -> None:
        if self.process.poll() is not None:
            tail = self.stderr_path.read_text(errors="replace").splitlines()[-20:]
            raise RuntimeError(
                f"{self.name} exited with {self.process.returncode}:\n" + "\n".join(tail)
            )


class Sims:
    """A set of simulated replicas, all stopped on exit."""

    def __init__(self, workdir: Path, label: str) -> None:
        self._workdir = workdir
        self._label = label
        self.sims: list[Sim] = []

    def __repr__(self) -> str:
        return f"<Sims {self._label}: {[sim.url for sim in self.sims]}>"

    @property
    def urls(self) -> list[str]:
        return [sim.url for sim in self.sims]

    def _spawn(self, index: int, sim_args: Sequence[str]) -> Sim:
        name = f"{self._label}-sim-{index}"
        stderr_path = self._workdir / f"{name}.stderr"
        env = scrubbed_env()
        argv = [sys.executable, "-m", "proxy", "sim", "--port", "0", "--seed", str(index),
                *sim_args]  # fmt: skip
        with stderr_path.open("wb") as err:
            process = subprocess.Popen(
                argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err, env=env,
                start_new_session=True,
            )  # fmt: skip
        return Sim(name, process, stderr_path)

    async def start(self, count: int, sim_args: Sequence[str]) -> list[Sim]:
        """``count`` replicas with seeds 0, 1, ...; returns once each has logged its URL."""
        for index in range(count):
            self.sims.append(self._spawn(index, sim_args))
        for sim in self.sims:
            sim.url = await _read_url(sim)
        return self.sims

    def close(self) -> None:
        for sim in reversed(self.sims):
            _stop(sim.process)
        self.sims.clear()

    def __enter__(self) -> Sims:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


async def _read_url(sim: Sim) -> str:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        sim.check_alive()
        if sim.stderr_path.exists():
            match = _SIM_LISTENING.search(sim.stderr_path.read_bytes())
            if match:
                return match.group(1).decode()
        await asyncio.sleep(POLL_S)
    raise RuntimeError(f"{sim.name} did not listen within {START_TIMEOUT_S:.0f} s")


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


async def sim_stats(session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with session.get(url + "/sim/stats") as response:
        response.raise_for_status()
        stats: dict[str, Any] = await response.json()
    return stats


async def set_faults(session: aiohttp.ClientSession, url: str, **faults: object) -> None:
    async with session.post(url + "/sim/faults", json=faults) as response:
        if response.status != 200:
            raise RuntimeError(f"POST {url}/sim/faults: {response.status} {await response.text()}")


async def wait_healthy(session: aiohttp.ClientSession, sims: Sims) -> None:
    """Until every sim answers ``GET /health`` with 200."""
    deadline = time.monotonic() + START_TIMEOUT_S
    for sim in sims.sims:
        while True:
            sim.check_alive()
            with contextlib.suppress(aiohttp.ClientError):
                async with session.get(sim.url + "/health") as response:
                    if response.status == 200:
                        break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{sim.name} not healthy after {START_TIMEOUT_S:.0f} s")
            await asyncio.sleep(POLL_S)


@dataclass(slots=True)
class RunningProxy:
    url: str
    runtime: Runtime
    access_log: io.StringIO


@contextlib.asynccontextmanager
async def running_proxy(config: Config, seed: int) -> AsyncIterator[RunningProxy]:
    """The proxy in this process, on a loopback port, once every replica is serving."""
    access_log = io.StringIO()
    app = build_app(config, seed=seed, access_log=access_log)
    runtime = app[RUNTIME]
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0, backlog=LISTEN_BACKLOG)
        await site.start()
        port = bound_port(site)
        if port is None:
            raise RuntimeError("the proxy's listener has no port")
        deadline = time.monotonic() + START_TIMEOUT_S
        while not all(replica.serving for replica in runtime.pool.replicas):
            if time.monotonic() > deadline:
                raise RuntimeError(f"replicas not serving after {START_TIMEOUT_S:.0f} s: "
                                   f"{runtime.pool!r}")  # fmt: skip
            await asyncio.sleep(POLL_S)
        yield RunningProxy(f"http://127.0.0.1:{port}", runtime, access_log)
    finally:
        await runner.cleanup()
