"""Token quotas: what the bookkeeping costs per request, and how far a quota can be overrun.

Two parts, one run:

- **cost**: the overhead benchmark's load (small non-streaming chat
  completions, closed loop) against the pass-through, the proxy as it ships
  (``proxy``) and the same proxy whose tenant has a ``token_quota``
  (``proxy+quota``: every request charged, settled, its ``x-ratelimit-*``
  headers written), each a child process, rounds rotating the order. The
  quota's cost is the CPU per request of ``proxy+quota`` less ``proxy``'s in
  the same round (median over rounds), beside the pass-through's figure.
- **overrun**: 64 clients each streaming chat completions (no
  ``include_usage``: the proxy asks for it) through an in-process proxy to two
  in-process simulated replicas until the tenant's day quota refuses them.
  Tokens served are the replicas' own counts (prompt + generated); the
  overrun is what they served beyond the quota. The proxy's policy (charge
  the estimate at admission, settle at the end) runs beside a baseline that
  charges only when a request ends (admits while anything is left), on the
  same workload. The bound for the proxy is what requests generated beyond
  their estimates (the access log's ``quota_actual_tokens`` over
  ``quota_charged_tokens``): target 0 beyond it.

    .venv/bin/python -m bench.quota [--requests 4000] [--warmup 500] [--rounds 3]
        [--quota 60000] [--repeats 2]
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp
import uvloop
import yaml
from aiohttp import web

from bench.common import access_log_requests, cpu_line, machine, revision, write_results
from bench.load import load_session
from bench.overhead import API_KEY, TENANT, Run, measure
from bench.processes import (
    Server,
    free_port,
    start_server,
    start_upstream_and_passthrough,
    stop_server,
    wait_ready,
)
from proxy.app import build_app
from proxy.clock import FakeClock
from proxy.settings import load_config, parse_config
from proxy.sim import SimConfig, SimServer, start_sim
from proxy.state.quota import (
    Charge,
    LocalTokenQuotas,
    QuotaLimits,
    QuotaRefused,
    QuotaRemaining,
    TokenQuotaStore,
)

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "quota.json"
TARGETS = ("passthrough", "proxy", "proxy+quota")
PROXY_SEATS = 64
#: A quota no request of the cost part reaches: every request is charged and settled.
NEVER_REACHED = 10**12
READY_TIMEOUT_S = 20.0
#: The overrun part: clients, replicas and their seats, the workload's output lengths.
CLIENTS = 64
SIM_SLOTS = 32
MIN_TOKENS, MAX_TOKENS = 16, 256
#: A quarter of the requests name no ``max_tokens``: the tenant's mean output is charged.
NO_LIMIT_SHARE = 0.25
SIM_DEFAULT_MAX_TOKENS = 128
#: A UTC noon: the quota's day cannot end mid-run (the quotas' clock is fixed).
NOON = 1_796_126_400.0
OVERRUN_CAP_S = 120.0
#: A refused client tries again this much later while others are still streaming.
RETRY_PAUSE_S = 0.02
PROMPT = "Summarise the quarterly report for the board in plain words. " * 3


class ChargeAtEnd:
    """The baseline: admits while the quota has anything left and charges a request only
    when it ends (how gateways that count a stream's tokens after it ends behave)."""

    __slots__ = ("_inner",)

    def __init__(self, inner: TokenQuotaStore) -> None:
        self._inner = inner

    async def charge(
        self, tenant: str, estimate: int, limits: QuotaLimits
    ) -> Charge | QuotaRefused:
        probe = await self._inner.charge(tenant, 1, limits)
        if isinstance(probe, QuotaRefused):
            return probe
        left = await self._inner.correct(probe, 0)
        return Charge(tenant, 0, probe.day, limits, left)

    async def correct(self, charge: Charge, actual: int) -> QuotaRemaining:
        return await self._inner.correct(charge, actual)

    async def remaining(self, tenant: str, limits: QuotaLimits) -> QuotaRemaining:
        return await self._inner.remaining(tenant, limits)


# -- cost ----------------------------------------------------------------------------


def _proxy_config(workdir: Path, port: int, upstream_url: str, quota: bool) -> Path:
    tenant: dict[str, Any] = {"api_keys": [API_KEY], "queue_capacity": PROXY_SEATS}
    if quota:
        tenant["token_quota"] = {"per_minute": NEVER_REACHED, "per_day": NEVER_REACHED}
    document = {
        "server": {"host": "127.0.0.1", "port": port},
        "replicas": [{"name": "fast", "url": upstream_url, "max_concurrency": PROXY_SEATS}],
        "tenants": {TENANT: tenant},
    }
    path = workdir / f"proxy-{port}.yaml"
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    load_config(path)
    return path


@contextmanager
def cost_servers(workdir: Path) -> Iterator[dict[str, Server]]:
    started: list[Server] = []
    python = sys.executable
    command = str(Path(python).parent / "admission-proxy")
    try:
        upstream = start_upstream_and_passthrough(workdir, started, "direct")
        for name, quota in (("proxy", False), ("proxy+quota", True)):
            port = free_port()
            config = _proxy_config(workdir, port, upstream.url, quota)
            started.append(start_server(
                name, [command, "serve", "--config", str(config)], port, "/readyz", workdir,
            ))  # fmt: skip
        yield {s.name: s for s in started}
    finally:
        for server in reversed(started):
            stop_server(server)


async def cost(args: argparse.Namespace, running: dict[str, Server]) -> list[Run]:
    async with aiohttp.ClientSession() as probe:
        for server in running.values():
            await wait_ready(probe, server, READY_TIMEOUT_S)
    runs = []
    for round_no in range(args.rounds):
        shift = round_no % len(TARGETS)
        for target in TARGETS[shift:] + TARGETS[:shift]:
            run = await measure(target, round_no, running, args, None)
            runs.append(run)
            print(
                f"  round {round_no} {target:<12} {run.rps:7.0f} req/s  p50 {run.p50_ms:6.2f} ms"
                f"  cpu {run.front_cpu_ms:.3f} ms/req  errors {run.error_kinds or 0}",
                flush=True,
            )
    return runs


def cost_summary(runs: Sequence[Run]) -> dict[str, Any]:
    def median(target: str, field: str) -> float:
        return float(statistics.median(getattr(r, field) for r in runs if r.target == target))

    by_round: dict[int, dict[str, Run]] = {}
    for r in runs:
        by_round.setdefault(r.round, {})[r.target] = r
    added = [rd["proxy+quota"].front_cpu_ms - rd["proxy"].front_cpu_ms for rd in by_round.values()]
    added_p50 = [rd["proxy+quota"].p50_ms - rd["proxy"].p50_ms for rd in by_round.values()]
    errors = sum(r.errors for r in runs)
    return {
        "targets": {
            t: {f: median(t, f) for f in ("rps", "p50_ms", "p99_ms", "front_cpu_ms")}
            for t in TARGETS
        },
        "quota_cpu_ms_per_request": statistics.median(added),
        "quota_cpu_share_of_proxy": statistics.median(added) / median("proxy", "front_cpu_ms"),
        "quota_added_p50_ms": statistics.median(added_p50),
        "errors": errors,
    }


# -- overrun --------------------------------------------------------------------------


@dataclass(slots=True)
class Overrun:
    policy: str
    repeat: int
    quota: int
    served: int
    overrun: int
    #: What requests used beyond what they were charged at admission (the bound).
    beyond_estimates: int
    completed: int
    refused: int
    elapsed_s: float


def _body(rng: random.Random) -> bytes:
    doc: dict[str, Any] = {
        "model": "sim",
        "messages": [{"role": "user", "content": PROMPT}],
        "stream": True,
    }
    if rng.random() >= NO_LIMIT_SHARE:
        doc["max_tokens"] = rng.randint(MIN_TOKENS, MAX_TOKENS)
    return json.dumps(doc).encode()


async def _client(
    session: aiohttp.ClientSession, url: str, rng: random.Random, counts: dict[str, int]
) -> None:
    """Streams until the quota refuses it with nothing in flight anywhere: a refusal while
    others run may be followed by room (their settlements refund what they did not use),
    so the quota is pushed as far as it lets anyone go. Bounded by the run's cap."""
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    while True:
        counts["inflight"] += 1
        try:
            async with session.post(url, data=_body(rng), headers=headers) as response:
                await response.read()
                status = response.status
        finally:
            counts["inflight"] -= 1
        if status == 429:
            counts["refused"] += 1
            if counts["inflight"] == 0:
                return
            await asyncio.sleep(RETRY_PAUSE_S)
            continue
        counts["completed" if status == 200 else "failed"] += 1


def _sim_tokens(sims: Sequence[SimServer]) -> int:
    return sum(s.engine.stats().prompt_tokens + s.engine.stats().tokens_generated for s in sims)


async def overrun_once(policy: str, repeat: int, quota: int) -> Overrun:
    sims = [
        await start_sim(SimConfig(
            slots=SIM_SLOTS, decode_base_ms=1.0, decode_per_seq_ms=0.02,
            prefill_ms_per_token=0.0, default_max_tokens=SIM_DEFAULT_MAX_TOKENS, seed=i,
        ))
        for i in range(2)
    ]  # fmt: skip
    log = io.StringIO()
    document = {
        "replicas": [
            {"name": f"sim{i}", "url": s.url, "max_concurrency": SIM_SLOTS}
            for i, s in enumerate(sims)
        ],
        "tenants": {
            TENANT: {
                "api_keys": [API_KEY],
                "queue_capacity": CLIENTS,
                "token_quota": {"per_day": quota},
            }
        },
    }
    clock = FakeClock(start=NOON)
    inner = LocalTokenQuotas(clock)
    store: TokenQuotaStore = inner if policy == "admission" else ChargeAtEnd(inner)
    app = build_app(
        parse_config(yaml.safe_dump(document)), quota_clock=clock, quota_store=store,
        access_log=log, seed=repeat,
    )  # fmt: skip
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    port = free_port()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    counts = {"completed": 0, "refused": 0, "failed": 0, "inflight": 0}
    try:
        async with load_session(CLIENTS) as session:
            await wait_ready_url(session, f"http://127.0.0.1:{port}/readyz")
            before = _sim_tokens(sims)
            started = time.monotonic()
            rngs = [random.Random(repeat * 1000 + i) for i in range(CLIENTS)]
            async with asyncio.timeout(OVERRUN_CAP_S):
                await asyncio.gather(*(_client(session, url, rng, counts) for rng in rngs))
            elapsed = time.monotonic() - started
            served = _sim_tokens(sims) - before
    finally:
        await runner.cleanup()
        for sim in sims:
            await sim.close()
    lines = [r for r in access_log_requests(log.getvalue()) if r.get("status") == 200]
    beyond = sum(
        max(0, r["quota_actual_tokens"] - r["quota_charged_tokens"])
        for r in lines
        if r.get("quota_charged_tokens") is not None and policy == "admission"
    )
    if counts["failed"]:
        raise RuntimeError(f"{policy}: {counts['failed']} requests failed")
    return Overrun(
        policy, repeat, quota, served, served - quota, beyond, counts["completed"],
        counts["refused"], round(elapsed, 2),
    )  # fmt: skip


async def wait_ready_url(session: aiohttp.ClientSession, url: str) -> None:
    async with asyncio.timeout(READY_TIMEOUT_S):
        while True:
            try:
                async with session.get(url) as response:
                    if response.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.05)


async def overruns(args: argparse.Namespace) -> list[Overrun]:
    results = []
    for repeat in range(args.repeats):
        for policy in ("admission", "charge_at_end"):
            result = await overrun_once(policy, repeat, args.quota)
            results.append(result)
            print(
                f"  {policy:<14} repeat {repeat}: served {result.served} of {result.quota}"
                f" (overrun {result.overrun:+d}; beyond estimates {result.beyond_estimates});"
                f" {result.completed} streams, {result.refused} refused, {result.elapsed_s} s",
                flush=True,
            )
    return results


# -- report ---------------------------------------------------------------------------


def report(summary: dict[str, Any], results: Sequence[Overrun]) -> str:
    t = summary["targets"]
    lines = [
        "| target | req/s | p50 ms | CPU ms/request |",
        "|---|---|---|---|",
        *(
            f"| {name} | {t[name]['rps']:.0f} | {t[name]['p50_ms']:.2f} |"
            f" {t[name]['front_cpu_ms']:.3f} |"
            for name in TARGETS
        ),
        "",
        f"quota bookkeeping: {summary['quota_cpu_ms_per_request'] * 1000:.0f} us CPU per request"
        f" ({summary['quota_cpu_share_of_proxy']:.1%} of the proxy's),"
        f" added p50 {summary['quota_added_p50_ms']:+.2f} ms",
        "",
        "| policy | repeat | quota | served | overrun | beyond estimates | streams |",
        "|---|---|---|---|---|---|---|",
        *(
            f"| {r.policy} | {r.repeat} | {r.quota} | {r.served} | {r.overrun:+d} |"
            f" {r.beyond_estimates} | {r.completed} |"
            for r in results
        ),
    ]
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.quota", description=__doc__)
    add = parser.add_argument
    add("--requests", type=int, default=4000, help="measured requests per cost run")
    add("--warmup", type=int, default=500, help="unmeasured requests before each cost run")
    add("--concurrency", type=int, default=32, help="cost runs' closed-loop clients")
    add("--rounds", type=int, default=3, help="cost rounds; target order rotates")
    add("--quota", type=int, default=60_000, help="the overrun part's day quota (tokens)")
    add("--repeats", type=int, default=2, help="overrun runs per policy")
    add("--output", type=Path, default=RESULTS, help="JSON results file")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    print(cpu_line(), flush=True)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench-quota-") as tmp:
        print("cost (closed loop):", flush=True)
        with cost_servers(Path(tmp)) as running:
            runs = uvloop.run(cost(args, running))
    summary = cost_summary(runs)
    print(f"overrun ({CLIENTS} concurrent streams, two simulated replicas):", flush=True)
    results = uvloop.run(overruns(args))
    print()
    print(report(summary, results))
    write_results(
        args.output,
        {
            "benchmark": "quota",
            "command": "python -m bench.quota " + " ".join(sys.argv[1:] if argv is None else argv),
            "revision": revision(),
            "machine": machine("load generator, proxies and upstreams share the same CPUs"),
            "wall_s": round(time.monotonic() - started, 1),
            "cost": summary,
            "overrun": [asdict(r) for r in results],
            "runs": [asdict(r) for r in runs],
        },
    )
    print(f"\nresults: {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
