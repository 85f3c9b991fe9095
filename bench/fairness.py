"""Fairness benchmark (issue 3): noisy neighbour and priority isolation.

End to end on the simulator: two simulated replicas (``admission-proxy sim``)
with the same seats in every scenario, this proxy (``admission-proxy serve``,
a fresh process per scenario, one config for all), and open-loop Poisson
flows of streamed chat requests whose TTFT is measured at the client. Rates
are fractions of the fleet's capacity, measured at the start of the run.

Scenarios, each ``--seconds`` long after a warm-up:

noisy neighbour (two ``standard`` tenants of equal weight)
  1. the victim alone, at ``VICTIM_LOAD`` of capacity;
  2. the victim next to a well-behaved neighbour at the victim's own rate;
  3. the victim next to an aggressor at ten times the victim's rate;
  4. scenario 3 sent straight to the replicas (random choice), no proxy.

priority isolation (an ``interactive`` tenant and a ``batch`` tenant)
  5. interactive at the victim's rate next to batch at the same modest rate;
  6. the same interactive flow next to a batch flood at ten times that rate;
  7. scenario 6 without the proxy;
  8. both classes backlogged (interactive offering more than the whole
     fleet, batch flooding): batch's share of the served tokens against its
     weighted share, 1 / (8 + 1) with the default class weights.

Every scenario through the proxy runs twice, in two configurations, each
twin right after its plain one: "no headroom" (seats at the knee only, the
config of the earlier runs) and "with headroom", where each replica offers
``--headroom`` seats above its knee (default 4) that only a tenant below its
fair share may take (``RecentUsage`` in ``proxy/estimators.py``); ``--tenant-cap N`` adds the same
``max_concurrency`` for every tenant to that second configuration. The
simulated engines have room for the headroom in both configurations
(``SLOTS + headroom`` slots each), as a vLLM engine has far more sequence
slots than its knee. A figure's two sides always ran under the same
configuration; the scenarios without a proxy have no config and are
contrasted with the plain ones. What the headroom costs is reported as the
total served req/s and tokens/s of the flood scenarios, against the plain
configuration.

Targets, judged for each configuration: the victim's p99
TTFT next to the aggressor over its p99 next to the well-behaved neighbour at
most 1.2 (the issue's "against the victim alone" is reported beside it), the
victim's SLO attainment at least 99%; likewise interactive with and without
the flood; batch at least 90% of its weighted share. Each p99 ratio comes
with a bootstrap interval.

To tell the scheduler's part from the fleet's, the protected flow's queue
wait is split with the proxy's access log (``bench.fairness_accesslog``):
the wait for the first seat to free after it arrived, which no ordering can
avoid while the aggressor keeps every seat busy (the proxy never preempts),
and the tickets of other tenants dispatched ahead of it. "If always first in
line" re-computes its p99 with only the first part: what a perfect ordering
could reach on this fleet. The load generator's lateness and every
process's CPU time are kept in the JSON as the noise check.

    .venv/bin/python -m bench.fairness [--seconds N] [--quick] [--victim-load F]
        [--tenant-cap N] [--only SCENARIO ...] [--output PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import math
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp
import uvloop
import yaml

from bench.common import cpu_line, machine, own_cpu, write_results
from bench.fairness_accesslog import Wait, waits
from bench.fairness_accesslog import read as read_access_log
from bench.fairness_report import (
    CapsCost,
    Figure,
    FlowStats,
    Slo,
    WaitSplit,
    caps_cost,
    caps_cost_table,
    due_in,
    figure_table,
    flow_stats,
    flow_table,
    ideal_ttfts,
    p99_ratio,
    ttft_all,
    value_p99_ratio,
    wait_split,
    wait_table,
)
from bench.fairness_servers import Fleet, wait_ready, wait_sims_idle
from bench.fairness_traffic import PATH, Flow, Result, Shape, drive, send
from bench.load import load_session
from bench.processes import cpu_seconds
from proxy.settings import ConfigError, parse_config

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "fairness.json"

# -- the fleet: the same seats in every scenario ----------------------------------------

REPLICAS = 2
#: The proxy's ``max_concurrency`` per replica (the knee). The engine has room
#: for the headroom seats on top (``--headroom``), so the proxy, not the engine,
#: does the queueing.
SLOTS = 4
#: Seats above the knee per replica in the "with headroom" configuration.
HEADROOM = 4
#: The simulator's defaults, written out: a 10 ms decode step plus 1.5 ms per
#: running sequence, prefill at 0.05 ms per prompt token.
SIM_ARGS = ("--decode-base-ms", "10", "--decode-per-seq-ms", "1.5",
            "--prefill-ms-per-token", "0.05")  # fmt: skip
#: Every flow draws from the same sizes: 30 to 120 prompt tokens, 8 to 24 out.
SHAPE = Shape(prompt_words=(20, 80), max_tokens=(8, 24))

# -- the traffic ------------------------------------------------------------------------

#: The victim's (and interactive's) rate as a share of measured capacity; its
#: well-behaved neighbour sends as much again, so that baseline runs at 60%.
VICTIM_LOAD = 0.3
AGGRESSOR_FACTOR = 10.0
#: Interactive's rate in the both-backlogged scenario, as a share of capacity:
#: above its 8/9 share, so its queue never empties.
BACKLOGGED_INTERACTIVE_LOAD = 1.5
CLASS_WEIGHTS = {"interactive": 8, "standard": 3, "batch": 1}

#: The victim's SLO, met with room to spare alone: TTFT about 7x its p99 alone
#: (about 35 ms on this fleet), total about 6x (about 0.33 s).
SLO = Slo(ttft_ms=250.0, total_ms=2000.0)

# -- targets ----------------------------------------------------------------------------

MAX_P99_RATIO = 1.2
MIN_ATTAINMENT = 0.99
MIN_SHARE_OF_WEIGHTED = 0.9

# -- timing -----------------------------------------------------------------------------

DEFAULT_SECONDS = 15.0
WARMUP_S = 2.0
QUICK_SECONDS = 2.0
QUICK_WARMUP_S = 1.0
#: After the last arrival, open requests get this long, then are cut (``unfinished``).
DRAIN_S = 5.0
QUICK_DRAIN_S = 1.0
#: Each request's own client timeout: longer than any queue budget plus service.
CLIENT_TIMEOUT_S = 10.0
CALIBRATE_WARMUP_S = 1.0
CALIBRATE_S = 3.0
QUICK_CALIBRATE_S = 1.0
STATE_SAMPLE_S = 0.1
#: Load-generator connections: open-loop requests must never wait for one.
CONNECTIONS = 4096

# -- tenants (one proxy config per configuration) --------------------------------------

KEYS = {
    "victim": "sk-fair-victim",
    "other": "sk-fair-other",
    "chat": "sk-fair-chat",
    "bulk": "sk-fair-bulk",
}
QUEUE_CAPACITY = 64
QUEUE_MS = 2000
BATCH_QUEUE_MS = 5000


def proxy_config(sim_urls: Sequence[str], tenant_cap: int | None = None, headroom: int = 0) -> str:
    """The proxy's YAML: both replicas at ``SLOTS`` seats, four tenants.

    ``tenant_cap``: every tenant's ``max_concurrency`` (None: no cap, the
    default); ``headroom``: each replica's seats above the knee.
    """
    tenant: dict[str, Any] = {"weight": 1, "queue_capacity": QUEUE_CAPACITY}
    if tenant_cap is not None:
        tenant["max_concurrency"] = tenant_cap
    document = {
        "server": {"host": "127.0.0.1"},
        "replicas": [
            {"name": f"sim-{i}", "url": url, "max_concurrency": SLOTS, "headroom": headroom}
            for i, url in enumerate(sim_urls)
        ],
        "budgets": {"queue_ms": QUEUE_MS, "first_byte_ms": 10_000, "total_ms": 30_000},
        "priorities": {name: {"weight": w} for name, w in CLASS_WEIGHTS.items()},
        "tenants": {
            # Equal in everything: the neighbour and the aggressor are the same tenant.
            "victim": {**tenant, "api_keys": [KEYS["victim"]], "priority": "standard"},
            "other": {**tenant, "api_keys": [KEYS["other"]], "priority": "standard"},
            "chat": {**tenant, "api_keys": [KEYS["chat"]], "priority": "interactive"},
            "bulk": {**tenant, "api_keys": [KEYS["bulk"]], "priority": "batch",
                     "budgets": {"queue_ms": BATCH_QUEUE_MS}},
        },
    }  # fmt: skip
    text = yaml.safe_dump(document, sort_keys=False)
    parse_config(text)  # a bad config fails here, not as a proxy that never gets ready
    return text


# -- scenarios --------------------------------------------------------------------------


#: A protected scenario's key is its plain twin's plus this.
CAPPED = "-headroom"
#: The scenarios that run through the proxy also run "with headroom";
#: the ones without a proxy have no config to change.
CAPPED_TWINS = ("alone", "neighbour", "aggressor", "batch-modest", "batch-flood", "backlogged")
SCENARIO_KEYS = ("alone", "neighbour", "aggressor", "aggressor-direct",
                 "batch-modest", "batch-flood", "batch-flood-direct", "backlogged",
                 *(key + CAPPED for key in CAPPED_TWINS))  # fmt: skip
#: The two configurations, as the report names them.
NO_CAPS = "no headroom"
WITH_CAPS = "with headroom"


@dataclass(frozen=True, slots=True)
class Scenario:
    key: str
    group: str
    title: str
    via_proxy: bool
    flows: tuple[Flow, ...]
    #: The flow whose queue wait is split with the access log (the victim, interactive).
    protected: str | None = None
    #: Sample the proxy's queues (``/admin/state``) to show both classes stayed backlogged.
    sample_queues: bool = False
    #: Run with the second config ("with headroom", maybe tenant caps too).
    capped: bool = False

    @property
    def label(self) -> str:
        return f"{self.title}, headroom" if self.capped else self.title

    @property
    def variant(self) -> str:
        return WITH_CAPS if self.capped else NO_CAPS

    def with_caps(self) -> Scenario:
        return replace(self, key=self.key + CAPPED, capped=True)


def scenarios(capacity_rps: float, victim_load: float = VICTIM_LOAD) -> list[Scenario]:
    """Every scenario in running order: each capped twin right after its uncapped one,
    so that the two configurations meet the machine in the same state."""
    ordered: list[Scenario] = []
    for scenario in _uncapped_scenarios(capacity_rps, victim_load):
        ordered.append(scenario)
        if scenario.key in CAPPED_TWINS:
            ordered.append(scenario.with_caps())
    return ordered


def _uncapped_scenarios(capacity_rps: float, victim_load: float) -> list[Scenario]:
    base = victim_load * capacity_rps
    flood = AGGRESSOR_FACTOR * base
    victim = Flow("victim", "victim", KEYS["victim"], base)
    neighbour = Flow("neighbour", "other", KEYS["other"], base)
    aggressor = Flow("aggressor", "other", KEYS["other"], flood)
    interactive = Flow("interactive", "chat", KEYS["chat"], base)
    batch = Flow("batch", "bulk", KEYS["bulk"], base)
    batch_flood = Flow("batch-flood", "bulk", KEYS["bulk"], flood)
    backlogged = Flow(
        "interactive-flood", "chat", KEYS["chat"], BACKLOGGED_INTERACTIVE_LOAD * capacity_rps
    )
    nn, pi = "noisy neighbour", "priority isolation"
    return [
        Scenario("alone", nn, "victim alone", True, (victim,), protected="victim"),
        Scenario("neighbour", nn, "next to a well-behaved neighbour", True,
                 (victim, neighbour), protected="victim"),
        Scenario("aggressor", nn, "next to a 10x aggressor", True,
                 (victim, aggressor), protected="victim"),
        Scenario("aggressor-direct", nn, "10x aggressor, no proxy", False,
                 (victim, aggressor)),
        Scenario("batch-modest", pi, "batch at a modest rate", True,
                 (interactive, batch), protected="interactive"),
        Scenario("batch-flood", pi, "batch flood", True,
                 (interactive, batch_flood), protected="interactive"),
        Scenario("batch-flood-direct", pi, "batch flood, no proxy", False,
                 (interactive, batch_flood)),
        Scenario("backlogged", pi, "both classes backlogged", True,
                 (backlogged, batch_flood), sample_queues=True),
    ]  # fmt: skip


# -- measuring --------------------------------------------------------------------------


@dataclass(slots=True)
class Capacity:
    """The fleet's throughput with every seat busy, measured straight at the replicas."""

    rps: float
    service_ms: float
    seats: int

    @property
    def seat_free_interval_ms(self) -> float:
        """Mean time between two seats freeing up while the fleet is saturated."""
        return 1000.0 / self.rps


@dataclass(frozen=True, slots=True)
class Timing:
    """How long each part of the run lasts (full or ``--quick``)."""

    warmup_s: float
    seconds: float
    drain_s: float
    calibrate_s: float


async def calibrate(
    session: aiohttp.ClientSession, sim_urls: Sequence[str], seconds: float
) -> Capacity:
    """``SLOTS`` closed-loop clients per replica, pinned, for ``seconds`` after a warm-up."""
    t0 = time.perf_counter()
    stop_at = t0 + CALIBRATE_WARMUP_S + seconds
    done: list[Result] = []
    headers = {"Content-Type": "application/json"}

    async def client(url: str, seed: int) -> None:
        rng = random.Random(f"calibrate:{seed}")
        while time.perf_counter() < stop_at:
            body, prompt, output = SHAPE.draw(rng)
            result = Result("calibration", "", time.perf_counter() - t0, prompt, output)
            await send(session, url + PATH, headers, body, result, t0)
            if not result.ok:
                raise RuntimeError(f"calibration request failed: {result.reason}")
            done.append(result)

    await asyncio.gather(
        *(client(url, i * SLOTS + j) for i, url in enumerate(sim_urls) for j in range(SLOTS))
    )
    window = [r for r in done if r.due_s >= CALIBRATE_WARMUP_S and r.total_s is not None]
    ended = [
        r for r in done
        if r.total_s is not None and CALIBRATE_WARMUP_S <= r.due_s + r.total_s < stop_at - t0
    ]  # fmt: skip
    service = sum(r.total_s for r in window if r.total_s is not None) / max(1, len(window))
    return Capacity(
        rps=round(len(ended) / seconds, 2),
        service_ms=round(service * 1000.0, 1),
        seats=SLOTS * len(sim_urls),
    )


@dataclass(slots=True)
class Run:
    """One scenario's raw results and the context needed to judge them."""

    scenario: Scenario
    results: dict[str, list[Result]]
    window: tuple[float, float]
    cpu_s: dict[str, float]
    elapsed_s: float
    #: The machine's 1-minute load average at the end: other work running beside us.
    load_avg: float
    #: ``(seconds, queued per tenant)`` samples of the proxy's queues.
    queue_samples: list[tuple[float, dict[str, int]]] = field(default_factory=list)
    #: The protected flow's queue waits, split (request id to ``Wait``).
    waits: dict[str, Wait] = field(default_factory=dict)
    #: The proxy's ``/admin/state`` as the last arrival was due: replicas and
    #: tenants in flight and queued, to tell a stalled proxy from a slow one.
    state_at_end: dict[str, Any] | None = None


async def _sample_queues(
    session: aiohttp.ClientSession, url: str, out: list[tuple[float, dict[str, int]]], t0: float
) -> None:
    while True:
        with contextlib.suppress(aiohttp.ClientError, ValueError):
            async with session.get(url + "/admin/state") as response:
                state = await response.json()
            queued = {name: int(t["queued"]) for name, t in state["tenants"].items()}
            out.append((time.perf_counter() - t0, queued))
        await asyncio.sleep(STATE_SAMPLE_S)


async def _state_at(
    session: aiohttp.ClientSession, url: str, at: float, out: list[dict[str, Any]]
) -> None:
    """One ``/admin/state`` at ``at`` (``perf_counter`` time), into ``out``."""
    await asyncio.sleep(max(0.0, at - time.perf_counter()))
    with contextlib.suppress(aiohttp.ClientError, ValueError, TimeoutError):
        async with session.get(url + "/admin/state") as response:
            out.append(await response.json())


async def run_scenario(
    fleet: Fleet,
    control: aiohttp.ClientSession,
    load: aiohttp.ClientSession,
    scenario: Scenario,
    config_yaml: str,
    timing: Timing,
    instances: int = 1,
) -> Run:
    """One scenario; through ``instances`` proxies with this config when it goes via the
    proxy (several need ``state.backend: redis``), each request to one of them at random."""
    targets = [sim.url for sim in fleet.sims]
    if scenario.via_proxy:
        proxies = await fleet.start_proxies(config_yaml, instances)
        for proxy in proxies:
            await wait_ready(control, proxy, "/readyz")
        targets = [proxy.url for proxy in proxies]
    pids = {f"sim-{i}": sim.process.pid for i, sim in enumerate(fleet.sims)}
    for i, proxy in enumerate(fleet.proxies):
        pids["proxy" if len(fleet.proxies) == 1 else f"proxy-{i}"] = proxy.process.pid
    before = {name: cpu_seconds(pid) for name, pid in pids.items()} | {"loadgen": own_cpu()}
    samples: list[tuple[float, dict[str, int]]] = []
    sampler: asyncio.Task[None] | None = None
    end_state: list[dict[str, Any]] = []
    snapshot: asyncio.Task[None] | None = None
    t0 = time.perf_counter()
    if scenario.sample_queues and fleet.proxy is not None:
        sampler = asyncio.create_task(_sample_queues(control, fleet.proxy.url, samples, t0))
    if fleet.proxy is not None:
        end = t0 + timing.warmup_s + timing.seconds - STATE_SAMPLE_S
        snapshot = asyncio.create_task(_state_at(control, fleet.proxy.url, end, end_state))
    try:
        results = await drive(
            load, scenario.flows, targets, SHAPE, timing.warmup_s + timing.seconds, timing.drain_s
        )
    finally:
        for task in (sampler, snapshot):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        after = {name: cpu_seconds(pid) for name, pid in pids.items()} | {"loadgen": own_cpu()}
        access_logs = fleet.stop_proxies()
    elapsed = time.perf_counter() - t0
    await wait_sims_idle(control, fleet.sims)
    by_flow: dict[str, list[Result]] = {flow.name: [] for flow in scenario.flows}
    for result in results:
        by_flow[result.flow].append(result)
    window = (timing.warmup_s, timing.warmup_s + timing.seconds)
    split: dict[str, Wait] = {}
    if scenario.protected is not None and access_logs:
        measured = due_in(by_flow[scenario.protected], *window)
        entries = {k: v for path in access_logs for k, v in read_access_log(path).items()}
        split = waits(entries, [r.request_id for r in measured])
    return Run(
        scenario=scenario,
        results=by_flow,
        window=window,
        cpu_s={name: round(after[name] - before[name], 2) for name in before},
        elapsed_s=round(elapsed, 1),
        load_avg=round(os.getloadavg()[0], 2),
        queue_samples=[(t, q) for t, q in samples if window[0] <= t < window[1]],
        waits=split,
        state_at_end=end_state[0] if end_state else None,
    )


async def bench(
    args: argparse.Namespace, timing: Timing, workdir: Path
) -> tuple[Capacity, list[Run]]:
    with Fleet(workdir) as fleet:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5.0)) as control,
            load_session(CONNECTIONS, total_s=CLIENT_TIMEOUT_S) as load,
        ):
            sim_args = ["--slots", str(SLOTS + args.headroom), *SIM_ARGS]
            sims = await fleet.start_sims(REPLICAS, sim_args)
            for sim in sims:
                await wait_ready(control, sim, "/health")
            urls = [sim.url for sim in sims]
            capacity = await calibrate(load, urls, timing.calibrate_s)
            print(
                f"capacity: {capacity.rps:.1f} req/s with {capacity.seats} seats "
                f"(mean service {capacity.service_ms:.0f} ms; a seat frees every "
                f"{capacity.seat_free_interval_ms:.0f} ms when saturated)",
                flush=True,
            )
            await wait_sims_idle(control, sims)
            configs = {
                False: proxy_config(urls),
                True: proxy_config(urls, args.tenant_cap, args.headroom),
            }
            runs: list[Run] = []
            for scenario in scenarios(capacity.rps, args.victim_load):
                if args.only and scenario.key not in args.only:
                    continue
                config_yaml = configs[scenario.capped]
                run = await run_scenario(fleet, control, load, scenario, config_yaml, timing)
                runs.append(run)
                print(_progress_line(run), flush=True)
    return capacity, runs


def _progress_line(run: Run) -> str:
    parts = []
    for name, results in run.results.items():
        measured = due_in(results, *run.window)
        ok = sum(r.ok for r in measured)
        parts.append(f"{name} {ok}/{len(measured)} ok")
    cpu = sum(run.cpu_s.values()) / run.elapsed_s
    if run.scenario.via_proxy and not any(r.ok for rs in run.results.values() for r in rs):
        parts.append(f"NOTHING SERVED: proxy state at the end {run.state_at_end}")
    return (
        f"  {run.scenario.group}: {run.scenario.label:<46} {', '.join(parts)}"
        f"  ({run.elapsed_s:.0f} s, {cpu:.2f} CPUs busy with us, load avg {run.load_avg:.1f})"
    )


# -- figures ----------------------------------------------------------------------------


def _stats(run: Run) -> dict[str, FlowStats]:
    return {
        flow.name: flow_stats(flow, run.results[flow.name], SLO, run.window)
        for flow in run.scenario.flows
    }


def _split(run: Run) -> WaitSplit:
    flow = run.scenario.protected
    assert flow is not None
    return wait_split(flow, _measured(run, flow), run.waits)


def _measured(run: Run, flow: str) -> list[Result]:
    return due_in(run.results[flow], *run.window)


def _ratio_figure(name: str, top: Run, bottom: Run, flow: str, *, judged: bool) -> Figure:
    value, low, high = p99_ratio(_measured(top, flow), _measured(bottom, flow))
    target = f"<= {MAX_P99_RATIO}" if judged else f"(reported; <= {MAX_P99_RATIO} would pass)"
    return Figure(name, value, target, value <= MAX_P99_RATIO if judged else None,
                  interval=(low, high))  # fmt: skip


def _ideal_figure(name: str, top: Run, bottom: Run, flow: str) -> Figure:
    """What ordering alone could reach: ``top``'s waits cut to the first free seat."""
    value, low, high = value_p99_ratio(
        ideal_ttfts(_measured(top, flow), top.waits), ttft_all(_measured(bottom, flow))
    )
    return Figure(name, value, f"(reported; <= {MAX_P99_RATIO} would pass)", None,
                  interval=(low, high))  # fmt: skip


def _attainment_figure(name: str, stats: FlowStats, *, judged: bool) -> Figure:
    value = stats.slo_attainment if stats.slo_attainment is not None else float("nan")
    target = f">= {MIN_ATTAINMENT:.0%}" if judged else "(contrast)"
    return Figure(name, value, target, value >= MIN_ATTAINMENT if judged else None, unit="%")


def _variant_runs(
    runs: dict[str, Run], keys: Sequence[str], direct: Sequence[str], *, capped: bool
) -> dict[str, Run]:
    """One configuration's runs under their uncapped keys (``aggressor-capped`` as
    ``aggressor``), so that each ratio's two sides ran under the same config. The
    runs without a proxy have no config: they are contrasted with the plain config only."""
    suffix = CAPPED if capped else ""
    chosen = {key: runs[key + suffix] for key in keys if key + suffix in runs}
    if not capped:
        chosen |= {key: runs[key] for key in direct if key in runs}
    return chosen


def _ratio_if(
    runs: dict[str, Run], name: str, top: str, bottom: str, flow: str, *, judged: bool
) -> list[Figure]:
    """The p99 ratio of ``top`` over ``bottom`` when both ran (else nothing)."""
    if top not in runs or bottom not in runs:
        return []
    return [_ratio_figure(name, runs[top], runs[bottom], flow, judged=judged)]


def _ideal_if(runs: dict[str, Run], name: str, top: str, bottom: str, flow: str) -> list[Figure]:
    if top not in runs or bottom not in runs or not runs[top].waits:
        return []
    return [_ideal_figure(name, runs[top], runs[bottom], flow)]


def _attainment_if(
    runs: dict[str, Run], name: str, key: str, flow: str, *, judged: bool
) -> list[Figure]:
    if key not in runs:
        return []
    return [_attainment_figure(name, _stats(runs[key])[flow], judged=judged)]


def noisy_neighbour_figures(all_runs: dict[str, Run], *, capped: bool = False) -> list[Figure]:
    runs = _variant_runs(
        all_runs, ("alone", "neighbour", "aggressor"), ("aggressor-direct",), capped=capped
    )
    return [
        *_ratio_if(runs,
            "victim p99 TTFT: next to the 10x aggressor / next to a well-behaved neighbour",
            "aggressor", "neighbour", "victim", judged=True),
        *_attainment_if(runs, "victim SLO attainment next to the aggressor", "aggressor",
                        "victim", judged=True),
        *_ideal_if(runs,
            "the same, had the victim always been first in line (estimate from the access log)",
            "aggressor", "neighbour", "victim"),
        *_ratio_if(runs, "victim p99 TTFT: next to the aggressor / alone (the issue's baseline)",
                   "aggressor", "alone", "victim", judged=False),
        *_ratio_if(runs,
            "victim p99 TTFT: next to the neighbour / alone (what any neighbour costs)",
            "neighbour", "alone", "victim", judged=False),
        *_ratio_if(runs,
            "no proxy: victim p99 TTFT next to the aggressor / next to the neighbour (proxied)",
            "aggressor-direct", "neighbour", "victim", judged=False),
        *_attainment_if(runs, "no proxy: victim SLO attainment next to the aggressor",
                        "aggressor-direct", "victim", judged=False),
    ]  # fmt: skip


def weighted_batch_share() -> float:
    return CLASS_WEIGHTS["batch"] / (CLASS_WEIGHTS["batch"] + CLASS_WEIGHTS["interactive"])


def batch_share(run: Run) -> dict[str, float]:
    """Batch's share of the tokens (and requests) whose first token came in the window."""
    stats = _stats(run)
    batch, interactive = stats["batch-flood"], stats["interactive-flood"]
    tokens = batch.served_tokens_per_s + interactive.served_tokens_per_s
    requests = batch.served_rps + interactive.served_rps
    both = sum(1 for _, q in run.queue_samples if q.get("chat", 0) and q.get("bulk", 0))
    return {
        "token_share": batch.served_tokens_per_s / tokens if tokens else float("nan"),
        "request_share": batch.served_rps / requests if requests else float("nan"),
        "both_backlogged_share": both / len(run.queue_samples) if run.queue_samples else 0.0,
        "queue_samples": len(run.queue_samples),
    }


def priority_figures(all_runs: dict[str, Run], *, capped: bool = False) -> list[Figure]:
    runs = _variant_runs(
        all_runs, ("batch-modest", "batch-flood", "backlogged"), ("batch-flood-direct",),
        capped=capped,
    )  # fmt: skip
    figures = [
        *_ratio_if(runs,
            "interactive p99 TTFT: with the batch flood / with batch at a modest rate",
            "batch-flood", "batch-modest", "interactive", judged=True),
        *_ideal_if(runs,
            "the same, had interactive always been first in line (estimate from the access log)",
            "batch-flood", "batch-modest", "interactive"),
        *_attainment_if(runs, "interactive SLO attainment with the batch flood", "batch-flood",
                        "interactive", judged=True),
    ]  # fmt: skip
    if "backlogged" in runs:
        share = batch_share(runs["backlogged"])
        weighted = weighted_batch_share()
        value = share["token_share"] / weighted
        figures.append(Figure(
            f"batch share of served tokens, both classes backlogged / weighted share "
            f"({weighted:.1%})", value, f">= {MIN_SHARE_OF_WEIGHTED}",
            value >= MIN_SHARE_OF_WEIGHTED,
        ))  # fmt: skip
        figures.append(Figure(
            f"interactive share of served tokens, both backlogged / weighted share "
            f"({1 - weighted:.1%})", (1 - share["token_share"]) / (1 - weighted),
            "(reported)", None,
        ))  # fmt: skip
    return [
        *figures,
        *_ratio_if(runs,
            "no proxy: interactive p99 TTFT with the flood / with batch modest (proxied)",
            "batch-flood-direct", "batch-modest", "interactive", judged=False),
        *_attainment_if(runs, "no proxy: interactive SLO attainment with the batch flood",
                        "batch-flood-direct", "interactive", judged=False),
    ]  # fmt: skip


#: The scenarios whose throughput is compared across the two configs, and the
#: flow in each that offers more than the fleet can serve.
CAPS_COST = (("aggressor", "aggressor"), ("batch-flood", "batch-flood"),
             ("backlogged", "batch-flood"))  # fmt: skip


def caps_costs(runs: dict[str, Run], capacity: Capacity) -> list[CapsCost]:
    """What the second config costs in served throughput, per scenario (both ran)."""
    costs: list[CapsCost] = []
    for key, flood in CAPS_COST:
        if key in runs and key + CAPPED in runs:
            scenario = runs[key].scenario
            costs.append(caps_cost(
                scenario.title, list(_stats(runs[key]).values()),
                list(_stats(runs[key + CAPPED]).values()), flood, capacity.rps,
            ))  # fmt: skip
    return costs


def caps_cost_figures(costs: Sequence[CapsCost]) -> list[Figure]:
    figures: list[Figure] = []
    for cost in costs:
        (rps, capped_rps), (tokens, capped_tokens) = cost.served_rps, cost.served_tokens_per_s
        figures.append(Figure(
            f"{cost.scenario}: total served req/s, second config / plain "
            f"({capped_rps:.1f} / {rps:.1f})",
            capped_rps / rps if rps else math.nan, "(reported)", None,
        ))  # fmt: skip
        figures.append(Figure(
            f"{cost.scenario}: total served tokens/s, second config / plain "
            f"({capped_tokens:.0f} / {tokens:.0f})",
            capped_tokens / tokens if tokens else math.nan, "(reported)", None,
        ))  # fmt: skip
    return figures


def _second_config(headroom: int, tenant_cap: int | None) -> str:
    text = f"`headroom: {headroom}` per replica"
    if tenant_cap is not None:
        text += f" and every tenant `max_concurrency: {tenant_cap}` of {REPLICAS * SLOTS} seats"
    return text


def _figures_heading(variant: str, headroom: int, tenant_cap: int | None) -> str:
    if variant == WITH_CAPS:
        return (
            f"Figures {WITH_CAPS} ({_second_config(headroom, tenant_cap)}; each baseline "
            "ran with the same config):"
        )
    return f"Figures, {NO_CAPS} (the config of the earlier runs):"


def report(
    capacity: Capacity,
    runs: list[Run],
    figures: dict[str, dict[str, list[Figure]]],
    costs: Sequence[CapsCost],
    victim_load: float,
    headroom: int,
    tenant_cap: int | None,
) -> str:
    by_group: dict[str, list[Run]] = {}
    for run in runs:
        by_group.setdefault(run.scenario.group, []).append(run)
    lines = [
        f"Fleet: {REPLICAS} simulated replicas x {SLOTS} seats, capacity {capacity.rps:.1f} req/s "
        f"(mean service {capacity.service_ms:.0f} ms). Victim and interactive at "
        f"{victim_load:.0%} of capacity; aggressor and batch flood at {AGGRESSOR_FACTOR:.0f}x "
        f"that. SLO: TTFT <= {SLO.ttft_ms:.0f} ms and total <= {SLO.total_ms:.0f} ms. "
        f"Second config: {_second_config(headroom, tenant_cap)}; engines have "
        f"{SLOTS + headroom} slots each in both.",
    ]
    for group, group_runs in by_group.items():
        rows = [(run.scenario.label, s) for run in group_runs for s in _stats(run).values()]
        lines += ["", f"### {group}", "", *flow_table(rows)]
        splits = [(run.scenario.label, _split(run)) for run in group_runs if run.scenario.protected]
        if any(split.served for _, split in splits):
            lines += ["", *wait_table(splits)]
        for variant, variant_figures in figures.get(group, {}).items():
            if variant_figures:
                heading = _figures_heading(variant, headroom, tenant_cap)
                lines += ["", heading, "", *figure_table(variant_figures)]
        for run in group_runs:
            if run.scenario.sample_queues:
                share = batch_share(run)
                lines += [
                    "",
                    f"Both classes backlogged ({run.scenario.variant}): batch got "
                    f"{share['token_share']:.1%} of the served tokens "
                    f"({share['request_share']:.1%} of the requests); both queues were "
                    f"non-empty in {share['both_backlogged_share']:.0%} of "
                    f"{share['queue_samples']:.0f} samples of /admin/state.",
                ]
    if costs:
        lines += ["", "### cost of the second config", "", *caps_cost_table(costs)]
        lines += ["", *figure_table(caps_cost_figures(costs))]
    return "\n".join(lines)


# -- entry point ------------------------------------------------------------------------


def _run_json(run: Run) -> dict[str, Any]:
    data: dict[str, Any] = {
        "group": run.scenario.group,
        "title": run.scenario.title,
        "via_proxy": run.scenario.via_proxy,
        "second_config": run.scenario.capped,
        "window_s": list(run.window),
        "elapsed_s": run.elapsed_s,
        "cpu_s": run.cpu_s,
        "load_avg": run.load_avg,
        "flows": {name: asdict(s) for name, s in _stats(run).items()},
    }
    if run.scenario.sample_queues:
        data["batch_share"] = batch_share(run)
    if run.scenario.protected is not None and run.waits:
        data["wait_split"] = asdict(_split(run))
    if run.state_at_end is not None:
        data["proxy_state_at_end"] = run.state_at_end
    return data


def proxy_source() -> dict[str, Any]:
    """Which proxy code ran: the commit, and the files changed since (``git`` is read only)."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, timeout=5, check=True).stdout.strip()  # fmt: skip
        changed = subprocess.run(["git", "status", "--porcelain", "--", "proxy"], cwd=ROOT,
                                 capture_output=True, text=True, timeout=5,
                                 check=True).stdout.splitlines()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "changed": []}
    return {"commit": head, "changed": [line[3:] for line in changed]}


def timing_for(quick: bool, seconds: float | None, default_s: float = DEFAULT_SECONDS) -> Timing:
    """The run's timing, full or ``--quick``; ``seconds`` (measured per scenario) if given."""
    return Timing(
        warmup_s=QUICK_WARMUP_S if quick else WARMUP_S,
        seconds=seconds if seconds is not None else (QUICK_SECONDS if quick else default_s),
        drain_s=QUICK_DRAIN_S if quick else DRAIN_S,
        calibrate_s=QUICK_CALIBRATE_S if quick else CALIBRATE_S,
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.fairness", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--seconds", type=float, default=None,
        help=f"measured seconds per scenario (default {DEFAULT_SECONDS:.0f}; "
             f"--quick: {QUICK_SECONDS:.0f})",
    )  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="short scenarios, a smoke test")
    parser.add_argument(
        "--victim-load",
        type=float,
        default=VICTIM_LOAD,
        help="victim's and interactive's rate as a share of capacity (default %(default)s)",
    )
    parser.add_argument(
        "--headroom",
        type=int,
        default=HEADROOM,
        metavar="N",
        help="seats above the knee per replica in the second config (default %(default)s)",
    )
    parser.add_argument(
        "--tenant-cap",
        type=int,
        default=None,
        metavar="N",
        help=f"also give every tenant max_concurrency N (of {REPLICAS * SLOTS}) there",
    )
    parser.add_argument(
        "--only",
        nargs="+",
        choices=SCENARIO_KEYS,
        metavar="SCENARIO",
        help="run only these scenarios: " + ", ".join(SCENARIO_KEYS),
    )
    parser.add_argument("--output", type=Path, default=RESULTS, help="JSON results file")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    timing = timing_for(args.quick, args.seconds)
    seats = REPLICAS * SLOTS
    cap_ok = args.tenant_cap is None or 1 <= args.tenant_cap <= seats
    if timing.seconds <= 0 or not 0 < args.victim_load < 1 or not cap_ok or args.headroom < 0:
        print(
            f"fairness: --seconds must be positive, --victim-load in (0, 1), "
            f"--tenant-cap in 1..{seats}, --headroom at least 0",
            file=sys.stderr,
        )
        return 2
    print(
        f"fairness: {REPLICAS} replicas x {SLOTS} seats; each scenario {timing.warmup_s:.0f} s "
        f"warm-up + {timing.seconds:.0f} s measured; {os.cpu_count()} CPUs shared by the load "
        "generator, the proxy and the replicas",
        flush=True,
    )
    print(cpu_line(), flush=True)
    started = time.monotonic()
    started_at = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    source = proxy_source()  # before the run: the code that runs, even if a commit lands meanwhile
    try:
        with tempfile.TemporaryDirectory(prefix="bench-fairness-") as tmp:
            capacity, runs = uvloop.run(bench(args, timing, Path(tmp)))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except (RuntimeError, ConfigError) as exc:
        print(f"fairness: {exc}", file=sys.stderr)
        return 1
    by_key = {run.scenario.key: run for run in runs}
    figures = {
        "noisy neighbour": {
            NO_CAPS: noisy_neighbour_figures(by_key),
            WITH_CAPS: noisy_neighbour_figures(by_key, capped=True),
        },
        "priority isolation": {
            NO_CAPS: priority_figures(by_key),
            WITH_CAPS: priority_figures(by_key, capped=True),
        },
    }
    costs = caps_costs(by_key, capacity)
    print()
    print(report(capacity, runs, figures, costs, args.victim_load, args.headroom, args.tenant_cap))
    judged = {
        f"{group}, {variant}: {f.name}": f.passed
        for group, variants in figures.items()
        for variant, fs in variants.items()
        for f in fs
        if f.passed is not None
    }
    result = {
        "benchmark": "fairness",
        "command": "python -m bench.fairness " + " ".join(sys.argv[1:] if argv is None else argv),
        "parameters": {
            "replicas": REPLICAS, "slots": SLOTS, "sim_args": list(SIM_ARGS),
            "shape": asdict(SHAPE), "victim_load": args.victim_load,
            "aggressor_factor": AGGRESSOR_FACTOR,
            "backlogged_interactive_load": BACKLOGGED_INTERACTIVE_LOAD,
            "class_weights": CLASS_WEIGHTS, "queue_ms": QUEUE_MS,
            "batch_queue_ms": BATCH_QUEUE_MS, "queue_capacity": QUEUE_CAPACITY,
            "tenant_cap": args.tenant_cap, "headroom": args.headroom,
            **asdict(timing), "client_timeout_s": CLIENT_TIMEOUT_S,
        },
        "proxy_source": source,
        "slo": asdict(SLO),
        "capacity": asdict(capacity),
        "machine": machine("load generator, proxy and simulated replicas share the same CPUs"),
        "started_at": started_at,
        "wall_s": round(time.monotonic() - started, 1),
        "scenarios": {run.scenario.key: _run_json(run) for run in runs},
        "figures": {
            group: {variant: [asdict(f) for f in fs] for variant, fs in variants.items()}
            for group, variants in figures.items()
        },
        "caps_cost": [asdict(c) for c in costs],
        "caps_cost_figures": [asdict(f) for f in caps_cost_figures(costs)],
        "pass": judged,
    }  # fmt: skip
    write_results(args.output, result)
    print(f"\nresults: {args.output} ({result['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
