"""False refusals: does predictive rejection refuse work that would have fit?

Each scenario's arrivals are generated once (seeded) and replayed, one run
after another, through three proxies, each in front of two fresh simulated
replicas (``admission-proxy sim``, 4 seats each, 10 ms per output token and no
slowdown with batch size, so a request's seat time is its token count):

- ``normal``: this tree's proxy;
- ``twin``: this tree's proxy with predictive rejection off (the internal
  ``build_app(predictive_rejection=False)`` switch, no config key): it queues
  every request the normal proxy might refuse, and shows what became of it;
- ``today``: the proxy of ``--today`` (by default ``TODAY_REVISION``, the last
  revision whose estimator took a tenant's last 64 dispatches, however old,
  as its drain rate), exported with ``git archive`` and run the same way;
- ``again``: ``normal`` once more. The requests one run refused and the other
  served (``noise``) are the per-request comparison's own noise on this
  machine: what a perfect estimator would still be charged with.

A refusal ``predicted_wait_exceeds_budget`` is *false* when the twin served
the same request (same index in the replay) with a 200, that is within its
queue budget. Scenarios: a burst after a quiet period and a replica loss
(the issue's reproduction, time compressed), 1x load with 3x service-time
variation, and a replica lost under steady load.

The same arrivals also go through the dispatcher alone on a fake clock
(``bench.false_refusals_virtual``), where only the estimator differs between
the three.

    python -m bench.false_refusals [--quick] [--output PATH]

Every loop is bounded: arrivals stop at the schedule's end, each request has
a client timeout, and waits for servers are bounded. The proxies, the
replicas and this load generator share the machine's CPUs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from bench.common import ROOT, machine, revision, scrubbed_env, write_results
from bench.load import load_session
from bench.processes import Server, free_port, start_server, stop_server, wait_ready

#: The last revision with the old estimator (the tenant's last 64 dispatches as its rate).
TODAY_REVISION = "be5cd7c"
RESULTS = ROOT / "bench" / "results" / "false_refusals.json"
PATH = "/v1/chat/completions"
SEATS = 4
TOKEN_MS = 10.0
#: Every request's client timeout: far above any budget used here.
CLIENT_TIMEOUT_S = 40.0
START_TIMEOUT_S = 20.0
EJECT_TIMEOUT_S = 10.0
REFUSED = "predicted_wait_exceeds_budget"
QUEUE_TIMEOUT = "queue_timeout"
VARIANTS = ("normal", "twin", "today", "again")
#: The fake clock is deterministic: a second run of ``normal`` there is the first.
VIRTUAL_VARIANTS = ("normal", "twin", "today")
CALIBRATION_REQUESTS = 20
VIRTUAL_TIMEOUT_S = 120.0
#: Seeds of the fake-clock replays in a full run, and their seat time for 10 tokens.
VIRTUAL_SEEDS = 5
VIRTUAL_SEAT_S = 10 * TOKEN_MS / 1000
SCENARIOS = ("burst_after_idle", "variation_1x", "replica_loss")


@dataclass(frozen=True, slots=True)
class Arrival:
    """One request: when (seconds from the start), whose, how long it holds its seat."""

    at_s: float
    tenant: int
    tokens: int
    #: ``X-Request-Timeout-Ms``: a request made to fail (504) before it ends.
    timeout_ms: int | None = None


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    description: str
    arrivals: tuple[Arrival, ...]
    queue_ms: int
    tenants: int
    #: One replica is killed (SIGKILL) at this offset.
    kill_at_s: float | None = None
    #: After the kill, wait until the proxy has ejected it; later arrivals shift by that wait.
    settle: bool = False


@dataclass(slots=True)
class Outcome:
    status: int = 0
    reason: str = "unfinished"
    latency_s: float = 0.0


@dataclass(slots=True)
class Run:
    variant: str
    outcomes: list[Outcome] = field(default_factory=list)
    wall_s: float = 0.0
    settle_s: float = 0.0


def burst_after_idle(quick: bool) -> Scenario:
    """The issue's reproduction, compressed in time: sparse traffic with a few slow
    and failed requests, one of two replicas lost, then 100 requests at once."""
    count, gap = (22, 0.2) if quick else (40, 0.5)
    sparse = []
    for i in range(count):
        slow = i in (4, count // 2, count - 3)
        failed = i in (7, count - 6)
        tokens = 100 if slow or failed else 5
        sparse.append(Arrival(i * gap, 0, tokens, 30 if failed else None))
    start = count * gap + 0.5
    burst = [Arrival(start + 0.5, 0, 5) for _ in range(100)]
    return Scenario(
        "burst_after_idle",
        f"{count} requests {gap:g} s apart (3 slow, 2 failed), one replica killed, "
        "then 100 at once from one tenant; 50 ms each, queue_ms 5000",
        (*sparse, *burst),
        queue_ms=5000,
        tenants=1,
        kill_at_s=start,
        settle=True,
    )


def _poisson(rng: random.Random, rate: float, until: float) -> list[float]:
    times: list[float] = []
    now = 0.0
    while True:
        now += rng.expovariate(rate)
        if now >= until:
            return times
        times.append(now)


def variation_1x(quick: bool, seed: int, seat_s: float) -> Scenario:
    """Three tenants, together at the seats' capacity, service times from 5 to 15
    tokens (3x); ``seat_s``: the measured seat time of the mean, 10 tokens."""
    rng = random.Random(f"variation:{seed}")
    seconds = 3.0 if quick else 20.0
    capacity = round(2 * SEATS / seat_s, 1)
    arrivals = [
        Arrival(t, rng.randrange(3), rng.randint(5, 15)) for t in _poisson(rng, capacity, seconds)
    ]
    return Scenario(
        "variation_1x",
        f"{seconds:g} s of Poisson arrivals at 1x capacity ({capacity:g}/s), three tenants, "
        f"5 to 15 tokens of {TOKEN_MS:g} ms each; queue_ms 1000",
        tuple(arrivals),
        queue_ms=1000,
        tenants=3,
    )


def replica_loss(quick: bool, seed: int, seat_s: float) -> Scenario:
    """Two tenants at 0.7x of two replicas; one replica is killed a third of the way in."""
    rng = random.Random(f"loss:{seed}")
    seconds = 3.0 if quick else 20.0
    rate = round(0.7 * 2 * SEATS / seat_s, 1)
    arrivals = [Arrival(t, rng.randrange(2), 10) for t in _poisson(rng, rate, seconds)]
    return Scenario(
        "replica_loss",
        f"{seconds:g} s of Poisson arrivals at {rate:g}/s (0.7x of two replicas, 1.4x of one), "
        f"two tenants, 10 tokens each, one replica killed at {seconds / 3:.3g} s; queue_ms 1000",
        tuple(arrivals),
        queue_ms=1000,
        tenants=2,
        kill_at_s=seconds / 3,
    )


def calibration() -> Scenario:
    """Requests of the mean size (10 tokens) one at a time: their latency is the seat time."""
    arrivals = tuple(Arrival(0.2 * i, 0, 10) for i in range(CALIBRATION_REQUESTS))
    return Scenario("calibration", "", arrivals, queue_ms=1000, tenants=1)


def scenarios(quick: bool, seed: int, seat_s: float) -> list[Scenario]:
    return [
        burst_after_idle(quick),
        variation_1x(quick, seed, seat_s),
        replica_loss(quick, seed, seat_s),
    ]


def proxy_config(sim_urls: Sequence[str], scenario: Scenario) -> str:
    replicas = "".join(
        f"  - {{name: gpu-{i}, url: '{url}', max_concurrency: {SEATS}}}\n"
        for i, url in enumerate(sim_urls)
    )
    tenants = "".join(
        f"  t{i}: {{api_keys: [sk-bench-{i}], queue_capacity: 1000}}\n"
        for i in range(scenario.tenants)
    )
    return (
        f"replicas:\n{replicas}"
        "health: {interval_ms: 100, eject_after_failures: 2, eject_ms: 60000}\n"
        f"budgets: {{queue_ms: {scenario.queue_ms}, first_byte_ms: 20000, total_ms: 30000}}\n"
        f"tenants:\n{tenants}"
    )


def export_today(rev: str, into: Path) -> Path:
    """``proxy/`` as it was at ``rev``, under ``into`` (imported ahead of this tree's)."""
    into.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(
        ["git", "archive", rev, "proxy"], cwd=ROOT, capture_output=True, check=True
    )
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return into


async def _send(
    session: aiohttp.ClientSession, url: str, arrival: Arrival, index: int, outcome: Outcome
) -> None:
    headers = {"Authorization": f"Bearer sk-bench-{arrival.tenant}", "X-Request-Id": f"r{index}"}
    if arrival.timeout_ms is not None:
        headers["X-Request-Timeout-Ms"] = str(arrival.timeout_ms)
    body = {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": arrival.tokens}  # fmt: skip
    started = time.monotonic()
    try:
        async with session.post(url + PATH, json=body, headers=headers) as response:
            await response.read()
            outcome.status = response.status
            outcome.reason = response.headers.get("X-Admission-Reason", "")
    except (aiohttp.ClientError, TimeoutError) as exc:
        outcome.reason = type(exc).__name__
    outcome.latency_s = time.monotonic() - started


async def _ejected(session: aiohttp.ClientSession, proxy: Server, replica: str) -> bool:
    async with session.get(proxy.url + "/admin/state") as response:
        state = await response.json()
    return bool(state["replicas"][replica]["ejected"])


async def replay(
    session: aiohttp.ClientSession, proxy: Server, sims: list[Server], scenario: Scenario
) -> Run:
    """Send every arrival on time (open loop); the kill happens between arrivals."""
    run = Run("")
    run.outcomes = [Outcome() for _ in scenario.arrivals]
    tasks: list[asyncio.Task[None]] = []
    killed = scenario.kill_at_s is None
    shift = 0.0
    start = time.monotonic()
    for index, arrival in enumerate(scenario.arrivals):
        if not killed and scenario.kill_at_s is not None and arrival.at_s >= scenario.kill_at_s:
            await asyncio.sleep(max(0.0, start + shift + scenario.kill_at_s - time.monotonic()))
            killed = True
            sims[-1].process.kill()
            if scenario.settle:
                settle_from = time.monotonic()
                while not await _ejected(session, proxy, "gpu-1"):
                    if time.monotonic() - settle_from > EJECT_TIMEOUT_S:
                        raise RuntimeError("the killed replica was not ejected in time")
                    await asyncio.sleep(0.05)
                run.settle_s = time.monotonic() - settle_from
                shift += run.settle_s
        delay = start + shift + arrival.at_s - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        outcome = run.outcomes[index]
        tasks.append(asyncio.create_task(_send(session, proxy.url, arrival, index, outcome)))
    await asyncio.wait(tasks, timeout=CLIENT_TIMEOUT_S + 5)
    for task in tasks:
        task.cancel()
    run.wall_s = time.monotonic() - start
    return run


async def run_variant(
    variant: str, scenario: Scenario, workdir: Path, today_tree: Path, trace: Path | None = None
) -> Run:
    """Fresh replicas and a fresh proxy of ``variant``; replay; stop them all.

    ``trace``: a folder where the proxy writes each ticket's predicted and
    realised wait (``bench.false_refusals_trace``), one file per run."""
    env = scrubbed_env()
    sims: list[Server] = []
    proxy: Server | None = None
    async with load_session(2000, total_s=CLIENT_TIMEOUT_S) as session:
        try:
            for i in range(2):
                port = free_port()
                argv = [sys.executable, "-m", "proxy", "sim", "--port", str(port),
                        "--slots", str(SEATS), "--seed", str(i),
                        "--prefill-ms-per-token", "0", "--decode-base-ms", str(TOKEN_MS),
                        "--decode-per-seq-ms", "0"]  # fmt: skip
                sims.append(start_server(f"sim-{i}", argv, port, "/health", workdir, env))
            for sim in sims:
                await wait_ready(session, sim, START_TIMEOUT_S)
            config = workdir / f"{scenario.name}-{variant}.yaml"
            config.write_text(proxy_config([s.url for s in sims], scenario))
            port = free_port()
            argv = [sys.executable, "-P", "-m", "bench.false_refusals", "--serve", str(config),
                    "--port", str(port)]  # fmt: skip
            path = [str(ROOT)]
            if variant == "twin":
                argv.append("--twin")
            if trace is not None and variant != "today":
                argv += ["--trace", str(trace / f"{scenario.name}-{variant}.jsonl")]
            if variant == "today":
                path.insert(0, str(today_tree))
            proxy_env = {**env, "PYTHONPATH": os.pathsep.join(path)}
            proxy = start_server(f"proxy-{variant}", argv, port, "/readyz", workdir, proxy_env)
            await wait_ready(session, proxy, START_TIMEOUT_S)
            run = await replay(session, proxy, sims, scenario)
            run.variant = variant
            return run
        finally:
            if proxy is not None:
                stop_server(proxy)
            for sim in reversed(sims):
                stop_server(sim)


#: A virtual run's outcome as the live runs record it.
_VIRTUAL = {
    "served": Outcome(200, ""),
    "refused": Outcome(503, REFUSED),
    "timed_out": Outcome(503, QUEUE_TIMEOUT),
    "failed": Outcome(504, "failed"),
}


def run_virtual(
    variant: str, scenario: Scenario, quick: bool, seed: int, seeds: int, today_tree: Path
) -> Run:
    """The scenario on a fake clock (``bench.false_refusals_virtual``), in its own process.

    At the simulator's nominal seat time, not the calibrated one, so that these
    figures are the same on every machine: only the estimator differs.
    """
    argv = [sys.executable, "-P", "-m", "bench.false_refusals_virtual",
            "--scenario", scenario.name, "--seat-s", repr(VIRTUAL_SEAT_S),
            "--seed", str(seed), "--seeds", str(seeds)]  # fmt: skip
    argv += ["--quick"] if quick else []
    argv += ["--twin"] if variant == "twin" else []
    path = [str(today_tree), str(ROOT)] if variant == "today" else [str(ROOT)]
    env = {**scrubbed_env(), "PYTHONPATH": os.pathsep.join(path)}
    started = time.monotonic()
    done = subprocess.run(
        argv, cwd=ROOT, env=env, capture_output=True, check=True, timeout=VIRTUAL_TIMEOUT_S
    )
    run = Run(variant, wall_s=time.monotonic() - started)
    run.outcomes = [_VIRTUAL[o] for o in json.loads(done.stdout)["outcomes"]]
    return run


def summarize(scenario: Scenario, runs: dict[str, Run], note: str = "") -> dict[str, Any]:
    twin = runs["twin"].outcomes
    requests = len(twin)
    row: dict[str, Any] = {
        "scenario": scenario.name,
        "description": scenario.description + note,
        "requests": requests,
    }
    for variant, run in runs.items():
        reasons: dict[str, int] = {}
        for outcome in run.outcomes:
            key = (
                "completed"
                if outcome.status == 200
                else outcome.reason or f"status {outcome.status}"
            )
            reasons[key] = reasons.get(key, 0) + 1
        refused = [i for i, o in enumerate(run.outcomes) if o.reason == REFUSED]
        false = [i for i in refused if twin[i].status == 200]
        timeouts = reasons.get(QUEUE_TIMEOUT, 0)
        completed = reasons.get("completed", 0)
        row[variant] = {
            "refused": len(refused),
            "false_refusals": len(false),
            "false_refusal_pct": 100.0 * len(false) / requests,
            "queue_timeouts": timeouts,
            "queue_timeout_pct": 100.0 * timeouts / requests,
            "completed": completed,
            "served_minus_twin": completed - sum(1 for o in twin if o.status == 200),
            "outcomes": dict(sorted(reasons.items())),
            "wall_s": run.wall_s,
            "settle_s": run.settle_s,
        }
    if "again" in runs:
        row["noise"] = noise(runs["normal"], runs["again"])
    return row


def noise(first: Run, second: Run) -> dict[str, Any]:
    """The per-request comparison's own noise: refusals of one run of ``normal`` that a
    second run of the same proxy, given the same arrivals, served (each way).

    Nothing differs between the two runs but the machine's timing, so this is
    the part of a false-refusal count that timing alone produces on this
    machine (near the budget, which of two requests is served turns on a few
    milliseconds); the mean of the two directions is reported.
    """
    requests = len(first.outcomes)

    def refused_there_served_here(there: Run, here: Run) -> int:
        return sum(
            1
            for a, b in zip(there.outcomes, here.outcomes, strict=True)
            if a.reason == REFUSED and b.status == 200
        )

    one, two = refused_there_served_here(first, second), refused_there_served_here(second, first)
    return {
        "refused_first_served_second": one,
        "refused_second_served_first": two,
        "noise_pct": 100.0 * (one + two) / 2 / requests,
    }


def judge(row: dict[str, Any]) -> dict[str, bool]:
    """Targets: no false refusal on a burst after idle, at most 1% elsewhere, and
    no more queue timeouts than today."""
    normal = row["normal"]
    limit = 0.0 if row["scenario"] == "burst_after_idle" else 1.0
    verdict = {"false_refusals": normal["false_refusal_pct"] <= limit}
    if "today" in row:
        verdict["queue_timeouts"] = normal["queue_timeouts"] <= row["today"]["queue_timeouts"]
    return verdict


def table(rows: Sequence[dict[str, Any]]) -> str:
    lines = [
        "| scenario | requests | proxy | refused | false refusals | queue timeouts | completed "
        "| served - twin |",
        "|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        for variant in VARIANTS:
            if variant not in row:
                continue
            v = row[variant]
            false = (
                "n/a" if variant == "twin"
                else f"{v['false_refusals']} ({v['false_refusal_pct']:.1f}%)"
            )  # fmt: skip
            lines.append(
                f"| {row['scenario']} | {row['requests']} | {variant} | {v['refused']} | {false} "
                f"| {v['queue_timeouts']} ({v['queue_timeout_pct']:.1f}%) | {v['completed']} "
                f"| {v['served_minus_twin']:+d} |"
            )
    return "\n".join(lines)


async def bench(
    quick: bool,
    seed: int,
    today_rev: str,
    only: Sequence[str] | None = None,
    variants: Sequence[str] = VARIANTS,
    trace: Path | None = None,
) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    virtual_rows: list[dict[str, Any]] = []
    seat_s = 0.0
    with tempfile.TemporaryDirectory(prefix="false-refusals-") as tmp:
        workdir = Path(tmp)
        today_tree = export_today(today_rev, workdir / "today")
        calibrated = await run_variant("normal", calibration(), workdir, today_tree)
        seat_s = statistics.median(o.latency_s for o in calibrated.outcomes if o.status == 200)
        print(f"  seat time of a 10-token request: {seat_s * 1000:.1f} ms", file=sys.stderr)
        if quick:
            variants = [v for v in variants if v in ("normal", "twin")]
        for scenario in scenarios(quick, seed, seat_s):
            if only and scenario.name not in only:
                continue
            runs = {}
            for variant in variants:
                runs[variant] = await run_variant(variant, scenario, workdir, today_tree, trace)
                print(f"  {scenario.name} {variant}: {runs[variant].wall_s:.1f} s", file=sys.stderr)
            row = summarize(scenario, runs)
            row["pass"] = judge(row)
            rows.append(row)
            seeds = 1 if quick else VIRTUAL_SEEDS
            virtual = {
                v: run_virtual(v, scenario, quick, seed, seeds, today_tree)
                for v in VIRTUAL_VARIANTS
            }
            note = f" (virtual: {seeds} seeds, {VIRTUAL_SEAT_S * 1000:g} ms per 10 tokens)"
            row = summarize(scenario, virtual, note)
            row["pass"] = judge(row)
            virtual_rows.append(row)
    return {
        "benchmark": "false_refusals",
        "quick": quick,
        "seed": seed,
        "revision": revision(),
        "today_revision": None if quick else today_rev,
        "seat_time_10_tokens_ms": seat_s * 1000,
        "machine": machine("load generator, proxies and simulated replicas share the same CPUs"),
        "scenarios": rows,
        "virtual": virtual_rows,
    }


def serve(config_path: str, port: int, twin: bool, trace: str | None = None) -> int:
    """A proxy process for one run (``--serve``): no access log; twin: no prediction."""
    if trace:
        from bench.false_refusals_trace import install

        install(Path(trace))
    from bench.serving import run
    from proxy.app import build_app
    from proxy.settings import load_config

    config = load_config(config_path)
    kwargs: dict[str, Any] = {"predictive_rejection": False} if twin else {}
    run(build_app(config, access_log=False, **kwargs), "127.0.0.1", port)
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.false_refusals", description=__doc__)
    parser.add_argument(
        "--quick", action="store_true",
        help="shorter scenarios, normal and twin only (no 'today', no 'again'): under a minute",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--today", default=TODAY_REVISION, help="revision measured as 'today'")
    parser.add_argument("--output", type=Path, default=RESULTS, help="JSON results file")
    parser.add_argument(
        "--scenarios", nargs="+", choices=SCENARIOS, default=None, help="run only these"
    )
    parser.add_argument(
        "--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS),
        help="run only these proxies (the twin is always run: it judges the others)",
    )  # fmt: skip
    parser.add_argument(
        "--trace", type=Path, default=None,
        help="folder for each proxy's per-ticket predicted and realised waits (JSON lines)",
    )  # fmt: skip
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--twin", action="store_true", help=argparse.SUPPRESS)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.serve:
        return serve(args.serve, args.port, args.twin, str(args.trace) if args.trace else None)
    variants = [v for v in VARIANTS if v in args.variants or v == "twin"]
    if args.trace is not None:
        args.trace.mkdir(parents=True, exist_ok=True)
    result = asyncio.run(
        bench(args.quick, args.seed, args.today, args.scenarios, variants, args.trace)
    )
    if args.quick and args.output == RESULTS:
        args.output = RESULTS.with_name("false_refusals_quick.json")
    write_results(args.output, result)
    for title, rows in (("live", result["scenarios"]), ("virtual", result["virtual"])):
        print(f"\n{title}\n\n{table(rows)}\n")
        for row in rows:
            verdict = ", ".join(f"{k} {'PASS' if ok else 'FAIL'}" for k, ok in row["pass"].items())
            print(f"{title} {row['scenario']}: {verdict}")
            if "noise" in row:
                n = row["noise"]
                print(
                    f"{title} {row['scenario']}: refused by one run of normal and served by the "
                    f"other: {n['refused_first_served_second']} and "
                    f"{n['refused_second_served_first']} ({n['noise_pct']:.1f}%)"
                )
    print(f"written to {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
