"""Retry-storm benchmark (issue 4): budgeted retries against naive ones.

End to end on the simulator: two simulated replicas (``admission-proxy sim``
child processes) with ``SLOTS`` seats each, one of which answers half its
inference requests with an immediate 503 (switched on after the proxy's
warm-up, which also goes through the engine). The proxy runs in this process
with the same seats (``max_concurrency`` equals the engine's slots) and one
tenant. Open-loop Poisson arrivals of small non-streaming chat requests are
offered at ``LOAD`` (1.5) times the healthy fleet's capacity, which is
measured at the start of the run with a closed loop straight at the replicas
(every seat busy, no fault, no proxy).

Policies, each against fresh replicas and a fresh proxy, in an order that
rotates from round to round:

- naive: ``max_attempts: 3`` and a retry budget that never refuses
  (``budget_ratio: 1000``, ``min_retries_per_s: 1000000``);
- budgeted: the proxy's defaults (``max_attempts: 2``, ``budget_ratio: 0.2``,
  ``min_retries_per_s: 3``);
- none: ``max_attempts: 1`` (context).

Backoff and ``retry_on`` are the defaults for all three (200 ms base, 2 s
cap, full jitter; 503 is retried).

Figures per policy, over the requests due in the measured window: upstream
attempts per dispatched request and per client request sent (from the proxy's
access log, one line per request; the replicas' own counters beside them),
goodput (answered 200 within ``SLO_TOTAL_MS`` of being sent), p50/p99
latency and answers by ``X-Admission-Reason``. A request is dispatched when
it made at least one upstream attempt. Targets: budgeted attempts per
dispatched request under 1.25 with the retry floor under 5% of the dispatch
rate, and budgeted goodput at least naive's. Results go to
``bench/results/retry_storm.json``. A replica counter that cannot be read
(``/sim/stats`` down, slow or garbled) is recorded as missing, its figures
print ``n/a`` and the run goes on; the report counts what is missing.

    .venv/bin/python -m bench.retry_storm [--seconds N] [--rounds N] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import aiohttp
import structlog
import uvloop
import yaml
from prometheus_client import CollectorRegistry

from bench.common import Readings, cpu_line, machine, revision, write_results
from bench.load import Arrivals, load_session, percentile, refusal_reason
from bench.processes import Sims, sim_stats
from bench.retry_storm_fleet import running_proxy, set_faults, wait_healthy
from bench.retry_storm_report import (
    Result,
    Run,
    Stats,
    Summary,
    figure_table,
    figures,
    missing_report,
    policy_table,
    read_access_log,
    reasons_table,
    rounds_table,
    run_stats,
    slo_table,
    summarize,
)
from proxy.settings import Config, ConfigError, parse_config

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "retry_storm.json"
PATH = "/v1/chat/completions"

# -- the fleet --------------------------------------------------------------------------

REPLICAS = 2
#: Engine slots per replica, and the proxy's ``max_concurrency`` for it: equal,
#: so the proxy, not the engine, does the queueing.
SLOTS = 8
#: A fast engine, so that capacity (and so the request rate) is far above the
#: retry floor: a 4 ms decode step plus 0.5 ms per running sequence.
SIM_ARGS = ("--decode-base-ms", "4", "--decode-per-seq-ms", "0.5",
            "--prefill-ms-per-token", "0.05")  # fmt: skip
#: Every request is the same: a 24-word prompt (36 tokens as the sim counts), 8 tokens out.
PROMPT = "lorem " * 24
MAX_TOKENS = 8
#: The failing replica (by index), and its fault.
FAULTY = 1
ERROR_RATE = 0.5
ERROR_STATUS = 503

# -- the traffic ------------------------------------------------------------------------

#: Offered load over the healthy fleet's measured capacity.
LOAD = 1.5
#: Goodput: answered 200 within this many ms of being sent. The tenant's queue
#: budget (``QUEUE_MS``) is half of it: what an operator with a 1 s SLO would set.
SLO_TOTAL_MS = 1000.0
#: Goodput is also reported at these SLOs (ms), to show how much the choice matters.
SLO_SWEEP_MS = (600.0, 800.0, 1000.0, 1500.0, math.inf)

# -- the proxy --------------------------------------------------------------------------

API_KEY = "sk-retry-storm"
#: Deeper than ``QUEUE_MS`` of the fleet's dispatches, so the queue budget, not
#: the capacity, bounds the queue.
QUEUE_CAPACITY = 128
QUEUE_MS = 500
#: Long enough that the deadline never cuts a retry short: the policy decides.
TOTAL_MS = 10_000
#: The defaults, written out: the same for every policy.
RETRY_COMMON = {"base_backoff_ms": 200, "max_backoff_ms": 2000, "jitter": "full"}


@dataclass(frozen=True, slots=True)
class Policy:
    key: str
    title: str
    retry: dict[str, Any]


POLICIES = (
    Policy("naive", "naive (3 attempts, no budget)",
           {"max_attempts": 3, "budget_ratio": 1000.0, "min_retries_per_s": 1_000_000.0}),
    Policy("budgeted", "budgeted (defaults)",
           {"max_attempts": 2, "budget_ratio": 0.2, "min_retries_per_s": 3.0}),
    Policy("none", "no retries (context)", {"max_attempts": 1}),
)  # fmt: skip
POLICY_KEYS = tuple(p.key for p in POLICIES)
TITLES = {p.key: p.title for p in POLICIES}

# -- targets ----------------------------------------------------------------------------

MAX_ATTEMPTS_PER_REQUEST = 1.25
MAX_FLOOR_SHARE = 0.05

# -- timing -----------------------------------------------------------------------------

DEFAULT_SECONDS = 12.0
DEFAULT_ROUNDS = 3
#: Before the window: long enough for the queue to fill to its budget and for
#: the retry budget's start-up allowance (its floor over a whole 10 s window
#: with no history) to be spent.
WARMUP_S = 3.0
QUICK_SECONDS = 4.0
QUICK_WARMUP_S = 2.0
#: After the last arrival, open requests get this long, then are cut (``unfinished``).
DRAIN_S = 5.0
CLIENT_TIMEOUT_S = 15.0
UNCONTENDED_REQUESTS = 30
CALIBRATE_WARMUP_S = 1.0
#: One-second windows of the closed loop; capacity is their median.
CALIBRATE_WINDOWS = 5
#: Load-generator connections: open-loop requests must never wait for one.
CONNECTIONS = 4096
WARMUP_REACHED_TIMEOUT_S = 10.0


def proxy_config(sim_urls: Sequence[str], policy: Policy) -> Config:
    document = {
        "server": {"host": "127.0.0.1"},
        "replicas": [
            {"name": f"sim-{i}", "url": url, "max_concurrency": SLOTS}
            for i, url in enumerate(sim_urls)
        ],
        "budgets": {"queue_ms": QUEUE_MS, "total_ms": TOTAL_MS},
        "retry": {**RETRY_COMMON, **policy.retry},
        "tenants": {"storm": {"api_keys": [API_KEY], "queue_capacity": QUEUE_CAPACITY}},
    }
    return parse_config(yaml.safe_dump(document, sort_keys=False))


def request_body() -> bytes:
    body = {
        "model": "sim-model",
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": MAX_TOKENS,
    }
    return json.dumps(body).encode()


# -- the client -------------------------------------------------------------------------


async def send(session: aiohttp.ClientSession, url: str, body: bytes, result: Result) -> None:
    """One request; fills ``result`` in and never raises but CancelledError."""
    headers = {
        "Authorization": f"Bearer {API_KEY}",
        "Content-Type": "application/json",
        "X-Request-Id": result.request_id,
    }
    sent = time.perf_counter()
    try:
        async with session.post(url + PATH, data=body, headers=headers) as response:
            await response.read()
            result.status = response.status
            if response.status == 200:
                result.reason = ""
            else:
                result.reason = refusal_reason(response)
        result.total_s = time.perf_counter() - sent
    except (aiohttp.ClientError, TimeoutError) as exc:
        result.reason = type(exc).__name__


async def drive(
    session: aiohttp.ClientSession, url: str, rate: float, seconds: float
) -> list[Result]:
    """Poisson arrivals at ``rate`` for ``seconds``: the same arrivals for every policy.

    Whatever is still open ``DRAIN_S`` after the last arrival is cancelled and
    stays ``unfinished``.
    """
    rng = random.Random("retry-storm arrivals")
    body = request_body()
    results: list[Result] = []
    due = 0.0
    async with Arrivals(DRAIN_S) as arrivals:
        while True:
            due += rng.expovariate(rate)
            if due >= seconds:
                break
            await arrivals.until(due)
            result = Result(f"storm-{len(results)}", due)
            results.append(result)
            arrivals.launch(send(session, url, body, result))
    return results


# -- capacity ---------------------------------------------------------------------------


@dataclass(slots=True)
class Capacity:
    """The healthy fleet straight at the replicas: no fault, no proxy."""

    #: Throughput with every seat busy (``SLOTS`` closed-loop clients per replica):
    #: the median of ``windows_rps``, completions in each one-second window.
    rps: float
    windows_rps: list[int]
    #: Mean latency at that load (a full batch).
    service_ms: float
    #: p50 latency of one request at a time (an empty engine).
    uncontended_p50_ms: float
    seats: int


async def _post(session: aiohttp.ClientSession, url: str, body: bytes) -> None:
    headers = {"Content-Type": "application/json"}
    async with session.post(url + PATH, data=body, headers=headers) as response:
        await response.read()
        if response.status != 200:
            raise RuntimeError(f"calibration request failed: {response.status}")


async def calibrate(session: aiohttp.ClientSession, urls: Sequence[str]) -> Capacity:
    body = request_body()
    alone: list[float] = []
    for _ in range(UNCONTENDED_REQUESTS):
        sent = time.perf_counter()
        await _post(session, urls[0], body)
        alone.append((time.perf_counter() - sent) * 1000.0)
    t0 = time.perf_counter()
    stop_at = t0 + CALIBRATE_WARMUP_S + CALIBRATE_WINDOWS
    finished: list[tuple[float, float]] = []  # (sent, ended), seconds from t0

    async def client(url: str) -> None:
        while time.perf_counter() < stop_at:
            sent = time.perf_counter()
            await _post(session, url, body)
            finished.append((sent - t0, time.perf_counter() - t0))

    await asyncio.gather(*(client(url) for url in urls for _ in range(SLOTS)))
    # Completions per one-second window; the median shrugs off a window in which
    # something else on the machine took the CPUs.
    windows = [
        sum(1 for _, ended in finished if start <= ended < start + 1.0)
        for start in (CALIBRATE_WARMUP_S + i for i in range(CALIBRATE_WINDOWS))
    ]
    service = [e - s for s, e in finished if s >= CALIBRATE_WARMUP_S]
    return Capacity(
        rps=float(statistics.median(windows)),
        windows_rps=windows,
        service_ms=round(statistics.fmean(service) * 1000.0, 1) if service else float("nan"),
        uncontended_p50_ms=round(percentile(sorted(alone), 0.50), 1),
        seats=SLOTS * len(urls),
    )


# -- one run ----------------------------------------------------------------------------


def _process_cpu_s(pid: int) -> float:
    """User plus system CPU of a process (``/proc/<pid>/stat``); 0 where unreadable."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _cpu(sims: Sims) -> dict[str, float]:
    times = os.times()
    own = {"self": times.user + times.system}
    return own | {sim.name.rsplit("-", 1)[-1]: _process_cpu_s(sim.process.pid)
                  for sim in sims.sims}  # fmt: skip


async def _requests_received(session: aiohttp.ClientSession, url: str) -> int:
    return int((await sim_stats(session, url))["requests_total"])


async def _requests_total(
    session: aiohttp.ClientSession, urls: Sequence[str], readings: Readings, what: str
) -> list[int] | None:
    """Each replica's ``requests_total``, or None (recorded in ``readings``) when one
    could not be read: a partial fleet is not passed off as the whole."""
    counts = []
    for i, url in enumerate(urls):
        count = await readings.take(f"{what} (sim-{i})", partial(_requests_received, session, url))
        if count is None:
            return None
        counts.append(count)
    return counts


async def _requests_total_at(
    session: aiohttp.ClientSession,
    urls: Sequence[str],
    at: float,
    t0: float,
    readings: Readings,
    what: str,
) -> list[int] | None:
    delay = t0 + at - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)
    return await _requests_total(session, urls, readings, what)


async def _errors_injected(session: aiohttp.ClientSession, url: str) -> int:
    return int((await sim_stats(session, url))["errors_injected"])


def _differences(later: list[int] | None, earlier: list[int] | None) -> list[int] | None:
    """Per replica, later minus earlier; None when either reading is missing."""
    if later is None or earlier is None:
        return None
    return [b - a for a, b in zip(earlier, later, strict=True)]


def _counter(registry: CollectorRegistry, name: str) -> float:
    """A counter's value from a prometheus_client registry (0 when absent)."""
    for family in registry.collect():
        for sample in family.samples:
            if sample.name in (name, f"{name}_total"):
                return float(sample.value)
    return 0.0


async def run_policy(
    workdir: Path,
    control: aiohttp.ClientSession,
    load: aiohttp.ClientSession,
    policy: Policy,
    round_index: int,
    rate: float,
    warmup_s: float,
    seconds: float,
) -> Run:
    with Sims(workdir, f"{policy.key}-{round_index}") as sims:
        await sims.start(REPLICAS, ["--slots", str(SLOTS), *SIM_ARGS])
        await wait_healthy(control, sims)
        async with running_proxy(proxy_config(sims.urls, policy), seed=round_index) as proxy:
            # The warm-up request must have reached every engine before the fault is on
            # (a count that cannot be read yet is asked again, within the same deadline).
            deadline = time.monotonic() + WARMUP_REACHED_TIMEOUT_S
            while not all(await _requests_total(control, sims.urls, Readings(), "") or [0]):
                if time.monotonic() > deadline:
                    raise RuntimeError("the proxy's warm-up never reached the replicas")
                await asyncio.sleep(0.05)
            faulty = sims.urls[FAULTY]
            await set_faults(control, faulty, error_rate=ERROR_RATE, error_status=ERROR_STATUS)
            readings = Readings()
            before = await _requests_total(control, sims.urls, readings, "requests before")
            cpu_before = _cpu(sims)
            window = (warmup_s, warmup_s + seconds)
            t0 = time.perf_counter()
            marks = asyncio.gather(
                _requests_total_at(control, sims.urls, window[0], t0, readings, "window opens"),
                _requests_total_at(control, sims.urls, window[1], t0, readings, "window closes"),
            )
            try:
                results = await drive(load, proxy.url, rate, window[1])
            finally:
                opened, closed = await marks
            elapsed = time.perf_counter() - t0
            cpu_after = _cpu(sims)
            registry = proxy.runtime.telemetry.metrics.registry
            exhausted = _counter(registry, "admission_retry_budget_exhausted")
            log_text = proxy.access_log.getvalue()
        after = await _requests_total(control, sims.urls, readings, "requests after")
        injected = await readings.take(
            f"errors injected (sim-{FAULTY})", partial(_errors_injected, control, faulty)
        )
    for missing in readings.missing:
        print(f"  round {round_index} {policy.key}: {missing}; going on", flush=True)
    return Run(
        policy=policy.key,
        round=round_index,
        rate=rate,
        window=window,
        results=results,
        log=read_access_log(log_text),
        replicas_in_window=_differences(closed, opened),
        replicas_total=_differences(after, before),
        errors_injected=injected,
        retry_budget_exhausted=exhausted,
        elapsed_s=round(elapsed, 1),
        cpu_s={k: round(cpu_after[k] - cpu_before[k], 2) for k in cpu_before},
        missing=[str(m) for m in readings.missing],
    )


def rotation(rounds: int) -> list[tuple[int, tuple[Policy, ...]]]:
    """Round ``r`` starts with policy ``r`` (mod 3): each policy goes first in some round."""
    order = []
    for r in range(rounds):
        k = r % len(POLICIES)
        order.append((r, POLICIES[k:] + POLICIES[:k]))
    return order


async def bench(
    args: argparse.Namespace, workdir: Path
) -> tuple[Capacity, float, dict[str, list[Stats]]]:
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5.0)) as control,
        load_session(CONNECTIONS, total_s=CLIENT_TIMEOUT_S) as load,
    ):
        with Sims(workdir, "calibrate") as sims:
            await sims.start(REPLICAS, ["--slots", str(SLOTS), *SIM_ARGS])
            await wait_healthy(control, sims)
            capacity = await calibrate(load, sims.urls)
        rate = round(args.load * capacity.rps, 1)
        print(
            f"capacity: {capacity.rps:.1f} req/s with {capacity.seats} seats (one-second "
            f"windows: {', '.join(map(str, capacity.windows_rps))}; mean latency "
            f"{capacity.service_ms:.0f} ms at a full batch, {capacity.uncontended_p50_ms:.0f} ms "
            f"alone); offering {rate:.1f} req/s ({args.load:g}x)",
            flush=True,
        )
        stats: dict[str, list[Stats]] = {k: [] for k in POLICY_KEYS if k in args.policies}
        for round_index, order in rotation(args.rounds):
            for policy in order:
                if policy.key not in args.policies:
                    continue
                run = await run_policy(workdir, control, load, policy, round_index, rate,
                                       args.warmup, args.seconds)  # fmt: skip
                s = run_stats(run, SLO_TOTAL_MS, SLO_SWEEP_MS, faulty=f"sim-{FAULTY}")
                stats[policy.key].append(s)
                print(
                    f"  round {round_index} {policy.key:<8} sent {s.sent}, dispatched "
                    f"{s.dispatched}, attempts/dispatched {s.per_dispatched_log:.3f}, "
                    f"goodput {s.goodput_rps:.1f}/s, p99 {s.p99_ok_ms:.0f} ms "
                    f"({run.elapsed_s:.0f} s)",
                    flush=True,
                )
    return capacity, rate, stats


# -- entry point ------------------------------------------------------------------------


def _machine() -> dict[str, Any]:
    return {
        "revision": revision(),
        **machine(
            "load generator and proxy share this process's event loop; the replicas "
            "are child processes; all share the same CPUs"
        ),
    }


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.retry_storm", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--seconds", type=float, default=None,
        help=f"measured seconds per run (default {DEFAULT_SECONDS:.0f}; "
             f"--quick: {QUICK_SECONDS:.0f})",
    )  # fmt: skip
    parser.add_argument(
        "--rounds", type=int, default=None,
        help=f"rounds of every policy (default {DEFAULT_ROUNDS}; --quick: 1)",
    )  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="one short round, a smoke test")
    parser.add_argument(
        "--load", type=float, default=LOAD,
        help="offered load over measured capacity (default %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--policies", nargs="+", choices=POLICY_KEYS, default=list(POLICY_KEYS),
        help="run only these policies (default: all)",
    )  # fmt: skip
    parser.add_argument("--output", type=Path, default=RESULTS, help="JSON results file")
    return parser


def report(
    capacity: Capacity, rate: float, summaries: dict[str, Summary],
    stats: dict[str, list[Stats]], args: argparse.Namespace,
) -> tuple[str, list[Any]]:  # fmt: skip
    budgeted = next(p for p in POLICIES if p.key == "budgeted")
    items = figures(
        summaries, stats, max_attempts=MAX_ATTEMPTS_PER_REQUEST,
        min_retries_per_s=float(budgeted.retry["min_retries_per_s"]),
        max_floor_share=MAX_FLOOR_SHARE,
    )  # fmt: skip
    ordered = [summaries[k] for k in POLICY_KEYS if k in summaries]
    lines = [
        f"Fleet: {REPLICAS} simulated replicas x {SLOTS} seats; healthy capacity "
        f"{capacity.rps:.1f} req/s (closed loop straight at the replicas; latency "
        f"{capacity.service_ms:.0f} ms at a full batch, {capacity.uncontended_p50_ms:.0f} ms "
        f"alone). Offered: {rate:.1f} req/s, Poisson ({args.load:g}x). Replica sim-{FAULTY} "
        f"answers {ERROR_RATE:.0%} of requests with an immediate {ERROR_STATUS}. Tenant queue: "
        f"{QUEUE_MS} ms, {QUEUE_CAPACITY} places. Goodput: 200 within {SLO_TOTAL_MS:.0f} ms. "
        f"Medians over {args.rounds} round(s) of {args.seconds:.0f} s (after "
        f"{args.warmup:.0f} s of warm-up).",
        "",
        *policy_table(ordered, TITLES),
        "",
        *reasons_table(ordered, TITLES),
        "",
        *figure_table(items),
        "",
        *slo_table(ordered, TITLES),
        "",
        *rounds_table(stats),
        "",
        *missing_report(stats),
    ]
    return "\n".join(lines), items


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.seconds is None:
        args.seconds = QUICK_SECONDS if args.quick else DEFAULT_SECONDS
    if args.rounds is None:
        args.rounds = 1 if args.quick else DEFAULT_ROUNDS
    args.warmup = QUICK_WARMUP_S if args.quick else WARMUP_S
    if args.seconds <= 0 or args.rounds < 1 or args.load <= 0:
        print("retry_storm: --seconds, --rounds and --load must be positive", file=sys.stderr)
        return 2
    # The proxy's own info lines (no NVML, replica warmed) would interleave with the tables.
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    print(
        f"retry storm: {REPLICAS} replicas x {SLOTS} seats, replica {FAULTY} answers "
        f"{ERROR_RATE:.0%} of requests with {ERROR_STATUS}; {args.rounds} round(s) of "
        f"{len(args.policies)} policies, {args.warmup:.0f} s warm-up + {args.seconds:.0f} s "
        f"measured each; {os.cpu_count()} CPUs shared by everything",
        flush=True,
    )
    print(cpu_line(), flush=True)
    started = time.monotonic()
    try:
        with tempfile.TemporaryDirectory(prefix="bench-retry-storm-") as tmp:
            capacity, rate, stats = uvloop.run(bench(args, Path(tmp)))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except (RuntimeError, ConfigError) as exc:
        print(f"retry_storm: {exc}", file=sys.stderr)
        return 1
    summaries = {key: summarize(key, group) for key, group in stats.items()}
    text, items = report(capacity, rate, summaries, stats, args)
    print()
    print(text)
    given = " ".join(sys.argv[1:] if argv is None else argv)
    result = {
        "benchmark": "retry_storm",
        "command": f"python -m bench.retry_storm {given}".strip(),
        "parameters": {
            "replicas": REPLICAS, "slots": SLOTS, "sim_args": list(SIM_ARGS),
            "prompt_words": len(PROMPT.split()), "max_tokens": MAX_TOKENS, "faulty": FAULTY,
            "error_rate": ERROR_RATE, "error_status": ERROR_STATUS, "load": args.load,
            "rate_rps": rate, "queue_capacity": QUEUE_CAPACITY, "queue_ms": QUEUE_MS,
            "total_ms": TOTAL_MS, "retry_common": RETRY_COMMON,
            "policies": {p.key: p.retry for p in POLICIES if p.key in args.policies},
            "warmup_s": args.warmup, "seconds": args.seconds, "rounds": args.rounds,
            "drain_s": DRAIN_S, "client_timeout_s": CLIENT_TIMEOUT_S,
            "slo_total_ms": SLO_TOTAL_MS,
        },
        "capacity": asdict(capacity),
        "machine": _machine(),
        "wall_s": round(time.monotonic() - started, 1),
        "summaries": {k: asdict(s) for k, s in summaries.items()},
        "rounds": {k: [asdict(s) for s in group] for k, group in stats.items()},
        "figures": [asdict(f) for f in items],
        "readings_missing": sum(len(s.missing) for group in stats.values() for s in group),
        "pass": {f.name: f.passed for f in items if f.passed is not None},
    }  # fmt: skip
    write_results(args.output, result)
    print(f"\nresults: {args.output} ({result['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
