"""``admission-proxy demo``: the product on the embedded simulated replicas.

Starts two simulated GPU replicas and the proxy (``config/demo.yaml``, with
the replica URLs replaced by the simulators' OS-chosen ports), drives mixed
open-loop traffic from three tenants of different priorities (one of them
over its rate quota), prints a progress line each second and a per-tenant
summary, and exits 0 by itself. Everything runs on loopback.

The last simulated replica answers a light share of requests (``DEMO_FAULT_RATE``)
with 503, as an engine under pressure does, so the summary shows the proxy
retrying them on the other replica (``admission_retries_total``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import aiohttp
from aiohttp import web

from proxy.app import build_app
from proxy.lifecycle import bound_port
from proxy.runtime import RUNTIME
from proxy.settings import Config, Mode, load_config
from proxy.sim import SimConfig, SimServer, start_sim
from proxy.sim.faults import Faults
from proxy.sse import has_token

DEMO_CONFIG_CANDIDATES = (
    Path(__file__).resolve().parents[1] / "config" / "demo.yaml",
    Path("/etc/admission-proxy/demo.yaml"),
)
#: Seconds the demo waits for the last requests after traffic stops.
DRAIN_S = 10.0
#: Share of requests the last simulated replica answers with ``DEMO_FAULT_STATUS``:
#: light enough that the retry budget's floor covers every retry.
DEMO_FAULT_RATE = 0.05
#: A status in the default ``retry.retry_on``: retried, and not counted toward ejection.
DEMO_FAULT_STATUS = 503


@dataclass(frozen=True, slots=True)
class Flow:
    """One tenant's traffic in the demo."""

    tenant: str
    key: str
    rate_per_s: float
    max_tokens: tuple[int, int]
    stream_share: float
    priority: str | None = None


FLOWS = (
    Flow("chat", "demo-chat-key", 5.0, (16, 48), 1.0),
    Flow("webapp", "demo-webapp-key", 5.0, (32, 96), 0.3),
    Flow("webapp", "demo-webapp-key", 1.0, (16, 32), 1.0, priority="interactive"),
    Flow("analytics", "demo-analytics-key", 30.0, (64, 160), 0.0),  # over its 20/s quota
)


@dataclass
class TenantStats:
    sent: int = 0
    ok: int = 0
    refused: Counter[str] = field(default_factory=Counter)
    latencies: list[float] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)


def _find_config(path: str | None) -> Path:
    if path:
        return Path(path)
    for candidate in DEMO_CONFIG_CANDIDATES:
        if candidate.exists():
            return candidate
    raise FileNotFoundError("config/demo.yaml not found; pass --config")


def sim_configs(count: int, fault_rate: float = DEMO_FAULT_RATE) -> list[SimConfig]:
    """One simulator per replica; the last one fails ``fault_rate`` of its requests."""
    faulty = Faults(error_rate=fault_rate, error_status=DEMO_FAULT_STATUS)
    return [SimConfig(seed=i, faults=faulty if i == count - 1 else Faults()) for i in range(count)]


def retries_by_reason(app: web.Application) -> Counter[str]:
    """The proxy's ``admission_retries_total`` by reason, read from its own registry."""
    retries: Counter[str] = Counter()
    for family in app[RUNTIME].telemetry.metrics.registry.collect():
        if family.name != "admission_retries":
            continue
        for sample in family.samples:
            if sample.name == "admission_retries_total" and sample.value:
                retries[sample.labels["reason"]] += int(sample.value)
    return retries


def retries_line(retries: Counter[str]) -> str:
    reasons = ", ".join(f"{reason} {n}" for reason, n in retries.most_common())
    return f"retries: {sum(retries.values())}" + (f" ({reasons})" if reasons else "")


def observed_line(app: web.Application) -> str:
    """``mode: observe``: what enforcing would have refused, by reason."""
    observed: Counter[str] = Counter()
    for values, child in app[RUNTIME].telemetry.metrics.observed_refusals.series():
        observed[values[2]] += int(child.value)
    reasons = ", ".join(f"{reason} {n}" for reason, n in observed.most_common())
    return f"observed (enforcing would have refused): {sum(observed.values())}" + (
        f" ({reasons})" if reasons else ""
    )


def _with_replicas(config: Config, sims: list[SimServer]) -> Config:
    replicas = tuple(
        replica.model_copy(update={"url": sim.url})
        for replica, sim in zip(config.replicas, sims, strict=False)
    )
    return config.model_copy(update={"replicas": replicas})


async def _one_request(
    session: aiohttp.ClientSession, url: str, flow: Flow, rng: random.Random, stats: TenantStats
) -> None:
    stream = rng.random() < flow.stream_share
    body = {
        "model": "sim-model",
        "messages": [{"role": "user", "content": "word " * rng.randint(20, 200)}],
        "max_tokens": rng.randint(*flow.max_tokens),
        "stream": stream,
    }
    headers = {"Authorization": f"Bearer {flow.key}"}
    if flow.priority:
        headers["X-Priority"] = flow.priority
    stats.sent += 1
    started = time.monotonic()
    try:
        async with session.post(url + "/v1/chat/completions", json=body, headers=headers) as resp:
            if resp.status != 200:
                await resp.read()
                stats.refused[resp.headers.get("X-Admission-Reason", str(resp.status))] += 1
                return
            if stream:
                async for line in resp.content:
                    if line.startswith(b"data: {") and has_token(json.loads(line[6:])):
                        stats.ttfts.append(time.monotonic() - started)
                        break
            await resp.read()
    except aiohttp.ClientError as exc:
        stats.refused[type(exc).__name__] += 1
        return
    stats.ok += 1
    stats.latencies.append(time.monotonic() - started)


async def _drive(url: str, duration_s: float, stats: dict[str, TenantStats], out: TextIO) -> None:
    rng = random.Random(42)
    connector = aiohttp.TCPConnector(limit=1000)
    async with aiohttp.ClientSession(connector=connector) as session:
        tasks: set[asyncio.Task[None]] = set()

        async def arrivals(flow: Flow) -> None:
            end = time.monotonic() + duration_s
            while time.monotonic() < end:
                await asyncio.sleep(rng.expovariate(flow.rate_per_s))
                task = asyncio.ensure_future(
                    _one_request(session, url, flow, rng, stats[flow.tenant])
                )
                tasks.add(task)
                task.add_done_callback(tasks.discard)

        producers = [asyncio.ensure_future(arrivals(flow)) for flow in FLOWS]
        await asyncio.gather(*producers)
        if tasks:
            await asyncio.wait(tasks, timeout=DRAIN_S)
        for task in tasks:
            task.cancel()


async def _progress(app: web.Application, stats: dict[str, TenantStats], out: TextIO) -> None:
    runtime = app[RUNTIME]
    started = time.monotonic()
    while True:
        await asyncio.sleep(1.0)
        sent = sum(s.sent for s in stats.values())
        ok = sum(s.ok for s in stats.values())
        refused = sum(sum(s.refused.values()) for s in stats.values())
        seats = " ".join(f"{r.name}={r.inflight}/{r.limit}" for r in runtime.pool.replicas)
        retried = sum(retries_by_reason(app).values())
        print(
            f"[{time.monotonic() - started:5.1f}s] sent {sent:5d}  ok {ok:5d}  "
            f"refused {refused:5d}  retried {retried:3d}  "
            f"queued {len(runtime.dispatcher.scheduler):3d}  seats {seats}",
            file=out,
            flush=True,
        )


def _pct(values: list[float], q: float) -> str:
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0] * 1000:.0f}"
    return f"{statistics.quantiles(values, n=100, method='inclusive')[int(q) - 1] * 1000:.0f}"


def summary_table(stats: dict[str, TenantStats], config: Config) -> str:
    rows = [
        "| tenant | class | sent | ok | refused (by reason) | p50 ms | p95 ms | TTFT p50 ms |",
        "|---|---|---:|---:|---|---:|---:|---:|",
    ]
    for tenant, s in stats.items():
        ended = [f"{r} {n}" for r, n in s.refused.most_common()]
        unfinished = s.sent - s.ok - sum(s.refused.values())
        if unfinished > 0:  # cut when the demo ended (still queued or running)
            ended.append(f"unfinished when the demo ended {unfinished}")
        reasons = ", ".join(ended) or "-"
        rows.append(
            f"| {tenant} | {config.tenants[tenant].priority} | {s.sent} | {s.ok} | {reasons} "
            f"| {_pct(s.latencies, 50)} | {_pct(s.latencies, 95)} | {_pct(s.ttfts, 50)} |"
        )
    return "\n".join(rows)


async def run_demo(
    duration_s: float = 20.0,
    config_path: str | None = None,
    out: TextIO = sys.stdout,
    fault_rate: float = DEMO_FAULT_RATE,
    mode: Mode | None = None,
) -> int:
    """``mode``: the config's ``mode`` overridden (``observe``: nothing is refused, and
    the summary says what enforcing would have refused)."""
    config = load_config(_find_config(config_path))
    if mode is not None:
        config = config.model_copy(update={"mode": mode})
    sims = [await start_sim(c) for c in sim_configs(len(config.replicas), fault_rate)]
    config = _with_replicas(config, sims)
    app = build_app(config, seed=0, access_log=False)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{bound_port(site)}"
    print(f"proxy on {url}; replicas: " + ", ".join(s.url for s in sims), file=out)
    print(
        f"{config.replicas[-1].name} answers {fault_rate:.0%} of its requests with "
        f"{DEMO_FAULT_STATUS}; the proxy retries them on another replica",
        file=out,
    )
    print(f"driving {duration_s:.0f} s of mixed traffic from 3 tenants...", file=out, flush=True)
    stats = {name: TenantStats() for name in config.tenants}
    progress = asyncio.ensure_future(_progress(app, stats, out))
    try:
        await _drive(url, duration_s, stats, out)
    finally:
        progress.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await progress
        await runner.cleanup()
        for sim in sims:
            await sim.close()
    print("\n" + summary_table(stats, config), file=out)
    print("\n" + retries_line(retries_by_reason(app)), file=out)
    if config.mode == "observe":
        print(observed_line(app), file=out)
        print(
            "\nmode: observe: every request was forwarded at once, above the seat limits "
            "where none was free; what enforcing would have refused is counted by reason "
            "(admission_observed_refusals_total, the access line's `observed`).",
            file=out,
        )
        return 0
    print(
        "\nThe fleet has 8 seats and is offered several times that: every refusal was "
        "answered with its reason (X-Admission-Reason; docs/REFERENCE.md lists them), "
        "never later than its tenant's queue budget, and the faulty replica's 503s were "
        "retried on the other one. Seats are shared by class and "
        "tenant weight in tokens, so analytics' long batch requests get few, large turns.",
        file=out,
    )
    return 0
