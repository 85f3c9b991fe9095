"""The fairness benchmark's server processes: simulated replicas and the proxy.

Each replica is its own ``admission-proxy sim`` process and the proxy its own
``admission-proxy serve`` process, so that on a small machine the load
generator, the proxy and the "GPUs" are scheduled by the OS as separate
programs (as deployed) rather than sharing one event loop, whose lag would
show up as TTFT. Every child binds port 0; the port is read back from the
line it logs when it listens (the sim on stderr, the proxy's ``listening``
JSON event on stdout). The proxy's stdout (one access-log line per request)
goes to a file in the run's temporary folder, never to a pipe that could fill.

Serverren are started inside ``Fleet`` and stopped, in reverse order, when it
closes, also on Ctrl-C; a child's own session keeps the terminal's SIGINT for
the benchmark to handle. Nothing here measures anything.
"""

from __future__ import annotations

import asyncio
import sys
import time
from functools import partial
from pathlib import Path

import aiohttp

from bench import processes
from bench.common import Readings, scrubbed_env
from bench.processes import (
    POLL_S,
    START_TIMEOUT_S,
    Closing,
    Server,
    Sims,
    logged_url,
    proxy_url,
    sim_stats,
    spawn,
    stop_server,
)

IDLE_TIMEOUT_S = 15.0


def _command() -> list[str]:
    return [sys.executable, "-m", "proxy"]


class Fleet(Closing):
    """The replicas for the whole run and one proxy deployment at a time (one ``serve``
    process, or several sharing one config: ``state.backend: redis``), all stopped on exit."""

    def __init__(self, workdir: Path) -> None:
        self._workdir = workdir
        self._sims = Sims(workdir, "fleet")
        self.proxies: list[Server] = []
        self._proxies_started = 0

    def __repr__(self) -> str:
        return f"<Fleet {len(self.sims)} sims, {len(self.proxies)} proxies>"

    @property
    def sims(self) -> list[Server]:
        return self._sims.sims

    @property
    def proxy(self) -> Server | None:
        """The first (or only) proxy running, if any."""
        return self.proxies[0] if self.proxies else None

    async def start_sims(self, count: int, sim_args: list[str]) -> list[Server]:
        return await self._sims.start(count, sim_args)

    async def start_proxy(self, config_yaml: str) -> Server:
        """A fresh proxy with this config (the previous ones must be stopped)."""
        return (await self.start_proxies(config_yaml, 1))[0]

    async def start_proxies(self, config_yaml: str, count: int) -> list[Server]:
        """``count`` fresh ``serve`` processes with this one config, each on its own port."""
        assert not self.proxies, "one deployment at a time"
        for _ in range(count):
            self._proxies_started += 1
            name = f"proxy-{self._proxies_started}"
            config_path = self._workdir / f"{name}.yaml"
            config_path.write_text(config_yaml)
            argv = [*_command(), "serve", "--config", str(config_path), "--port", "0"]
            child = spawn(name, argv, self._workdir, env=scrubbed_env(), keep_stdout=True)
            self.proxies.append(child)
        for child in self.proxies:
            assert child.stdout_path is not None
            child.url = await logged_url(child, child.stdout_path, proxy_url)
        return list(self.proxies)

    def stop_proxy(self) -> Path | None:
        """Stop the proxy; returns its access log (stdout) for the caller to read."""
        logs = self.stop_proxies()
        return logs[0] if logs else None

    def stop_proxies(self) -> list[Path]:
        """Stop every proxy; returns their access logs (stdout), in starting order."""
        children, self.proxies = self.proxies, []
        for child in children:
            stop_server(child)
        return [child.stdout_path for child in children if child.stdout_path is not None]

    def close(self) -> None:
        self.stop_proxies()
        self._sims.close()


async def wait_ready(session: aiohttp.ClientSession, child: Server, path: str) -> None:
    """Until ``GET path`` answers 200 (``/health`` of a sim, ``/readyz`` of the proxy)."""
    await processes.wait_ready(session, child, START_TIMEOUT_S, path)


async def wait_sims_idle(session: aiohttp.ClientSession, sims: list[Server]) -> None:
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
            stats = await readings.take(f"{sim.name} idle", partial(sim_stats, session, sim.url))
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
