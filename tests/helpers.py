"""Config builders and small polling helpers shared by the tests."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Callable, Iterator
from typing import Any

import yaml
from prometheus_client.parser import text_string_to_metric_families

from proxy.settings import Config, parse_config

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
