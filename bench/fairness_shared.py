"""Fairness across instances (issue 17): ``bench.fairness``'s noisy neighbour through
two ``serve`` processes sharing one Redis, against one instance in the same run.

The fleet, the tenants, the traffic and the figures are ``bench.fairness``'s:
two simulated replicas at 4 seats each (plus ``--headroom`` seats above the
knee, 4 by default as there; 0 gives its "no headroom" config), the victim
at 30% of measured capacity alone, next to a well-behaved neighbour at its
own rate, and next to an aggressor at ten times its rate. Each scenario runs
through three deployments of the same config, one after the other:

- ``local``: one ``serve`` process, ``state.backend: local`` (bench.fairness's);
- ``redis``: one ``serve`` process, ``state.backend: redis`` on a loopback
  ``redis-server`` the benchmark starts (what the shared state itself costs);
- ``redis-x2``: two ``serve`` processes on two ports with that one config,
  every request of every tenant sent to one of them at random (each flow's
  own seeded choice), so the victim and the aggressor each reach both and
  only Redis (seats as leases, the fair turn in the acquire script, pub/sub
  wake-ups) can keep the aggressor from taking the victim's turn.

Every run gets a fresh ``key_prefix`` so nothing of the previous one is left
in Redis. The victim's queue wait is split with the access logs of every
instance of the run merged (``bench.fairness_accesslog``): dispatches of the
aggressor in either process count as passing it.

Target: the victim's p99 TTFT next to the aggressor through two instances
at most 1.3 times its p99 through one instance (local backend), with a
bootstrap interval; its SLO attainment there at least 99%. Reported beside
them: the same against one instance on Redis, alone and next to the
neighbour, and the aggressor's served share per deployment.

    .venv/bin/python -m bench.fairness_shared [--seconds N] [--quick] [--headroom N]
        [--only SCENARIO ...] [--deployments DEPLOYMENT ...] [--workdir DIR] [--output PATH]

``--workdir`` keeps every process's log there (the proxies' access logs are
``proxy-N.stdout``, numbered in starting order) to look into a run afterwards.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import aiohttp
import uvloop
import yaml

from bench.common import cpu_line, machine, write_results
from bench.fairness import (
    HEADROOM,
    QUICK_SECONDS,
    REPLICAS,
    SHAPE,
    SIM_ARGS,
    SLO,
    SLOTS,
    VICTIM_LOAD,
    Capacity,
    Run,
    Timing,
    calibrate,
    proxy_config,
    proxy_source,
    run_scenario,
    scenarios,
    timing_for,
)
from bench.fairness_report import (
    Figure,
    FlowStats,
    due_in,
    figure_table,
    flow_stats,
    flow_table,
    p99_ratio,
    wait_split,
    wait_table,
)
from bench.fairness_servers import Fleet, wait_ready, wait_sims_idle
from bench.fairness_traffic import Result
from bench.load import load_session
from bench.processes import start_redis, stop_server, wait_redis
from proxy.settings import parse_config

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "fairness_shared.json"

#: The victim's p99 TTFT next to the aggressor, two instances over one.
MAX_INSTANCE_RATIO = 1.3
MIN_ATTAINMENT = 0.99
#: bench.fairness's own target (next to the aggressor / next to the neighbour), reported.
FAIRNESS_RATIO = 1.2
SCENARIO_KEYS = ("alone", "neighbour", "aggressor")
#: Longer than bench.fairness's 15 s: each p99 is then about the second-worst of 180.
SHARED_SECONDS = 20.0
#: ``state.timeout_ms``, as in bench.shared_state: with the default 50 ms a busy two-core
#: machine times Redis calls out now and then, and each switch to the local share and back
#: would be measured here instead of the fair sharing.
STATE_TIMEOUT_MS = 500
CONNECTIONS = 4096
CLIENT_TIMEOUT_S = 10.0


@dataclass(frozen=True, slots=True)
class Deployment:
    key: str
    title: str
    backend: str
    instances: int


LOCAL = Deployment("local", "1 instance, local", "local", 1)
REDIS = Deployment("redis", "1 instance, redis", "redis", 1)
TWO = Deployment("redis-x2", "2 instances, redis", "redis", 2)
DEPLOYMENTS = (LOCAL, REDIS, TWO)


def deployed_config(config_yaml: str, deployment: Deployment, redis_url: str, prefix: str) -> str:
    """bench.fairness's config with this deployment's ``state`` block."""
    if deployment.backend == "local":
        return config_yaml
    document = yaml.safe_load(config_yaml)
    document["state"] = {
        "backend": "redis", "redis_url": redis_url, "key_prefix": prefix,
        "timeout_ms": STATE_TIMEOUT_MS,
    }  # fmt: skip
    text = yaml.safe_dump(document, sort_keys=False)
    parse_config(text)
    return text


@dataclass(slots=True)
class Measured:
    deployment: Deployment
    run: Run
    redis_cpu_s: float


async def bench(
    args: argparse.Namespace, timing: Timing, workdir: Path
) -> tuple[Capacity, list[Measured]]:
    redis, port = start_redis(workdir)
    try:
        with Fleet(workdir) as fleet:
            async with (
                aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5.0)) as control,
                load_session(CONNECTIONS, total_s=CLIENT_TIMEOUT_S) as load,
            ):
                await wait_redis(redis, port)
                sims = await fleet.start_sims(
                    REPLICAS, ["--slots", str(SLOTS + args.headroom), *SIM_ARGS]
                )
                for sim in sims:
                    await wait_ready(control, sim, "/health")
                urls = [sim.url for sim in sims]
                capacity = await calibrate(load, urls, timing.calibrate_s)
                print(
                    f"capacity: {capacity.rps:.1f} req/s with {capacity.seats} seats "
                    f"(mean service {capacity.service_ms:.0f} ms)",
                    flush=True,
                )
                await wait_sims_idle(control, sims)
                base = proxy_config(urls, None, args.headroom)
                chosen = {s.key: s for s in scenarios(capacity.rps, args.victim_load)}
                measured: list[Measured] = []
                for key in args.only or SCENARIO_KEYS:
                    for deployment in DEPLOYMENTS:
                        if args.deployments and deployment.key not in args.deployments:
                            continue
                        scenario = replace(chosen[key], key=f"{deployment.key}:{key}")
                        config = deployed_config(
                            base, deployment, f"redis://127.0.0.1:{port}/0", f"fair{len(measured)}"
                        )
                        cpu0 = redis.cpu()
                        run = await run_scenario(
                            fleet, control, load, scenario, config, timing, deployment.instances
                        )
                        measured.append(Measured(deployment, run, round(redis.cpu() - cpu0, 2)))
                        print(_progress(measured[-1]), flush=True)
    finally:
        stop_server(redis)
    return capacity, measured


def _progress(m: Measured) -> str:
    parts = []
    for name, results in m.run.results.items():
        measured = due_in(results, *m.run.window)
        parts.append(f"{name} {sum(r.ok for r in measured)}/{len(measured)} ok")
    cpu = (sum(m.run.cpu_s.values()) + m.redis_cpu_s) / max(m.run.elapsed_s, 1e-9)
    return (
        f"  {m.deployment.title:<20} {m.run.scenario.title:<34} {', '.join(parts)} "
        f"({m.run.elapsed_s:.0f} s, {cpu:.2f} CPUs busy with us)"
    )


# -- figures ----------------------------------------------------------------------------


def _by(measured: Sequence[Measured]) -> dict[tuple[str, str], Run]:
    return {(m.deployment.key, m.run.scenario.key.split(":", 1)[1]): m.run for m in measured}


def _stats(run: Run) -> dict[str, FlowStats]:
    return {f.name: flow_stats(f, run.results[f.name], SLO, run.window) for f in run.scenario.flows}


def _victim(run: Run) -> list[Result]:
    return due_in(run.results["victim"], *run.window)


def _ratio(name: str, top: Run, bottom: Run, limit: float, judged: bool) -> Figure:
    value, low, high = p99_ratio(_victim(top), _victim(bottom))
    target = f"<= {limit}" if judged else f"(reported; <= {limit} would pass)"
    return Figure(name, value, target, value <= limit if judged else None, interval=(low, high))


@dataclass(slots=True)
class Share:
    """Who got the fleet next to the aggressor."""

    deployment: str
    served_rps: float
    aggressor_rps: float
    victim_rps: float
    aggressor_request_share: float
    aggressor_token_share: float


def aggressor_share(deployment: str, run: Run) -> Share:
    stats = _stats(run)
    victim, aggressor = stats["victim"], stats["aggressor"]
    rps = victim.served_rps + aggressor.served_rps
    tokens = victim.served_tokens_per_s + aggressor.served_tokens_per_s
    return Share(
        deployment=deployment,
        served_rps=round(rps, 2),
        aggressor_rps=aggressor.served_rps,
        victim_rps=victim.served_rps,
        aggressor_request_share=aggressor.served_rps / rps if rps else math.nan,
        aggressor_token_share=aggressor.served_tokens_per_s / tokens if tokens else math.nan,
    )


def figures(measured: Sequence[Measured]) -> list[Figure]:
    runs = _by(measured)
    out: list[Figure] = []

    def ratio(
        name: str, top: tuple[str, str], bottom: tuple[str, str], limit: float, judged: bool = False
    ) -> None:
        if top in runs and bottom in runs:
            out.append(_ratio(name, runs[top], runs[bottom], limit, judged))

    ratio(
        "victim p99 TTFT next to the 10x aggressor: 2 instances (redis) / 1 instance (local)",
        (TWO.key, "aggressor"),
        (LOCAL.key, "aggressor"),
        MAX_INSTANCE_RATIO,
        True,
    )
    if (TWO.key, "aggressor") in runs:
        attained = _stats(runs[TWO.key, "aggressor"])["victim"].slo_attainment
        value = math.nan if attained is None else attained
        out.append(
            Figure(
                "victim SLO attainment next to the aggressor, 2 instances",
                value,
                f">= {MIN_ATTAINMENT:.0%}",
                value >= MIN_ATTAINMENT,
                unit="%",
            )
        )
    ratio(
        "the same p99 ratio, against 1 instance on redis",
        (TWO.key, "aggressor"),
        (REDIS.key, "aggressor"),
        MAX_INSTANCE_RATIO,
    )
    for key, what in (("neighbour", "next to the neighbour"), ("alone", "alone")):
        ratio(
            f"victim p99 TTFT {what}: 2 instances / 1 instance (local)",
            (TWO.key, key),
            (LOCAL.key, key),
            MAX_INSTANCE_RATIO,
        )
    for d in DEPLOYMENTS:
        ratio(
            f"{d.title}: victim p99 next to the aggressor / next to the neighbour",
            (d.key, "aggressor"),
            (d.key, "neighbour"),
            FAIRNESS_RATIO,
        )
    for d in (LOCAL, REDIS):
        if (d.key, "aggressor") in runs:
            attained = _stats(runs[d.key, "aggressor"])["victim"].slo_attainment
            out.append(
                Figure(
                    f"{d.title}: victim SLO attainment next to the aggressor",
                    math.nan if attained is None else attained,
                    "(reported)",
                    None,
                    unit="%",
                )
            )
    return out


def summary_table(measured: Sequence[Measured]) -> list[str]:
    """The victim's TTFT p50 / p99 (over every request sent) per deployment and scenario."""
    runs = _by(measured)
    lines = [
        "| deployment | victim alone | next to the neighbour | next to the 10x aggressor "
        "| SLO met next to the aggressor |",
        "|---|---:|---:|---:|---:|",
    ]
    for d in DEPLOYMENTS:
        cells = []
        for key in SCENARIO_KEYS:
            run = runs.get((d.key, key))
            if run is None:
                cells.append("-")
                continue
            s = _stats(run)["victim"]
            p99 = "unserved" if s.ttft_p99_all_ms is None else f"{s.ttft_p99_all_ms:.0f}"
            p50 = "-" if s.ttft_p50_ms is None else f"{s.ttft_p50_ms:.0f}"
            cells.append(f"{p50} / {p99}")
        run = runs.get((d.key, "aggressor"))
        attained = None if run is None else _stats(run)["victim"].slo_attainment
        cells.append("-" if attained is None else f"{attained:.1%}")
        lines.append(f"| {d.title} | " + " | ".join(cells) + " |")
    return lines


def share_table(shares: Sequence[Share], capacity: Capacity) -> list[str]:
    lines = [
        "| deployment | served req/s (of capacity) | aggressor req/s | victim req/s "
        "| aggressor share of requests / tokens served |",
        "|---|---:|---:|---:|---:|",
    ]
    for s in shares:
        lines.append(
            f"| {s.deployment} | {s.served_rps:.1f} ({s.served_rps / capacity.rps:.0%}) "
            f"| {s.aggressor_rps:.1f} | {s.victim_rps:.1f} "
            f"| {s.aggressor_request_share:.1%} / {s.aggressor_token_share:.1%} |"
        )
    return lines


def report(capacity: Capacity, measured: Sequence[Measured], headroom: int, load: float) -> str:
    runs = _by(measured)
    shares = [
        aggressor_share(d.title, runs[d.key, "aggressor"])
        for d in DEPLOYMENTS
        if (d.key, "aggressor") in runs
    ]
    rows = [
        (f"{m.deployment.title}: {m.run.scenario.title}", s)
        for m in measured
        for s in _stats(m.run).values()
    ]
    splits = [
        (
            f"{m.deployment.title}: {m.run.scenario.title}",
            wait_split("victim", _victim(m.run), m.run.waits),
        )
        for m in measured
    ]
    return "\n".join(
        [
            f"Fleet: {REPLICAS} simulated replicas x {SLOTS} seats (+{headroom} headroom each), "
            f"capacity {capacity.rps:.1f} req/s (mean service {capacity.service_ms:.0f} ms). "
            f"Victim at {load:.0%} of capacity. SLO: TTFT <= {SLO.ttft_ms:.0f} ms and total <= "
            f"{SLO.total_ms:.0f} ms.",
            "",
            "Victim TTFT p50 / p99 ms (p99 over every request sent):",
            "",
            *summary_table(measured),
            "",
            *figure_table(figures(measured)),
            "",
            "Next to the aggressor:",
            "",
            *share_table(shares, capacity),
            "",
            *flow_table(rows),
            "",
            *wait_table(splits),
        ]
    )


# -- entry point ------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.fairness_shared", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--seconds",
        type=float,
        default=None,
        help=f"measured seconds per run (default {SHARED_SECONDS:.0f}; "
        f"--quick: {QUICK_SECONDS:.0f})",
    )
    parser.add_argument("--quick", action="store_true", help="short runs, a smoke test")
    parser.add_argument(
        "--victim-load",
        type=float,
        default=VICTIM_LOAD,
        help="victim's rate as a share of capacity (default %(default)s)",
    )
    parser.add_argument(
        "--headroom",
        type=int,
        default=HEADROOM,
        metavar="N",
        help="seats above the knee per replica (default %(default)s; 0: "
        "bench.fairness's no-headroom config)",
    )
    parser.add_argument(
        "--only", nargs="+", choices=SCENARIO_KEYS, metavar="SCENARIO",
        help="run only these scenarios: " + ", ".join(SCENARIO_KEYS),
    )  # fmt: skip
    parser.add_argument(
        "--deployments", nargs="+", choices=[d.key for d in DEPLOYMENTS], metavar="DEPLOYMENT",
        help="run only these deployments: " + ", ".join(d.key for d in DEPLOYMENTS),
    )  # fmt: skip
    parser.add_argument(
        "--workdir", type=Path, default=None,
        help="keep the configs and every process's logs (access logs: proxy-N.stdout) here",
    )  # fmt: skip
    parser.add_argument("--output", type=Path, default=RESULTS, help="JSON results file")
    return parser


def _run_json(m: Measured) -> dict[str, Any]:
    run = m.run
    return {
        "deployment": m.deployment.key,
        "instances": m.deployment.instances,
        "backend": m.deployment.backend,
        "scenario": run.scenario.title,
        "window_s": list(run.window),
        "elapsed_s": run.elapsed_s,
        "cpu_s": run.cpu_s | {"redis": m.redis_cpu_s},
        "load_avg": run.load_avg,
        "flows": {name: asdict(s) for name, s in _stats(run).items()},
        "wait_split": asdict(wait_split("victim", _victim(run), run.waits)),
        "proxy_state_at_end": run.state_at_end,
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    seconds = (
        args.seconds
        if args.seconds is not None
        else (QUICK_SECONDS if args.quick else SHARED_SECONDS)
    )
    if seconds <= 0 or not 0 < args.victim_load < 1 or args.headroom < 0:
        print(
            "fairness_shared: --seconds must be positive, --victim-load in (0, 1), "
            "--headroom at least 0",
            file=sys.stderr,
        )
        return 2
    timing = timing_for(args.quick, seconds)
    runs = len(SCENARIO_KEYS) * len(DEPLOYMENTS)
    print(
        f"fairness_shared: {runs} runs of {timing.warmup_s:.0f} s warm-up + {seconds:.0f} s; "
        f"{os.cpu_count()} CPUs shared by everything",
        flush=True,
    )
    print(cpu_line(), flush=True)
    started, started_at = time.monotonic(), datetime.datetime.now(datetime.UTC)
    source = proxy_source()
    try:
        if args.workdir is not None:
            args.workdir.mkdir(parents=True, exist_ok=True)
            capacity, measured = uvloop.run(bench(args, timing, args.workdir))
        else:
            with tempfile.TemporaryDirectory(prefix="bench-fairness-shared-") as tmp:
                capacity, measured = uvloop.run(bench(args, timing, Path(tmp)))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except RuntimeError as exc:
        print(f"fairness_shared: {exc}", file=sys.stderr)
        return 1
    print()
    print(report(capacity, measured, args.headroom, args.victim_load))
    figs = figures(measured)
    runs_by = _by(measured)
    result = {
        "benchmark": "fairness_shared",
        "command": "python -m bench.fairness_shared "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "parameters": {
            "replicas": REPLICAS,
            "slots": SLOTS,
            "headroom": args.headroom,
            "victim_load": args.victim_load,
            "shape": asdict(SHAPE),
            **asdict(timing),
        },
        "proxy_source": source,
        "slo": asdict(SLO),
        "capacity": asdict(capacity),
        "machine": machine("load generator, proxies, Redis and simulated replicas share the CPUs"),
        "started_at": started_at.isoformat(timespec="seconds"),
        "wall_s": round(time.monotonic() - started, 1),
        "runs": {m.run.scenario.key: _run_json(m) for m in measured},
        "aggressor_share": [
            asdict(aggressor_share(d.key, runs_by[d.key, "aggressor"]))
            for d in DEPLOYMENTS
            if (d.key, "aggressor") in runs_by
        ],
        "figures": [asdict(f) for f in figs],
        "pass": {f.name: f.passed for f in figs if f.passed is not None},
    }
    write_results(args.output, result)
    print(f"\nresults: {args.output} ({result['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
