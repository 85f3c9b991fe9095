"""Degrade instead of refusing: a batch flood at 3x capacity, ``overload`` off and on.

**Question:** when batch traffic arrives at three times what the fleet can
serve, does capping batch requests' output (``overload.max_tokens_cap``,
applied while batch's budget pressure is above ``overload.at``) serve more
batch requests within their SLO, and what does it do to interactive TTFT?

**Setup.** Two ``admission-proxy sim`` replicas (the fairness benchmark's
engine: 10 ms decode step + 1.5 ms per running sequence, 8 slots) behind a
fresh ``admission-proxy serve`` per configuration, 4 seats per replica.
Tenants: ``chat`` (interactive, short answers: 8-24 tokens) and ``bulk``
(batch, long answers: 96-160 tokens; its queue budget 5 s). Capacity is
measured first: batch-shaped requests, closed loop, 4 per replica, straight
at the replicas. Then, per configuration, the same traffic (Poisson arrivals
seeded by flow name: identical in both runs): batch at 3x that capacity,
interactive at 1x that rate (its answers are a tenth as long: about a tenth
of the seats). *off*: ``max_tokens_cap: null``; *on*: ``max_tokens_cap: 32,
at: 0.8, classes: [batch]``. The two runs follow each other in one process,
on one fleet. Figures are given for the whole run and for the requests due
from 10 s on (the flood built up).

**Figures** (per configuration): batch requests served in full; batch
goodput: output tokens of batch requests served within the batch SLO
(TTFT <= 6 s, total <= 15 s) per second of the run; the share of batch
requests degraded; batch refusals by reason; interactive TTFT p50 / p99
over every interactive request sent (an unserved one counts as infinitely
late) and its SLO attainment (TTFT <= 250 ms). Tokens are the proxy's
access-log counts (what the replica streamed), not what was asked.

Run: ``.venv/bin/python -m bench.degradation`` (about two minutes).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from bench.common import access_log_requests, machine, revision, write_results
from bench.fairness_servers import Fleet, wait_ready, wait_sims_idle
from bench.fairness_traffic import PATH, Flow, Result, Shape, drive, send
from bench.load import load_session

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "degradation.json"

REPLICAS = 2
SEATS = 4
SIM_ARGS = ("--slots", "8", "--decode-base-ms", "10", "--decode-per-seq-ms", "1.5",
            "--prefill-ms-per-token", "0.05")  # fmt: skip
BATCH_SHAPE = Shape(prompt_words=(20, 80), max_tokens=(96, 160))
CHAT_SHAPE = Shape(prompt_words=(20, 80), max_tokens=(8, 24))
FLOOD_FACTOR = 3.0
CHAT_LOAD = 1.0
#: Figures are also given for requests due from here on: the flood built up,
#: batch's pressure (30 s window) past ``at`` in the "on" run.
STEADY_FROM_S = 10.0
CAP = 32
AT = 0.8
BATCH_TTFT_SLO_S, BATCH_TOTAL_SLO_S = 6.0, 15.0
CHAT_TTFT_SLO_S = 0.25
CALIBRATE_S, CALIBRATE_WARMUP_S = 6.0, 1.0
CLIENT_TIMEOUT_S = 30.0
CONNECTIONS = 4096
CHAT = Flow("chat", "chat", "sk-chat", 1.0)
BULK = Flow("bulk", "bulk", "sk-bulk", 1.0)


def proxy_config(urls: Sequence[str], cap: int | None) -> str:
    document: dict[str, Any] = {
        "server": {"host": "127.0.0.1"},
        "replicas": [
            {"name": f"sim-{i}", "url": url, "max_concurrency": SEATS}
            for i, url in enumerate(urls)
        ],
        "budgets": {"queue_ms": 2000, "first_byte_ms": 15000, "total_ms": 20000},
        "overload": {"max_tokens_cap": cap, "at": AT, "classes": ["batch"]},
        "tenants": {
            "chat": {"api_keys": [CHAT.api_key], "priority": "interactive", "queue_capacity": 64},
            "bulk": {"api_keys": [BULK.api_key], "priority": "batch", "queue_capacity": 256,
                     "budgets": {"queue_ms": 5000}},
        },
    }  # fmt: skip
    return yaml.safe_dump(document)


async def calibrate(session: aiohttp.ClientSession, urls: Sequence[str]) -> float:
    """Batch-shaped requests per second the seats serve (closed loop at the replicas)."""
    t0 = time.perf_counter()
    stop_at = t0 + CALIBRATE_WARMUP_S + CALIBRATE_S
    ended = 0
    headers = {"Content-Type": "application/json"}

    async def client(url: str, seed: int) -> None:
        nonlocal ended
        rng = random.Random(f"calibrate:{seed}")
        while time.perf_counter() < stop_at:
            body, prompt, output = BATCH_SHAPE.draw(rng)
            result = Result("calibration", "", time.perf_counter() - t0, prompt, output)
            await send(session, url + PATH, headers, body, result, t0)
            if not result.ok:
                raise RuntimeError(f"calibration request failed: {result.reason}")
            end = time.perf_counter() - t0
            if CALIBRATE_WARMUP_S <= end < stop_at - t0:
                ended += 1

    await asyncio.gather(*(client(u, i * SEATS + j) for i, u in enumerate(urls)
                           for j in range(SEATS)))  # fmt: skip
    return ended / CALIBRATE_S


@dataclass(slots=True)
class Run:
    label: str
    results: dict[str, list[Result]]
    log: dict[str, dict[str, Any]]
    seconds: float


def _p(values: list[float], q: float) -> float:
    """Nearest-rank percentile; ``inf`` counts (an unserved request)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def _within_slo(result: Result) -> bool:
    ttft, total = result.ttft_s, result.total_s
    return (
        ttft is not None and total is not None
        and ttft <= BATCH_TTFT_SLO_S and total <= BATCH_TOTAL_SLO_S
    )  # fmt: skip


def figures(run: Run, since_s: float = 0.0) -> dict[str, Any]:
    """The run's figures over the requests due from ``since_s`` on."""
    batch = [r for r in run.results["bulk"] if r.due_s >= since_s]
    chat = [r for r in run.results["chat"] if r.due_s >= since_s]
    seconds = run.seconds - since_s
    served = [r for r in batch if r.ok]
    good = [r for r in served if _within_slo(r)]
    good_tokens = sum(int(run.log.get(r.request_id, {}).get("output_tokens") or 0) for r in good)
    degraded = sum(run.log.get(r.request_id, {}).get("degraded") == "max_tokens" for r in batch)
    ttfts = [r.ttft_s if r.ok and r.ttft_s is not None else math.inf for r in chat]
    return {
        "batch_sent": len(batch),
        "batch_served": len(served),
        "batch_goodput_tokens_per_s": round(good_tokens / seconds, 1),
        "batch_good_requests": len(good),
        "batch_degraded_share": round(degraded / max(1, len(batch)), 3),
        "batch_refusals": dict(Counter(r.reason for r in batch if not r.ok)),
        "interactive_sent": len(chat),
        "interactive_ttft_p50_ms": round(_p(ttfts, 0.5) * 1000.0, 1),
        "interactive_ttft_p99_ms": round(_p(ttfts, 0.99) * 1000.0, 1),
        "interactive_slo_attainment": round(
            sum(t <= CHAT_TTFT_SLO_S for t in ttfts) / max(1, len(ttfts)), 4
        ),
    }


async def run_one(
    fleet: Fleet,
    control: aiohttp.ClientSession,
    load: aiohttp.ClientSession,
    label: str,
    config_yaml: str,
    capacity: float,
    seconds: float,
) -> Run:
    await wait_sims_idle(control, fleet.sims)
    proxy = await fleet.start_proxy(config_yaml)
    try:
        await wait_ready(control, proxy, "/readyz")
        chat = Flow(CHAT.name, CHAT.tenant, CHAT.api_key, CHAT_LOAD * capacity)
        bulk = Flow(BULK.name, BULK.tenant, BULK.api_key, FLOOD_FACTOR * capacity)
        drain = BATCH_TOTAL_SLO_S + 7.0
        chat_results, bulk_results = await asyncio.gather(
            drive(load, [chat], [proxy.url], CHAT_SHAPE, seconds, drain),
            drive(load, [bulk], [proxy.url], BATCH_SHAPE, seconds, drain),
        )
    finally:
        log_path = fleet.stop_proxy()
    text = log_path.read_text(encoding="utf-8", errors="replace") if log_path else ""
    log = {line["request_id"]: line for line in access_log_requests(text)}
    return Run(label, {"chat": chat_results, "bulk": bulk_results}, log, seconds)


def table(off: dict[str, Any], on: dict[str, Any]) -> str:
    rows = [
        ("batch requests sent", "batch_sent", "{:.0f}"),
        ("batch requests served in full", "batch_served", "{:.0f}"),
        ("batch requests within SLO", "batch_good_requests", "{:.0f}"),
        ("batch goodput (output tokens/s within SLO)", "batch_goodput_tokens_per_s", "{:.1f}"),
        ("batch requests degraded", "batch_degraded_share", "{:.1%}"),
        ("interactive TTFT p50 (ms)", "interactive_ttft_p50_ms", "{:.1f}"),
        ("interactive TTFT p99 (ms)", "interactive_ttft_p99_ms", "{:.1f}"),
        ("interactive SLO attainment", "interactive_slo_attainment", "{:.1%}"),
    ]
    lines = ["| figure | off | on | on / off |", "|---|---:|---:|---:|"]
    for name, key, fmt in rows:
        a, b = off[key], on[key]
        ratio = f"{b / a:.2f}" if isinstance(a, int | float) and a else ""
        lines.append(f"| {name} | {fmt.format(a)} | {fmt.format(b)} | {ratio} |")
    lines.append(f"| batch refusals | {off['batch_refusals']} | {on['batch_refusals']} | |")
    return "\n".join(lines)


async def bench(seconds: float, workdir: Path) -> dict[str, Any]:
    with Fleet(workdir) as fleet:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5.0)) as control,
            load_session(CONNECTIONS, total_s=CLIENT_TIMEOUT_S) as load,
        ):
            sims = await fleet.start_sims(REPLICAS, list(SIM_ARGS))
            for sim in sims:
                await wait_ready(control, sim, "/health")
            urls = [sim.url for sim in sims]
            capacity = await calibrate(load, urls)
            print(f"capacity: {capacity:.2f} batch req/s on {REPLICAS * SEATS} seats", flush=True)
            runs = {}
            for label, cap in (("off", None), ("on", CAP)):
                run = await run_one(
                    fleet, control, load, label, proxy_config(urls, cap), capacity, seconds
                )
                runs[label] = figures(run)
                runs[f"{label}_steady"] = figures(run, STEADY_FROM_S)
                print(f"  {label}: {json.dumps(runs[label])}", flush=True)
                print(f"  {label}, due from {STEADY_FROM_S:.0f} s: "
                      f"{json.dumps(runs[f'{label}_steady'])}", flush=True)  # fmt: skip
    return {"capacity_batch_rps": round(capacity, 2), "runs": runs}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=30.0, help="arrivals per run (30)")
    parser.add_argument("--output", type=Path, default=RESULTS, help="JSON results file")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-degradation-") as workdir:
        result = asyncio.run(bench(args.seconds, Path(workdir)))
    runs = result["runs"]
    print("whole run\n" + table(runs["off"], runs["on"]))
    print(f"\nrequests due from {STEADY_FROM_S:.0f} s on\n"
          + table(runs["off_steady"], runs["on_steady"]))  # fmt: skip
    result.update(
        seconds=args.seconds, revision=revision(), machine=machine("bench.degradation"),
        setup={"replicas": REPLICAS, "seats": SEATS, "sim_args": list(SIM_ARGS), "cap": CAP,
               "at": AT, "flood_factor": FLOOD_FACTOR, "chat_load": CHAT_LOAD,
               "steady_from_s": STEADY_FROM_S},
    )  # fmt: skip
    write_results(args.output, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
