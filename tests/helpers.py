"""Config builders and small polling helpers shared by the tests."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import yaml

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
