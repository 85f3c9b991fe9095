"""Config builders and small polling helpers shared by the tests."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from types import TracebackType
from typing import Any

import yaml
from prometheus_client.parser import text_string_to_metric_families

from proxy.settings import Config, parse_config
from proxy.sim import SimConfig, SimServer, start_sim

KEY_A = "sk-tenant-a"
KEY_B = "sk-tenant-b"


def make_config(
    replica_urls: list[str],
    *,
    seats: int = 4,
    tenants: dict[str, Any] | None = None,
    **sections: Any,
) -> Config:
    """A valid config for the given upstreams; sections override the defaults."""
    doc: dict[str, Any] = {
        "replicas": [
            {"name": f"r{i}", "url": url, "max_concurrency": seats}
            for i, url in enumerate(replica_urls)
        ],
        "tenants": tenants
        or {
            "a": {"api_keys": [KEY_A], "allowed_priorities": ["interactive", "standard"]},
            "b": {"api_keys": [KEY_B], "priority": "batch"},
        },
    }
    doc.update(sections)
    return parse_config(yaml.safe_dump(doc))


async def wait_for(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    """Poll ``condition`` until it holds; fail the test after ``timeout_s``."""
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.005)


class SteadyLoad:
    """``clients`` loops, each sending one request after another through ``send`` (which
    returns the answer's status) until ``stop()``, at most ``max_requests`` in all: the
    "under load" of the reload and rollback tests. Leaving the block on an exception
    cancels the loops, so a failing test never leaves clients running."""

    def __init__(
        self, send: Callable[[], Awaitable[int]], clients: int = 8, max_requests: int = 20_000
    ) -> None:
        self.statuses: list[int] = []
        self._send = send
        self._clients = clients
        self._max_requests = max_requests
        self._stopped = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    async def _loop(self) -> None:
        while not self._stopped.is_set() and len(self.statuses) < self._max_requests:
            self.statuses.append(await self._send())

    async def __aenter__(self) -> SteadyLoad:
        self._tasks = [asyncio.create_task(self._loop()) for _ in range(self._clients)]
        return self

    async def stop(self) -> None:
        """Let every client finish its request in flight, then return."""
        self._stopped.set()
        await asyncio.gather(*self._tasks)

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stopped.set()
        if kind is not None:
            for task in self._tasks:
                task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=kind is not None)


def sse_tokens(events: list[dict[str, Any]]) -> list[str]:
    """The content tokens of parsed chat-completion stream events, in order."""
    return [
        e["choices"][0]["delta"]["content"]
        for e in events
        if e.get("choices") and e["choices"][0]["delta"].get("content")
    ]


def samples_by_label(metrics_text: str, name: str, label: str) -> dict[str, float]:
    """The samples of one metric in a /metrics page, keyed by one of their labels (the
    values of series that share that label are summed), parsed by prometheus-client's own
    parser so the tests read the page as Prometheus does."""
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name == name:
                key = sample.labels[label]
                found[key] = found.get(key, 0.0) + sample.value
    return found


@contextlib.contextmanager
def handshake_never_completes() -> Iterator[int]:
    """A loopback port whose accept backlog is full: a new connection's SYN is dropped,
    so a client's connect times out (the connect-timeout tests' replica)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    fillers = []
    try:
        for _ in range(3):  # fill the backlog so the next SYN is dropped
            filler = socket.socket()
            filler.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                filler.connect(listener.getsockname())
            fillers.append(filler)
        yield listener.getsockname()[1]
    finally:
        for filler in fillers:
            filler.close()
        listener.close()


@contextlib.asynccontextmanager
async def running_sims(
    count: int = 2, *, decode_per_seq_ms: float = 0.2
) -> AsyncIterator[list[SimServer]]:
    """``count`` fast simulator replicas (8 slots, 1 ms a decode step, seeds 0, 1, ...),
    closed on leaving: the pair most resilience and churn tests put behind a proxy."""
    servers: list[SimServer] = []
    try:
        for i in range(count):
            config = SimConfig(
                slots=8, seed=i, decode_base_ms=1.0, decode_per_seq_ms=decode_per_seq_ms
            )
            servers.append(await start_sim(config))
        yield servers
    finally:
        for server in servers:
            await server.close()
