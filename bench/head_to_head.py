"""Head-to-head benchmark (issues 6, 8): the same replicas direct, behind HAProxy, behind us.

Two replicas whose engines run at most ``slots`` sequences at once, the knee:
beyond it an engine only queues (unbounded), so throughput is flat and
latency climbs. ``--engine sim`` (the default): two ``admission-proxy sim``
processes. ``--engine llama``: two real ``llama-server`` processes
(``--parallel 4``, one thread each, the tiny model of
``scripts/real-engine``), with longer answers and an SLO scaled to them.
Three targets front the same two replicas in one run:

- ``direct``: clients straight to the replicas, round-robin;
- ``haproxy``: HAProxy from Debian's packages, ``balance leastconn``,
  ``server ... maxconn slots``, ``timeout queue`` at the queue budget;
- ``proxy``: ``admission-proxy serve``, ``max_concurrency: slots`` per
  replica, ``budgets.queue_ms`` at the same queue budget, one tenant.

Capacity is measured first, in the same run: a closed loop of ``slots``
clients per replica straight to the replicas. Then, for each load multiple
(1, 2 and 3 times capacity), every target gets the same open-loop Poisson
arrivals of streamed chat requests, whose clients give up at the SLO's total
time. The report gives goodput (on time and within the TTFT and total SLO),
rejections, p50/p99 TTFT and total time, and wasted work (completions the
engines finished that no client received before its deadline); its
definitions are in ``bench.head_to_head_report``.

Every server is a child process on a loopback port, stopped in ``finally``,
also on Ctrl-C. HAProxy is installed with apt-get when missing; when that
fails, HAProxy is marked "not measured" and the other targets still run.

    .venv/bin/python -m bench.head_to_head [--engine sim|llama] [--seconds 20] [--warmup 2]
        [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import aiohttp
import uvloop
import yaml
from prometheus_client.parser import text_string_to_metric_families

from bench import head_to_head_haproxy as haproxy
from bench.common import Readings, cpu_line, machine, own_cpu, revision, scrubbed_env
from bench.head_to_head_report import (
    Phase,
    Slo,
    detail_table,
    engine_delta,
    main_table,
    missing_report,
    set_ratios,
    summarize,
    verdict_table,
    verdicts,
)
from bench.head_to_head_traffic import (
    MODEL,
    Shape,
    closed_loop,
    make_session,
    open_loop,
    poisson_arrivals,
)
from bench.processes import (
    CLOCK_TICKS,
    Server,
    free_port,
    listen_overflows,
    start_server,
    stop_server,
    wait_ready,
)
from bench.real_engine import MissingToolchain
from bench.real_engine import ensure as ensure_engine
from proxy.loadtest.client import request_resending_stale
from proxy.settings import ConfigError, parse_config

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "head_to_head.json"
TARGETS = ("direct", "haproxy", "proxy")
LOADS = (1.0, 2.0, 3.0)

# -- the replicas: the same engines behind every target ---------------------------------

REPLICAS = 2
#: A slower "GPU" than the simulator's default, so two replicas at 3x capacity
#: stay within what two shared cores can drive: a decode step of 20 ms plus
#: 2.5 ms per running sequence (40 ms at the knee), prefill 0.05 ms per token.
SIM_ARGS = ("--decode-base-ms", "20", "--decode-per-seq-ms", "2.5",
            "--prefill-ms-per-token", "0.05")  # fmt: skip
CONNECT_MS = 1000
#: The tenant queue holds twice what the replicas can serve within the queue budget.
QUEUE_CAPACITY_FACTOR = 2.0
TENANT = "bench"
API_KEY = "sk-bench-head-to-head"


@dataclass(frozen=True, slots=True)
class Setup:
    """What differs between the engines: slots, request sizes, the SLO and budgets."""

    engine: str
    #: Sequences an engine runs at once: the knee, since past it the engine only
    #: queues. HAProxy's ``maxconn`` and the proxy's ``max_concurrency`` per replica.
    slots: int
    shape: Shape
    #: Time to first token and total time; clients give up at the total.
    slo: Slo
    #: The longest wait in a front's queue: HAProxy's ``timeout queue``, this
    #: proxy's ``budgets.queue_ms``. The TTFT SLO leaves the rest for the first token.
    queue_ms: int

    @property
    def first_byte_ms(self) -> int:
        """This proxy's ``first_byte_ms``: the part of the TTFT SLO the queue leaves."""
        return int(self.slo.ttft_ms) - self.queue_ms

    @property
    def headers(self) -> dict[str, str]:
        """The same to every target: HAProxy and the replicas ignore the key and timeout."""
        return {
            "Authorization": f"Bearer {API_KEY}",
            "Content-Type": "application/json",
            "X-Request-Timeout-Ms": str(int(self.slo.total_ms)),
        }


SETUPS = {
    # About 22 to 37 prompt tokens, 8 to 24 output tokens (0.3 to 1 s at the knee).
    "sim": Setup("sim", slots=8, shape=Shape(prompt_words=(15, 25), max_tokens=(8, 24)),
                 slo=Slo(ttft_ms=1500.0, total_ms=2500.0), queue_ms=1000),
    # llama.cpp's tiny model decodes about 1,000 tokens/s per sequence on one
    # thread: 200 to 600 tokens keep the engines, not the fronts or the load
    # generator, the bottleneck on two cores (about 0.3 to 1 s at the knee).
    "llama": Setup("llama", slots=4,
                   shape=Shape(prompt_words=(15, 25), max_tokens=(200, 600), ignore_eos=True),
                   slo=Slo(ttft_ms=1500.0, total_ms=3000.0), queue_ms=1000),
}  # fmt: skip

# -- timing -----------------------------------------------------------------------------

DEFAULT_SECONDS = 20.0
DEFAULT_WARMUP_S = 2.0
QUICK_SECONDS = 5.0
QUICK_WARMUP_S = 1.0
CAPACITY_WARMUP_S = 1.0
CAPACITY_S = 5.0
QUICK_CAPACITY_S = 2.0
READY_TIMEOUT_S = 20.0
IDLE_TIMEOUT_S = 15.0
#: Issue 6's target for this proxy's goodput at 3x against its own at 1x.
MIN_GOODPUT_RATIO = 0.95


# -- servers ----------------------------------------------------------------------------


@dataclass(slots=True)
class Fleet:
    sims: list[Server] = field(default_factory=list)
    fronts: dict[str, Server] = field(default_factory=dict)

    def all(self) -> list[Server]:
        return [*self.sims, *self.fronts.values()]


@contextmanager
def fleet() -> Iterator[Fleet]:
    """Whatever gets started in it is stopped on exit, in reverse order."""
    started = Fleet()
    try:
        yield started
    finally:
        for server in reversed(started.all()):
            stop_server(server)


def start_replicas(setup: Setup, running: Fleet, workdir: Path) -> None:
    engine = ensure_engine() if setup.engine == "llama" else None
    for index in range(REPLICAS):
        port = free_port()
        if engine is None:
            argv = [sys.executable, "-m", "proxy", "sim", "--port", str(port),
                    "--slots", str(setup.slots), "--seed", str(index), *SIM_ARGS]  # fmt: skip
        else:
            # One thread each: two engines on two cores.
            argv = [str(engine.server), "-m", str(engine.model), "--host", "127.0.0.1",
                    "--port", str(port), "--parallel", str(setup.slots),
                    "-c", str(4096 * setup.slots), "-t", "1", "--metrics", "--no-webui",
                    "-a", MODEL]  # fmt: skip
        name = f"{setup.engine}-{index}"
        running.sims.append(start_server(name, argv, port, "/health", workdir, scrubbed_env()))


def proxy_config(setup: Setup, port: int, sim_urls: Sequence[str], queue_capacity: int) -> str:
    document = {
        "server": {"host": "127.0.0.1", "port": port},
        "replicas": [
            {"name": f"{setup.engine}-{i}", "url": url, "max_concurrency": setup.slots}
            for i, url in enumerate(sim_urls)
        ],
        "budgets": {"queue_ms": setup.queue_ms, "first_byte_ms": setup.first_byte_ms,
                    "total_ms": int(setup.slo.total_ms)},
        "timeouts": {"connect_ms": CONNECT_MS},
        "tenants": {TENANT: {"api_keys": [API_KEY], "queue_capacity": queue_capacity}},
    }  # fmt: skip
    text = yaml.safe_dump(document, sort_keys=False)
    parse_config(text)  # a bad config fails here, not as a proxy that never gets ready
    return text


def start_proxy(setup: Setup, running: Fleet, workdir: Path, queue_capacity: int) -> str:
    port = free_port()
    config = workdir / "proxy.yaml"
    config.write_text(proxy_config(setup, port, [s.url for s in running.sims], queue_capacity))
    argv = [sys.executable, "-m", "proxy", "serve", "--config", str(config), "--port", str(port)]
    running.fronts["proxy"] = start_server("proxy", argv, port, "/readyz", workdir, scrubbed_env())
    return config.read_text()


def start_haproxy(setup: Setup, running: Fleet, workdir: Path, path: str) -> str:
    port = free_port()
    replicas = [(f"sim-{i}", s.url.removeprefix("http://")) for i, s in enumerate(running.sims)]
    text = haproxy.render_config(
        port, replicas, maxconn=setup.slots, queue_ms=setup.queue_ms,
        total_ms=int(setup.slo.total_ms), connect_ms=CONNECT_MS,
    )  # fmt: skip
    config = workdir / "haproxy.cfg"
    config.write_text(text)
    haproxy.check_config(path, config)
    running.fronts["haproxy"] = start_server(
        "haproxy", haproxy.argv(path, config), port, haproxy.READY_PATH, workdir
    )  # fmt: skip
    return text


# -- measuring --------------------------------------------------------------------------


#: llama.cpp's metrics under the simulator's counter names (it counts no requests).
LLAMA_STATS = {
    "llamacpp:tokens_predicted_total": "tokens_generated",
    "llamacpp:n_decode_total": "steps",
    "llamacpp:requests_processing": "running",
    "llamacpp:requests_deferred": "waiting",
}


async def _engine_stats(session: aiohttp.ClientSession, sim: Server) -> dict[str, Any]:
    """One engine's counters: ``/sim/stats``, or llama.cpp's ``/metrics`` renamed."""
    if sim.name.startswith("llama"):
        # The load's session: a stream may have left a dead connection in its pool.
        response = await request_resending_stale(session, "GET", sim.url + "/metrics")
        async with response:
            response.raise_for_status()
            text = await response.text()
        return {
            LLAMA_STATS[sample.name]: sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name in LLAMA_STATS
        }
    async with session.get(sim.url + "/sim/stats") as response:
        response.raise_for_status()
        stats: dict[str, Any] = await response.json()
        return stats


async def sim_stats(
    session: aiohttp.ClientSession, sims: Sequence[Server], readings: Readings, what: str
) -> list[dict[str, Any]] | None:
    """Every engine's counters, or None (recorded in ``readings``) when one could
    not be read: a delta needs all of them."""
    stats = []
    for sim in sims:
        one = await readings.take(f"{what} ({sim.name})", partial(_engine_stats, session, sim))
        if one is None:
            return None
        stats.append(one)
    return stats


def _busy(stats: Sequence[dict[str, Any]]) -> float:
    return sum(float(s.get("running", 0.0)) + float(s.get("waiting", 0.0)) for s in stats)


async def wait_sims_idle(
    session: aiohttp.ClientSession, sims: Sequence[Server], readings: Readings
) -> None:
    """Until no engine runs or queues anything: the last phase's aborts have landed.

    An engine too busy to answer is asked again until ``IDLE_TIMEOUT_S``; if no
    reading came back by then, that is recorded as missing and the run goes on."""
    deadline = time.monotonic() + IDLE_TIMEOUT_S
    while True:
        attempt = Readings(readings.timeout_s)
        stats = await sim_stats(session, sims, attempt, "engines idle")
        if stats is not None and not _busy(stats):
            return
        if time.monotonic() > deadline:
            if stats is not None:
                busy = _busy(stats)
                raise RuntimeError(f"replicas still busy ({busy}) after {IDLE_TIMEOUT_S:.0f} s")
            readings.missing.extend(attempt.missing)
            return
        await asyncio.sleep(0.1)


async def measure_capacity(setup: Setup, running: Fleet, seconds: float) -> tuple[float, int]:
    """Requests per second at the knee: ``slots`` closed-loop clients per replica."""
    async with make_session(CONNECT_MS / 1000.0) as session:
        for sim in running.sims:
            await wait_ready(session, sim, READY_TIMEOUT_S)
        completed, failed = await closed_loop(
            session, [s.url for s in running.sims], setup.headers, setup.slots * REPLICAS,
            CAPACITY_WARMUP_S, seconds, setup.shape, deadline_s=30.0,
        )  # fmt: skip
        await wait_sims_idle(session, running.sims, Readings())
    return completed / seconds, failed


#: How often the engines' running count is sampled in the measured window.
BUSY_SAMPLE_S = 0.05


async def window_stats(
    session: aiohttp.ClientSession,
    sims: Sequence[Server],
    warmup_s: float,
    seconds: float,
    readings: Readings,
) -> tuple[dict[str, int] | None, float]:
    """The engines' counters over the measured window alone (None when either end
    is missing), and the mean number of sequences running in them (sampled): a
    direct measure of busy slots. Samples that fail are left out and counted."""
    await asyncio.sleep(warmup_s)
    start = await sim_stats(session, sims, readings, "engine counters at the window's start")
    end_at = time.monotonic() + seconds
    samples: list[float] = []
    dropped = Readings(readings.timeout_s)
    while time.monotonic() < end_at:
        stats = await sim_stats(session, sims, dropped, "running sample")
        if stats is not None:
            samples.append(sum(float(s.get("running", 0.0)) for s in stats))
        await asyncio.sleep(min(BUSY_SAMPLE_S, max(0.0, end_at - time.monotonic())))
    if dropped.missing:
        readings.miss(
            f"{len(dropped.missing)} of {len(dropped.missing) + len(samples)} running samples",
            dropped.missing[-1].reason,
        )
    busy = sum(samples) / len(samples) if samples else math.nan
    end = await sim_stats(session, sims, readings, "engine counters at the window's end")
    return (None if start is None or end is None else engine_delta(start, end)), busy


async def _front_counts(session: aiohttp.ClientSession, front: Server) -> dict[str, int]:
    async with session.get(front.url + "/metrics") as response:
        response.raise_for_status()
        text = await response.text()
    counts: dict[str, int] = {}
    for family in text_string_to_metric_families(text):
        if family.name != "admission_requests":
            continue
        for sample in family.samples:
            if sample.name == "admission_requests_total":
                outcome = sample.labels.get("outcome", "?")
                counts[outcome] = counts.get(outcome, 0) + int(sample.value)
    return counts


async def front_outcomes(
    session: aiohttp.ClientSession, front: Server | None, readings: Readings, what: str
) -> dict[str, int] | None:
    """This proxy's own count of requests by outcome (``admission_requests_total``);
    ``{}`` for other fronts, None when the page could not be read."""
    if front is None or front.name != "proxy":
        return {}
    return await readings.take(what, partial(_front_counts, session, front))


def _machine_cpu() -> float:
    """Busy CPU seconds of the whole machine (``/proc/stat``): other programs show up here."""
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(f) for f in fields[:8])
    return (user + nice + system + irq + softirq + steal) / CLOCK_TICKS


async def run_phase(
    setup: Setup,
    running: Fleet,
    target: str,
    load: float,
    rate: float,
    seconds: float,
    warmup_s: float,
) -> Phase:
    urls = [s.url for s in running.sims] if target == "direct" else [running.fronts[target].url]
    arrivals = poisson_arrivals(rate, warmup_s, seconds, setup.shape, seed=f"load:{load:g}")
    slo = setup.slo
    front = running.fronts.get(target)
    readings = Readings()
    async with make_session(CONNECT_MS / 1000.0) as session:
        before = await sim_stats(session, running.sims, readings, "engine counters before")
        outcomes_before = await front_outcomes(session, front, readings, "proxy outcomes before")
        cpu = (own_cpu(), sum(s.cpu() for s in running.sims), front.cpu() if front else 0.0,
               _machine_cpu())  # fmt: skip
        overflows = listen_overflows()
        window = asyncio.create_task(
            window_stats(session, running.sims, warmup_s, seconds, readings)
        )
        try:
            outcomes = await open_loop(
                session, urls, setup.headers, arrivals, slo.total_ms / 1000.0
            )
            in_window, busy = await window
        finally:
            window.cancel()
        await wait_sims_idle(session, running.sims, readings)
        after = await sim_stats(session, running.sims, readings, "engine counters after")
        outcomes_after = await front_outcomes(session, front, readings, "proxy outcomes after")
    engine = None if before is None or after is None else engine_delta(before, after)
    phase = summarize(target, load, rate, seconds, outcomes, slo, engine, in_window)
    phase.mean_running = busy
    phase.missing = [str(m) for m in readings.missing]
    for missing in readings.missing:
        print(f"  {target} {load:g}x: {missing}", flush=True)
    phase.cpu_s = {
        "loadgen": own_cpu() - cpu[0],
        "sims": sum(s.cpu() for s in running.sims) - cpu[1],
    }
    if front is not None:
        phase.cpu_s["front"] = front.cpu() - cpu[2]
    # Whatever the machine spent beyond this benchmark's processes (the idle
    # fronts' health probes, other programs): a large figure means a noisy run.
    phase.cpu_s["others"] = _machine_cpu() - cpu[3] - sum(phase.cpu_s.values())
    phase.listen_overflows = listen_overflows() - overflows
    if outcomes_before is None or outcomes_after is None:
        phase.front_outcomes = None
    else:
        phase.front_outcomes = {
            name: count - outcomes_before.get(name, 0) for name, count in outcomes_after.items()
        }
    for server in running.all():
        if server.process.poll() is not None:
            raise RuntimeError(f"{server.name} exited:\n{server.stderr_tail()}")
    return phase


async def bench(args: argparse.Namespace, workdir: Path, record: dict[str, Any]) -> list[Phase]:
    setup: Setup = args.setup
    install = await asyncio.to_thread(haproxy.ensure_haproxy)
    record["haproxy"] = {"path": install.path, "version": install.version, "how": install.how}
    print(f"haproxy: {install.how}" + (f" ({install.version})" if install.version else ""))
    if install.path is None:
        print("haproxy: NOT MEASURED; running the other targets", flush=True)
    phases: list[Phase] = []
    with fleet() as running:
        await asyncio.to_thread(start_replicas, setup, running, workdir)
        capacity, failed = await measure_capacity(setup, running, args.capacity_seconds)
        if capacity <= 0 or failed:
            raise RuntimeError(f"capacity run: {capacity:.1f} req/s with {failed} failures")
        queue_capacity = math.ceil(QUEUE_CAPACITY_FACTOR * capacity * setup.queue_ms / 1000.0)
        record["capacity_rps"] = capacity
        record["proxy_queue_capacity"] = queue_capacity
        print(f"capacity at the knee ({setup.slots} x {REPLICAS} closed-loop clients, direct): "
              f"{capacity:.2f} req/s", flush=True)  # fmt: skip
        record["proxy_config"] = start_proxy(setup, running, workdir, queue_capacity)
        if install.path is not None:
            record["haproxy_config"] = start_haproxy(setup, running, workdir, install.path)
        async with make_session(CONNECT_MS / 1000.0) as session:
            for server in running.fronts.values():
                await wait_ready(session, server, READY_TIMEOUT_S)
        targets = [t for t in TARGETS if t == "direct" or t in running.fronts]
        for load in LOADS:
            for target in targets:
                phase = await run_phase(
                    setup, running, target, load, load * capacity, args.seconds, args.warmup
                )
                phases.append(phase)
                print(f"  {target:8} {load:g}x: offered {phase.offered_rps:6.1f}/s, goodput "
                      f"{phase.goodput_rps:6.1f}/s, rejected {phase.rejected}, gave up "
                      f"{phase.gave_up}, wasted completions {phase.wasted_completions}",
                      flush=True)  # fmt: skip
    set_ratios(phases)
    return phases


# -- report -----------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.head_to_head", description=__doc__.splitlines()[0]
    )
    add = parser.add_argument
    add(
        "--seconds",
        type=float,
        default=None,
        help=f"measured seconds per target and load (default {DEFAULT_SECONDS:g})",
    )
    add(
        "--warmup",
        type=float,
        default=None,
        help=f"unmeasured seconds of the same load first (default {DEFAULT_WARMUP_S:g})",
    )
    add(
        "--quick",
        action="store_true",
        help=f"a smoke run: {QUICK_SECONDS:g} s per phase, {QUICK_WARMUP_S:g} s warm-up",
    )
    add(
        "--engine",
        choices=sorted(SETUPS),
        default="sim",
        help="the replicas: simulated, or real llama-server (built by scripts/real-engine)",
    )
    add("--output", type=Path, default=None, help="JSON results file")
    return parser


def _resolve(args: argparse.Namespace) -> None:
    if args.seconds is None:
        args.seconds = QUICK_SECONDS if args.quick else DEFAULT_SECONDS
    if args.warmup is None:
        args.warmup = QUICK_WARMUP_S if args.quick else DEFAULT_WARMUP_S
    args.capacity_seconds = QUICK_CAPACITY_S if args.quick else CAPACITY_S
    args.setup = SETUPS[args.engine]
    if args.output is None:
        suffix = "" if args.engine == "sim" else f"_{args.engine}"
        args.output = RESULTS.with_name(f"head_to_head{suffix}.json")
    if args.seconds <= 0 or args.warmup < 0:
        raise SystemExit("--seconds must be > 0 and --warmup >= 0")


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    _resolve(args)
    command = "python -m bench.head_to_head " + " ".join(sys.argv[1:] if argv is None else argv)
    setup: Setup = args.setup
    print(f"head to head ({setup.engine} replicas): {len(LOADS)} loads x {len(TARGETS)} targets, "
          f"{args.seconds:g} s each (+{args.warmup:g} s warm-up); SLO TTFT "
          f"{setup.slo.ttft_ms:.0f} ms, total {setup.slo.total_ms:.0f} ms; queue budget "
          f"{setup.queue_ms} ms; {os.cpu_count()} CPUs shared", flush=True)  # fmt: skip
    print(cpu_line(), flush=True)
    record: dict[str, Any] = {}
    started = time.monotonic()
    try:
        with tempfile.TemporaryDirectory(prefix="bench-h2h-") as tmp:
            phases = uvloop.run(bench(args, Path(tmp), record))
    except (KeyboardInterrupt, asyncio.CancelledError):
        print("interrupted", file=sys.stderr)
        return 130
    except (RuntimeError, ConfigError, MissingToolchain) as exc:
        print(f"head to head: {exc}", file=sys.stderr)
        return 1
    items = verdicts(phases, LOADS[-1], MIN_GOODPUT_RATIO)
    print()
    print(main_table(phases))
    print()
    print(detail_table(phases))
    print()
    print(verdict_table(items))
    print()
    print(missing_report(phases))
    result = {
        "benchmark": "head_to_head",
        "command": command,
        "parameters": {
            "seconds": args.seconds, "warmup_s": args.warmup,
            "capacity_seconds": args.capacity_seconds, "loads": LOADS, "replicas": REPLICAS,
            "engine": setup.engine, "slots": setup.slots,
            "sim_args": SIM_ARGS if setup.engine == "sim" else None,
            "prompt_words": setup.shape.prompt_words, "max_tokens": setup.shape.max_tokens,
            "slo": asdict(setup.slo), "queue_ms": setup.queue_ms,
            "first_byte_ms": setup.first_byte_ms,
        },
        **record,
        "revision": revision(),
        "machine": machine("load generator, fronts and replicas share the same CPUs"),
        "wall_s": round(time.monotonic() - started, 1),
        "readings_missing": sum(len(p.missing) for p in phases),
        "phases": [asdict(p) for p in phases],
        "verdicts": [{**asdict(v), "mark": v.mark} for v in items],
    }  # fmt: skip
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nresults: {args.output} ({result['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
