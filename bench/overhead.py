"""Overhead benchmark (issue 2): this proxy against a bare pass-through.

Four targets in one run, each behind the same load of small non-streaming
chat completions, first closed loop (``--concurrency`` clients, the issue's
throughput and p50), then open loop at a fixed rate below saturation (the benchmark rule's
added p50):

- ``direct``: straight to ``bench.fast_upstream``, the floor;
- ``passthrough``: through ``bench.passthrough``, the in-run baseline;
- ``proxy``: through ``admission-proxy serve`` (one replica, one tenant), its
  telemetry as it ships: metrics and access log on, tracing off (no
  ``OTEL_*`` configured);
- ``proxy+tracing``: the same with tracing on, exporting OTLP/HTTP to
  ``bench.otlp_sink`` ("each with telemetry on and off").

The figures that matter are ratios against the pass-through measured in the
same round: req/s (target at least 0.8), added p50 (target at most 1 ms) and
CPU per request (process CPU seconds over requests, from ``/proc/<pid>/stat``,
the front process alone with all its threads, never the upstream); and the
cost of tracing, ``proxy+tracing`` against ``proxy`` in the same round. The
spans the sink received, over the requests the tracing proxy was sent, show
whether the exporter kept up. Rounds rotate the order of the targets so that
machine noise favours none; each figure is the median over rounds. Servers
are children on loopback ports the OS picks; they are stopped in ``finally``,
also on Ctrl-C.

    .venv/bin/python -m bench.overhead [--requests 8000] [--concurrency 32] [--warmup 1000]
        [--rounds 5] [--open-requests 4000] [--rate R]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp
import uvloop
import yaml

from bench.common import (
    SCRUBBED_ENV,
    cpu_line,
    machine,
    own_cpu,
    revision,
    scrubbed_env,
    summarize_rounds,
)
from bench.load import Requester, closed_loop, load_session, open_loop
from bench.processes import (
    Server,
    free_port,
    listen_overflows,
    start_server,
    start_upstream_and_passthrough,
    stop_server,
    wait_ready,
)
from proxy.settings import ConfigError, load_config

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "overhead.json"
TARGETS = ("direct", "passthrough", "proxy", "proxy+tracing")
TRACED = "proxy+tracing"
API_KEY = "sk-bench-overhead"
TENANT = "bench"
PATH = "/v1/chat/completions"
BODY = json.dumps(
    {
        "model": "bench-model",
        "messages": [{"role": "user", "content": "Say ok."}],
        "max_tokens": 8,
    }
).encode()
#: The pass-through and direct runs send the same key: nothing there reads it.
HEADERS = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}

#: CPU is counted in 10 ms ticks: 8000 requests keep that near 1% of the pass-through's CPU.
DEFAULT_REQUESTS = 8_000
DEFAULT_WARMUP = 1_000
DEFAULT_CONCURRENCY = 32
DEFAULT_ROUNDS = 5
DEFAULT_OPEN_REQUESTS = 4_000
#: The open-loop rate, as a share of the slowest target's closed-loop throughput.
OPEN_LOOP_LOAD = 0.5
#: Open-loop connections, all opened by the warm-up: a pool that grows mid-run
#: sends bursts of SYNs that overflow the servers' listen backlog (aiohttp's
#: default, 128), and each dropped SYN costs its request a 1 s retransmit. At
#: most the proxy's seats, so the warm-up never queues there.
OPEN_LOOP_CONNECTIONS = 64
#: A measured run stops here even when its request count is not reached.
RUN_CAP_S = 30.0
REQUEST_TIMEOUT_S = 10.0
#: Replica seats and tenant queue, comfortably above the benchmark's clients.
PROXY_SEATS = 64
PROXY_QUEUE = 64
#: Issue 2's targets, against the pass-through.
MIN_RPS_RATIO = 0.8
MAX_ADDED_P50_MS = 1.0
READY_TIMEOUT_S = 20.0
#: Spans a traced, completed chat request makes: proxy.request, .entrance,
#: .queue, .upstream, .batch, .gpu (docs/REFERENCE.md).
SPANS_PER_REQUEST = 6
#: After a traced run, how long to wait for its exporter to deliver the last
#: spans (the SDK's batch processor sends a partial batch after 5 s), so that
#: its thread does not take CPU from the next target's run.
EXPORT_DRAIN_S = 7.0


# -- the three servers ---------------------------------------------------------------


def _proxy_config(workdir: Path, port: int, upstream_url: str) -> Path:
    document = {
        "server": {"host": "127.0.0.1", "port": port},
        "replicas": [{"name": "fast", "url": upstream_url, "max_concurrency": PROXY_SEATS}],
        "tenants": {TENANT: {"api_keys": [API_KEY], "queue_capacity": PROXY_QUEUE}},
    }
    path = workdir / f"proxy-{port}.yaml"
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    load_config(path)  # a bad config fails here, not as a proxy that never gets ready
    return path


def _proxy_env(otlp_endpoint: str | None = None) -> dict[str, str]:
    env = scrubbed_env()
    if otlp_endpoint is not None:
        env["OTEL_EXPORTER_OTLP_ENDPOINT"] = otlp_endpoint
    return env


def sink_stats(sink: Server) -> dict[str, int]:
    """What ``bench.otlp_sink`` received: exports, bytes, spans, invalid."""
    with urllib.request.urlopen(sink.url + "/stats", timeout=5.0) as response:
        stats: dict[str, int] = json.loads(response.read())
    return stats


@contextmanager
def servers(workdir: Path, exported: dict[str, int]) -> Iterator[dict[str, Server]]:
    """Upstream, pass-through, OTLP sink and both proxies; stopped in reverse order.

    The traced proxy stops first (its exporter flushes on the way out), then
    the sink's counts go into ``exported``.
    """
    started: list[Server] = []
    python = sys.executable
    command = str(Path(python).parent / "admission-proxy")
    try:
        upstream = start_upstream_and_passthrough(workdir, started)
        port = free_port()
        sink = start_server(
            "sink", [python, "-m", "bench.otlp_sink", "--port", str(port)], port, "/health",
            workdir,
        )  # fmt: skip
        started.append(sink)
        for name, otlp in (("proxy", None), (TRACED, sink.url)):
            port = free_port()
            config = _proxy_config(workdir, port, upstream.url)
            started.append(start_server(
                name, [command, "serve", "--config", str(config)],
                port, "/readyz", workdir, env=_proxy_env(otlp),
            ))  # fmt: skip
        running = {s.name: s for s in started}
        running["direct"] = running.pop("upstream")
        yield running
    finally:
        for server in reversed(started):
            if server.name == "sink" and server.process.poll() is None:
                try:
                    exported.update(sink_stats(server))
                except OSError as exc:
                    print(f"overhead: no span counts from the sink: {exc}", file=sys.stderr)
            stop_server(server)


# -- measuring ------------------------------------------------------------------------


@dataclass(slots=True)
class Run:
    """One measured run of one target."""

    target: str
    mode: str
    round: int
    requests: int
    #: Every request the target was sent in this run, warm-up included.
    sent: int
    errors: int
    error_kinds: dict[str, int]
    elapsed_s: float
    capped: bool
    rps: float
    p50_ms: float
    p99_ms: float
    #: CPU ms per request of the process the clients talk to (the upstream for ``direct``).
    front_cpu_ms: float
    upstream_cpu_ms: float
    loadgen_cpu_ms: float
    #: Accept-queue overflows during the run (each delays a connection by a 1 s SYN retry).
    listen_overflows: int


async def measure(
    target: str,
    round_no: int,
    running: dict[str, Server],
    args: argparse.Namespace,
    rate: float | None,
) -> Run:
    """Warm up, then one measured run: closed loop, or open loop when ``rate`` is given."""
    front, upstream = running[target], running["direct"]
    limit = args.concurrency if rate is None else OPEN_LOOP_CONNECTIONS
    async with load_session(limit, total_s=REQUEST_TIMEOUT_S) as session:
        url = front.url + PATH
        warm = Requester(session, url, BODY, HEADERS)
        warmed = await closed_loop(warm, max(args.warmup, limit), limit, RUN_CAP_S)  # opens all
        requester = Requester(session, url, BODY, HEADERS)
        overflows = listen_overflows()
        before = (front.cpu(), upstream.cpu(), own_cpu())
        if rate is None:
            sample = await closed_loop(requester, args.requests, args.concurrency, RUN_CAP_S)
        else:
            sample = await open_loop(requester, args.open_requests, rate, RUN_CAP_S)
        after = (front.cpu(), upstream.cpu(), own_cpu())
        overflows = listen_overflows() - overflows
    wanted = args.requests if rate is None else args.open_requests
    cpu = [(b - a) * 1000.0 / max(1, sample.ok) for a, b in zip(before, after, strict=True)]
    return Run(
        target=target,
        mode="closed" if rate is None else "open",
        round=round_no,
        requests=sample.ok,
        sent=warmed.ok + warmed.errors + sample.ok + sample.errors,
        errors=sample.errors,
        error_kinds=sample.error_kinds,
        elapsed_s=round(sample.elapsed_s, 3),
        capped=sample.ok + sample.errors < wanted,
        rps=sample.rps(),
        p50_ms=sample.percentile_ms(0.50),
        p99_ms=sample.percentile_ms(0.99),
        front_cpu_ms=cpu[0],
        upstream_cpu_ms=cpu[1],
        loadgen_cpu_ms=cpu[2],
        listen_overflows=overflows,
    )


def rotation(round_no: int) -> tuple[str, ...]:
    """Round 0: direct, passthrough, proxy, proxy+tracing; each later round starts one on."""
    shift = round_no % len(TARGETS)
    return TARGETS[shift:] + TARGETS[:shift]


async def drain_exporter(sink: Server, expected_spans: int) -> bool:
    """Wait until the sink holds ``expected_spans``, at most ``EXPORT_DRAIN_S``."""
    deadline = time.monotonic() + EXPORT_DRAIN_S
    async with aiohttp.ClientSession() as session:
        while True:
            async with session.get(sink.url + "/stats") as response:
                spans = int((await response.json())["spans"])
            if spans >= expected_spans:
                return True
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.05)


async def _rounds(
    args: argparse.Namespace,
    running: dict[str, Server],
    rate: float | None,
    earlier: Sequence[Run] = (),
) -> list[Run]:
    runs: list[Run] = []
    traced_sent = sum(r.sent for r in earlier if r.target == TRACED)
    for round_no in range(args.rounds):
        for target in rotation(round_no):
            run = await measure(target, round_no, running, args, rate)
            runs.append(run)
            drained = True
            if target == TRACED:
                traced_sent += run.sent
                drained = await drain_exporter(running["sink"], SPANS_PER_REQUEST * traced_sent)
            print(
                f"  {run.mode:<6} round {round_no} {target:<13} {run.rps:7.0f} req/s"
                f"  p50 {run.p50_ms:6.2f} ms  p99 {run.p99_ms:6.2f} ms"
                f"  cpu {run.front_cpu_ms:.3f} ms/req  errors {run.error_kinds or 0}"
                f"{f'  listen overflows {run.listen_overflows}' if run.listen_overflows else ''}"
                f"{'  (time cap)' if run.capped else ''}"
                f"{'' if drained else '  (exporter still behind after the run)'}",
                flush=True,
            )
    return runs


def open_rate(closed: Sequence[Run]) -> float:
    """Half the slowest target's closed-loop throughput, in whole hundreds: below saturation."""
    slowest = min(
        statistics.median(r.rps for r in closed if r.target == target) for target in TARGETS
    )
    return max(100.0, (slowest * OPEN_LOOP_LOAD) // 100 * 100)


async def bench(
    args: argparse.Namespace, running: dict[str, Server]
) -> tuple[list[Run], float | None]:
    """Every closed-loop round, then every open-loop round; returns the runs and the rate.

    SIGTERM cancels it, like Ctrl-C, so the servers are stopped on the way out.
    """
    task = asyncio.current_task()
    assert task is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
    async with aiohttp.ClientSession() as probe:
        for server in running.values():
            await wait_ready(probe, server, READY_TIMEOUT_S)
    print("closed loop:", flush=True)
    runs = await _rounds(args, running, None)
    if args.open_requests <= 0:
        return runs, None
    rate: float = args.rate or open_rate(runs)
    print(f"open loop at {rate:.0f} req/s:", flush=True)
    runs += await _rounds(args, running, rate, runs)
    return runs, rate


# -- report ---------------------------------------------------------------------------

FIELDS = ("rps", "p50_ms", "p99_ms", "front_cpu_ms", "upstream_cpu_ms", "loadgen_cpu_ms")


def summarize(runs: Sequence[Run]) -> dict[str, Any]:
    """Medians over rounds per target, and the median of per-round ratios to the pass-through."""
    return summarize_rounds(runs, TARGETS, FIELDS, _round_ratios)


def _round_ratios(rr: dict[str, Run]) -> dict[str, float]:
    """One round's figures: the proxy against the pass-through, and tracing on against off."""
    return {
        "rps_ratio": rr["proxy"].rps / rr["passthrough"].rps,
        "added_p50_ms": rr["proxy"].p50_ms - rr["passthrough"].p50_ms,
        "added_p99_ms": rr["proxy"].p99_ms - rr["passthrough"].p99_ms,
        "cpu_ratio": rr["proxy"].front_cpu_ms / rr["passthrough"].front_cpu_ms,
        "added_cpu_ms": rr["proxy"].front_cpu_ms - rr["passthrough"].front_cpu_ms,
        "passthrough_vs_direct_rps": rr["passthrough"].rps / rr["direct"].rps,
        # Tracing on against off, and the traced proxy against the pass-through.
        "tracing_rps_ratio": rr[TRACED].rps / rr["proxy"].rps,
        "tracing_added_p50_ms": rr[TRACED].p50_ms - rr["proxy"].p50_ms,
        "tracing_cpu_ratio": rr[TRACED].front_cpu_ms / rr["proxy"].front_cpu_ms,
        "tracing_added_cpu_ms": rr[TRACED].front_cpu_ms - rr["proxy"].front_cpu_ms,
        "traced_rps_ratio": rr[TRACED].rps / rr["passthrough"].rps,
        "traced_added_p50_ms": rr[TRACED].p50_ms - rr["passthrough"].p50_ms,
        "traced_cpu_ratio": rr[TRACED].front_cpu_ms / rr["passthrough"].front_cpu_ms,
    }


def verdicts(closed: dict[str, Any], opened: dict[str, Any] | None) -> dict[str, bool]:
    result = {
        "closed_rps_ratio": closed["ratios"]["rps_ratio"] >= MIN_RPS_RATIO,
        "closed_added_p50": closed["ratios"]["added_p50_ms"] <= MAX_ADDED_P50_MS,
    }
    if opened is not None:
        result["open_added_p50"] = opened["ratios"]["added_p50_ms"] <= MAX_ADDED_P50_MS
    return result


def _mark(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def targets_table(summary: dict[str, Any]) -> list[str]:
    lines = [
        "| target | req/s | p50 ms | p99 ms | CPU ms/req (front) | CPU ms/req (upstream) "
        "| CPU ms/req (load gen) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name in TARGETS:
        row = summary["targets"][name]
        upstream = "(is front)" if name == "direct" else f"{row['upstream_cpu_ms']:.3f}"
        lines.append(
            f"| {name} | {row['rps']:.0f} | {row['p50_ms']:.2f} | {row['p99_ms']:.2f} "
            f"| {row['front_cpu_ms']:.3f} | {upstream} | {row['loadgen_cpu_ms']:.3f} |"
        )
    return lines


def spans_per_request(runs: Sequence[Run], exported: dict[str, int]) -> float | None:
    """Spans the sink received per request sent to the traced proxy (warm-up included)."""
    sent = sum(r.sent for r in runs if r.target == TRACED)
    if not sent or "spans" not in exported:
        return None
    return exported["spans"] / sent


def tracing_table(
    closed: dict[str, Any], opened: dict[str, Any] | None, spans: float | None
) -> list[str]:
    c = closed["ratios"]
    lines = [
        "| tracing on (proxy+tracing) against off (proxy), median of per-round figures | value |",
        "|---|---:|",
        f"| closed loop: req/s ratio | {c['tracing_rps_ratio']:.2f} |",
        f"| closed loop: added p50 | {c['tracing_added_p50_ms']:+.2f} ms |",
        f"| closed loop: CPU per request ratio | {c['tracing_cpu_ratio']:.2f} "
        f"({c['tracing_added_cpu_ms']:+.3f} ms) |",
    ]
    if opened is not None:
        o = opened["ratios"]
        lines += [
            f"| open loop: added p50 | {o['tracing_added_p50_ms']:+.2f} ms |",
            f"| open loop: CPU per request ratio | {o['tracing_cpu_ratio']:.2f} "
            f"({o['tracing_added_cpu_ms']:+.3f} ms) |",
        ]
    lines += [
        f"| proxy+tracing against the pass-through, closed loop: req/s ratio "
        f"| {c['traced_rps_ratio']:.2f} |",
        f"| proxy+tracing against the pass-through, closed loop: added p50 "
        f"| {c['traced_added_p50_ms']:+.2f} ms |",
        f"| proxy+tracing against the pass-through, closed loop: CPU per request ratio "
        f"| {c['traced_cpu_ratio']:.2f} |",
    ]
    if spans is not None:
        lines.append(
            f"| spans received by the sink per request sent (expected {SPANS_PER_REQUEST}) "
            f"| {spans:.2f} |"
        )
    return lines


def report(
    args: argparse.Namespace,
    closed: dict[str, Any],
    opened: dict[str, Any] | None,
    rate: float | None,
    passed: dict[str, bool],
    spans: float | None = None,
) -> str:
    c = closed["ratios"]
    lines = [
        f"Closed loop, {args.concurrency} clients ({args.requests} requests per run, "
        f"median of {args.rounds} rounds):",
        "",
        *targets_table(closed),
    ]
    if opened is not None:
        lines += [
            "",
            f"Open loop at {rate:.0f} req/s ({args.open_requests} requests per run, "
            f"median of {args.rounds} rounds):",
            "",
            *targets_table(opened),
        ]
    lines += [
        "",
        "| this proxy against the pass-through (median of per-round figures) | value | target |",
        "|---|---:|---|",
        f"| closed loop: req/s ratio | {c['rps_ratio']:.2f} | >= {MIN_RPS_RATIO} "
        f"{_mark(passed['closed_rps_ratio'])} |",
        f"| closed loop: added p50 | {c['added_p50_ms']:+.2f} ms | <= {MAX_ADDED_P50_MS} ms "
        f"{_mark(passed['closed_added_p50'])} |",
        f"| closed loop: added p99 | {c['added_p99_ms']:+.2f} ms | (reported) |",
        f"| closed loop: CPU per request ratio | {c['cpu_ratio']:.2f} "
        f"({c['added_cpu_ms']:+.3f} ms) | (reported) |",
    ]
    if opened is not None:
        o = opened["ratios"]
        lines += [
            f"| open loop: added p50 | {o['added_p50_ms']:+.2f} ms | <= {MAX_ADDED_P50_MS} ms "
            f"{_mark(passed['open_added_p50'])} |",
            f"| open loop: added p99 | {o['added_p99_ms']:+.2f} ms | (reported) |",
            f"| open loop: CPU per request ratio | {o['cpu_ratio']:.2f} "
            f"({o['added_cpu_ms']:+.3f} ms) | (reported) |",
        ]
    lines.append(
        f"| context: pass-through req/s / direct req/s | {c['passthrough_vs_direct_rps']:.2f} | |"
    )
    lines += ["", *tracing_table(closed, opened, spans)]
    return "\n".join(lines)


def _tracing_note() -> str:
    scrubbed = sorted(k for k in os.environ if k.startswith(SCRUBBED_ENV))
    removed = f" (removed from their environment: {', '.join(scrubbed)})" if scrubbed else ""
    return (
        "the proxies' telemetry: Prometheus metrics on, access log on (to /dev/null); "
        f"proxy: OTEL tracing not configured, no exporter{removed}; "
        "proxy+tracing: OTEL_EXPORTER_OTLP_ENDPOINT set to bench.otlp_sink "
        "(OTLP/HTTP, the SDK's default batch processor)"
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.overhead", description=__doc__.splitlines()[0]
    )
    add = parser.add_argument
    add(
        "--requests",
        type=int,
        default=DEFAULT_REQUESTS,
        help="measured requests per closed-loop run",
    )
    add("--warmup", type=int, default=DEFAULT_WARMUP, help="unmeasured requests before each run")
    add("--concurrency", type=int, default=DEFAULT_CONCURRENCY, help="closed-loop clients")
    add("--rounds", type=int, default=DEFAULT_ROUNDS, help="rounds; target order rotates")
    add(
        "--open-requests",
        type=int,
        default=DEFAULT_OPEN_REQUESTS,
        help="measured requests per open-loop run (0: no open loop)",
    )
    add(
        "--rate",
        type=float,
        default=None,
        help="open-loop req/s (default: half the slowest target's closed-loop req/s)",
    )
    add("--output", type=Path, default=RESULTS, help="JSON results file")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    print(
        f"overhead: {args.rounds} rounds x {len(TARGETS)} targets; closed loop "
        f"{args.requests} requests (+{args.warmup} warm-up), {args.concurrency} clients; "
        f"open loop {args.open_requests} requests; {os.cpu_count()} CPUs shared by the "
        "load generator and the servers"
    )
    print(_tracing_note(), flush=True)
    print(cpu_line(), flush=True)
    started = time.monotonic()
    exported: dict[str, int] = {}
    try:
        with (
            tempfile.TemporaryDirectory(prefix="bench-overhead-") as tmp,
            servers(Path(tmp), exported) as running,
        ):
            runs, rate = uvloop.run(bench(args, running))
            crashed = [s.name for s in running.values() if s.process.poll() is not None]
    except (KeyboardInterrupt, asyncio.CancelledError):
        print("interrupted", file=sys.stderr)
        return 130
    except (RuntimeError, ConfigError) as exc:
        print(f"overhead: {exc}", file=sys.stderr)
        return 1
    if crashed:
        print(f"overhead: servers exited during the run: {crashed}", file=sys.stderr)
        return 1
    closed = summarize([r for r in runs if r.mode == "closed"])
    open_runs = [r for r in runs if r.mode == "open"]
    opened = summarize(open_runs) if open_runs else None
    passed = verdicts(closed, opened)
    spans = spans_per_request(runs, exported)
    print()
    print(report(args, closed, opened, rate, passed, spans))
    result = {
        "benchmark": "overhead",
        "command": "python -m bench.overhead " + " ".join(sys.argv[1:] if argv is None else argv),
        "parameters": {
            "requests": args.requests, "warmup": args.warmup, "concurrency": args.concurrency,
            "rounds": args.rounds, "open_requests": args.open_requests, "open_rate": rate,
            "body_bytes": len(BODY), "run_cap_s": RUN_CAP_S,
        },
        "revision": revision(),
        "telemetry": _tracing_note(),
        "machine": machine("load generator, proxy and upstream share the same CPUs"),
        "wall_s": round(time.monotonic() - started, 1),
        "closed_loop": closed,
        "open_loop": opened,
        "tracing_export": {**exported, "spans_per_request": spans,
                           "expected_spans_per_request": SPANS_PER_REQUEST},
        "pass": passed,
        "runs": [asdict(r) for r in runs],
    }  # fmt: skip
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nresults: {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
