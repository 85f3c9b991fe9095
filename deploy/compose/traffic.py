"""Demo traffic for the compose stack: open-loop requests from every tenant of a config.

Reads the config the proxy runs (mounted read-only), takes each tenant's first
plain API key (``sha256:`` entries cannot be sent) and sends Poisson arrivals
of chat completions until stopped, so that Grafana and Jaeger have something to
show. A tenant with an entrance rate limit is driven at 1.5 times that rate, so
``rate_limited`` answers appear on the dashboard; a tenant allowed the
``interactive`` class asks for it on a third of its requests.

Runs in the proxy image (aiohttp and PyYAML are there):
``python traffic.py --url http://proxy:8080 --config /etc/admission-proxy/demo.yaml``.
"""

from __future__ import annotations

import argparse
import asyncio
import random
from collections import Counter
from dataclasses import dataclass
from typing import Any

import aiohttp
import yaml

DEFAULT_RATE_PER_S = 4.0
OVER_QUOTA = 1.5


@dataclass(frozen=True, slots=True)
class Flow:
    tenant: str
    key: str
    rate_per_s: float
    interactive: bool


def flows(document: dict[str, Any], rate_per_s: float = DEFAULT_RATE_PER_S) -> list[Flow]:
    """One flow per tenant that has a plain key."""
    result = []
    for name, tenant in (document.get("tenants") or {}).items():
        keys = [k for k in tenant.get("api_keys") or () if not str(k).startswith("sha256:")]
        if not keys:
            continue
        limit = tenant.get("rate_per_s")
        rate = OVER_QUOTA * float(limit) if limit else rate_per_s
        classes = set(tenant.get("allowed_priorities") or ())
        result.append(Flow(str(name), str(keys[0]), rate, "interactive" in classes))
    return result


async def _send(
    session: aiohttp.ClientSession, url: str, flow: Flow, rng: random.Random, seen: Counter[str]
) -> None:
    body = {
        "model": "sim-model",
        "messages": [{"role": "user", "content": "word " * rng.randint(20, 200)}],
        "max_tokens": rng.randint(16, 128),
        "stream": rng.random() < 0.5,
    }
    headers = {"Authorization": f"Bearer {flow.key}"}
    if flow.interactive and rng.random() < 1 / 3:
        headers["X-Priority"] = "interactive"
    try:
        async with session.post(f"{url}/v1/chat/completions", json=body, headers=headers) as resp:
            await resp.read()
            seen[f"{flow.tenant} {resp.headers.get('X-Admission-Reason', resp.status)}"] += 1
    except aiohttp.ClientError as exc:
        seen[f"{flow.tenant} {type(exc).__name__}"] += 1


async def _arrivals(
    session: aiohttp.ClientSession, url: str, flow: Flow, seen: Counter[str]
) -> None:
    rng = random.Random(flow.tenant)
    pending: set[asyncio.Task[None]] = set()
    while True:
        await asyncio.sleep(rng.expovariate(flow.rate_per_s))
        task = asyncio.create_task(_send(session, url, flow, rng, seen))
        pending.add(task)
        task.add_done_callback(pending.discard)


async def run(url: str, document: dict[str, Any]) -> None:
    plan = flows(document)
    print("traffic:", ", ".join(f"{f.tenant} {f.rate_per_s:g}/s" for f in plan), flush=True)
    seen: Counter[str] = Counter()
    connector = aiohttp.TCPConnector(limit=500)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        senders = [asyncio.create_task(_arrivals(session, url.rstrip("/"), f, seen)) for f in plan]
        try:
            while True:
                await asyncio.sleep(10)
                print("traffic:", dict(sorted(seen.items())), flush=True)
                seen.clear()
        finally:
            for task in senders:
                task.cancel()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--url", required=True, help="the proxy, e.g. http://proxy:8080")
    parser.add_argument("--config", required=True, help="the config the proxy runs")
    args = parser.parse_args()
    with open(args.config, encoding="utf-8") as file:
        document = yaml.safe_load(file)
    asyncio.run(run(args.url, document))


if __name__ == "__main__":
    main()
