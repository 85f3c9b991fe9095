"""Model isolation benchmark (issue 15): does flooding model A delay model B's requests?

Two real ``llama-server`` replicas (the tiny model, ``--parallel 2``, one
thread each), one serving ``model-a`` and one ``model-b`` (``--alias``),
behind the proxy as two model pools of two seats each, one tenant. Model B
gets the same open-loop Poisson arrivals of short streamed chats in every
phase, timed by this process; model A's flood (``FLOOD_CLIENTS`` closed-loop
clients of streamed chats, far beyond A's two seats) runs in a process of its
own (``bench.model_isolation_flood``). The phases:

- ``alone``: B through the proxy, no flood;
- ``flooded``: B through the proxy, A flooded through the proxy (A's pool
  queue in the proxy stays deep): the issue's figure;
- ``flooded_direct``: B through the proxy, A's flood sent straight to A's
  engine. The machine bears the same load (A's engine busy, the flood's
  client), but the proxy neither admits nor relays A's traffic: the control
  that tells the proxy's part from the machine's;
- ``alone_again``: as ``alone`` (the machine's drift; pooled with ``alone``);
- ``bare_alone`` and ``bare_flooded``: B straight to its engine, without and
  with A's direct flood: what the machine alone does to B, no proxy at all.

Reported per phase: B's TTFT p50/p99 at the client, the proxy's own timings
of B's requests (access log: ``queue_ms``, ``ttft_ms``, ``upstream_ms``),
A's queue depth (the proxy's ``admission_model_queue_depth`` or A's engine's
``llamacpp:requests_deferred``), the CPU seconds of the proxy, each engine,
the flood's client and B's client. Ratios of B's TTFT p99, each with a 95 %
bootstrap interval (``bench.model_isolation_stats``), against the 1.2 target.

``--arrangement`` places the processes on the two CPUs:

- ``shared``: nothing pinned, one priority (the CPUs' scheduler decides);
- ``pin-a``: A's engine alone on CPU 0; B's engine, the proxy and both
  clients on CPU 1;
- ``gpu-host``: each engine pinned to a CPU of its own (A on 0, B on 1) at
  the lowest priority (nice 19), A's flood client unpinned at nice 19 too;
  the proxy and B's (timing) client unpinned at normal priority. On a GPU
  host an engine's compute runs on its own device and never takes the
  proxy's CPU time, and the clients run on other machines; here the
  engines' compute and the flood's client yield to the proxy, and the two
  engines never share a CPU. Each server runs in a session of its own, and
  with the kernel's autogroups on (``/proc/sys/kernel/sched_autogroup_enabled``)
  a nice value counts only inside its session, so those sessions are
  reniced as well (``/proc/<pid>/autogroup``);
- ``own-device``: B's engine alone on CPU 1 (B's model on a device of its
  own); A's engine and A's flood client on CPU 0 at nice 19, the proxy and
  B's client on CPU 0 at normal priority (A's work yields to the proxy).

    .venv/bin/python -m bench.model_isolation [--arrangement gpu-host] [--requests 480]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import uvloop
import yaml
from prometheus_client.parser import text_string_to_metric_families

from bench.common import (
    ROOT,
    access_log_requests,
    cpu_line,
    machine,
    own_cpu,
    revision,
    scrubbed_env,
    write_results,
)
from bench.load import DONE, load_session, percentile, sse_data
from bench.model_isolation_stats import p99_ratio
from bench.prefix_affinity import API_KEY, Fleet, fleet, start_proxy
from bench.processes import (
    CLOCK_TICKS,
    Server,
    free_port,
    spawn,
    start_server,
    stop_server,
    wait_ready,
)
from bench.real_engine import MissingToolchain, ensure
from proxy.loadtest.client import request_resending_stale
from proxy.settings import parse_config
from proxy.sse import has_token

RESULTS = ROOT / "bench" / "results"
MODELS = ("model-a", "model-b")
SLOTS = 2
PATH = "/v1/chat/completions"
#: Model B's arrivals per second (its two seats are busy about a fifth of the time).
B_RATE = 8.0
B_MAX_TOKENS = 16
#: B's requests per phase: a p99 over 160 rests on the two slowest and its
#: interval straddled 1.2; over 480 (about 7.5 minutes in all) it rests on the
#: five slowest, and three of the first four runs had decided intervals.
DEFAULT_REQUESTS = 480
#: Closed-loop clients on model A: its two seats plus a deep queue.
FLOOD_CLIENTS = 16
A_MAX_TOKENS = 64
#: A's queue counts as deep from here (the flood's clients less A's seats).
DEEP = FLOOD_CLIENTS - 2 * SLOTS
REQUEST_DEADLINE_S = 60.0
TARGET_P99_RATIO = 1.2
HEADERS = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
NICE = ("nice", "-n", "19")


@dataclass(frozen=True, slots=True)
class Arrangement:
    """Where the processes run: a prefix for each engine's command, this process's CPUs."""

    note: str
    engine_a: tuple[str, ...]
    engine_b: tuple[str, ...]
    #: This process's CPUs, inherited by the proxy and the flood's client; None: all.
    others: frozenset[int] | None
    #: The nice value of the engines' and the flood client's sessions (autogroups).
    background_nice: int = 0


ARRANGEMENTS = {
    "shared": Arrangement(
        "nothing pinned, one priority: engines, proxy and clients share the 2 CPUs",
        (), (), None,
    ),
    "pin-a": Arrangement(
        "model-a's engine alone on CPU 0; model-b's engine, the proxy and both clients on CPU 1",
        ("taskset", "-c", "0"), ("taskset", "-c", "1"), frozenset({1}),
    ),
    "gpu-host": Arrangement(
        "model-a's engine on CPU 0 and model-b's on CPU 1, both at nice 19, A's flood "
        "client unpinned at nice 19; the proxy and B's client unpinned at nice 0 (engines "
        "and the flood's client yield to the proxy, as on a GPU host they do not take its CPU)",
        (*NICE, "taskset", "-c", "0"), (*NICE, "taskset", "-c", "1"), None, 19,
    ),
    "own-device": Arrangement(
        "model-b's engine alone on CPU 1 (its own device); model-a's engine and A's flood "
        "client on CPU 0 at nice 19, with the proxy and B's client at nice 0 (A's engine "
        "and the flood yield to the proxy, as on a GPU host they do not take its CPU)",
        (*NICE, "taskset", "-c", "0"), ("taskset", "-c", "1"), frozenset({0}), 19,
    ),
}  # fmt: skip


def machine_cpu() -> float:
    """CPU seconds the whole machine has spent busy since boot (``/proc/stat``, all CPUs)."""
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(f) for f in fields[:8])
    return (user + nice + system + irq + softirq + steal) / CLOCK_TICKS


def renice_session(pid: int, nice: int) -> None:
    """Lower the priority of ``pid``'s autogroup (its session), where the kernel has them."""
    path = Path(f"/proc/{pid}/autogroup")
    if path.exists():
        path.write_text(str(nice))


@dataclass(frozen=True, slots=True)
class Phase:
    name: str
    #: Where B's requests go, and where A's flood goes (None: no flood).
    b_via_proxy: bool
    flood_via_proxy: bool | None


PHASES = (
    Phase("alone", True, None),
    Phase("flooded", True, True),
    Phase("flooded_direct", True, False),
    Phase("alone_again", True, None),
    Phase("bare_alone", False, None),
    Phase("bare_flooded", False, False),
)


def chat(model: str, max_tokens: int, stream: bool, words: int) -> bytes:
    document = {
        "model": model,
        "messages": [{"role": "user", "content": "tell me a story " * words}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": stream,
    }
    return json.dumps(document).encode()


def proxy_config(urls: list[str]) -> str:
    document: dict[str, Any] = {
        "server": {"host": "127.0.0.1"},
        "replicas": [
            {"name": f"llama-{i}", "url": url, "max_concurrency": SLOTS, "models": [model]}
            for i, (url, model) in enumerate(zip(urls, MODELS, strict=True))
        ],
        "budgets": {"queue_ms": 30000, "first_byte_ms": 30000, "total_ms": 60000},
        "tenants": {"bench": {"api_keys": [API_KEY], "queue_capacity": 256}},
    }
    text = yaml.safe_dump(document, sort_keys=False)
    parse_config(text)
    return text


async def ttft_of_b(session: aiohttp.ClientSession, url: str, request_id: str) -> float | None:
    """One streamed B request; its time to first token, None when it failed."""
    sent = time.perf_counter()
    payload = chat(MODELS[1], B_MAX_TOKENS, True, 8)
    headers = {**HEADERS, "X-Request-Id": request_id}
    ttft = None
    try:
        async with asyncio.timeout(REQUEST_DEADLINE_S):
            response = await request_resending_stale(session, "POST", url + PATH, payload, headers)
            async with response:
                if response.status != 200:
                    await response.read()
                    return None
                async for data in sse_data(response):
                    if data == DONE:
                        return ttft
                    if ttft is None:
                        with contextlib.suppress(ValueError):
                            if has_token(json.loads(data)):
                                ttft = time.perf_counter() - sent
    except (TimeoutError, aiohttp.ClientError):
        return None
    return None


async def b_phase(
    session: aiohttp.ClientSession, url: str, offsets: list[float], tag: str
) -> list[float | None]:
    t0 = time.perf_counter()
    tasks: list[asyncio.Task[float | None]] = []
    try:
        for index, offset in enumerate(offsets):
            delay = t0 + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(ttft_of_b(session, url, f"{tag}-{index}")))
        await asyncio.wait(tasks, timeout=REQUEST_DEADLINE_S + 5.0)
    finally:
        for task in tasks:
            task.cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
    return [r if isinstance(r, float) else None for r in results]


async def gauge(session: aiohttp.ClientSession, url: str, name: str, model: str) -> float | None:
    """One gauge from ``url``'s /metrics (``model``: its label, when it has one)."""
    try:
        async with asyncio.timeout(2.0):
            async with session.get(url + "/metrics") as response:
                text = await response.text()
    except (TimeoutError, aiohttp.ClientError):
        return None
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels.get("model", model) == model:
                return sample.value
    return None


class Flood:
    """A's flood in its own process, aimed at the proxy or at A's engine."""

    def __init__(self, workdir: Path, url: str, depth_url: str, depth_name: str, nice: int) -> None:
        self.url, self.depth_url, self.depth_name = url, depth_url, depth_name
        argv = [sys.executable, "-m", "bench.model_isolation_flood", "--url", url,
                "--clients", str(FLOOD_CLIENTS), "--max-tokens", str(A_MAX_TOKENS)]  # fmt: skip
        if nice:
            argv = ["nice", "-n", str(nice), *argv]
        self.server: Server = spawn("flood", argv, workdir, env=scrubbed_env(), keep_stdout=True)
        if nice:
            renice_session(self.server.process.pid, nice)
        self.depths: list[float] = []

    async def depth(self, session: aiohttp.ClientSession) -> float | None:
        return await gauge(session, self.depth_url, self.depth_name, MODELS[0])

    async def deep(self, session: aiohttp.ClientSession, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.server.check_alive()
            depth = await self.depth(session)
            if depth is not None and depth >= DEEP:
                return
            await asyncio.sleep(0.1)
        raise RuntimeError(f"model-a's queue did not reach {DEEP} within {timeout_s:.0f} s")

    async def sample(self, session: aiohttp.ClientSession, stop: asyncio.Event) -> None:
        while not stop.is_set():
            depth = await self.depth(session)
            if depth is not None:
                self.depths.append(depth)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.5)

    def stop(self) -> dict[str, Any]:
        cpu = self.server.cpu()
        stop_server(self.server)
        assert self.server.stdout_path is not None
        lines = self.server.stdout_path.read_text().splitlines()
        counts: dict[str, Any] = json.loads(lines[-1]) if lines else {}
        return {
            **counts,
            "client_cpu_s": round(cpu, 2),
            "depth_min": min(self.depths) if self.depths else None,
            "depth_mean": round(sum(self.depths) / len(self.depths), 1) if self.depths else None,
        }


async def run_phase(
    phase: Phase, session: aiohttp.ClientSession, running: Fleet, proxy: Server,
    offsets: list[float], workdir: Path, nice: int,
) -> tuple[list[float | None], dict[str, Any]]:  # fmt: skip
    """B's arrivals, with A's flood if the phase has one; B's TTFTs and the phase's costs."""
    engine_a, engine_b = running.engines
    flood: Flood | None = None
    stop = asyncio.Event()
    sampler: asyncio.Task[None] | None = None
    if phase.flood_via_proxy is not None:
        if phase.flood_via_proxy:
            flood = Flood(workdir, proxy.url, proxy.url, "admission_model_queue_depth", nice)
        else:
            flood = Flood(workdir, engine_a.url, engine_a.url, "llamacpp:requests_deferred", nice)
    try:
        if flood is not None:
            await flood.deep(session)
            sampler = asyncio.create_task(flood.sample(session, stop))
        servers = {"proxy": proxy, "engine_a": engine_a, "engine_b": engine_b}
        before = {name: server.cpu() for name, server in servers.items()}
        flood_before = flood.server.cpu() if flood is not None else 0.0
        own, busy, wall = own_cpu(), machine_cpu(), time.perf_counter()
        url = proxy.url if phase.b_via_proxy else engine_b.url
        ttfts = await b_phase(session, url, offsets, phase.name)
        wall = time.perf_counter() - wall
        cost: dict[str, Any] = {"wall_s": round(wall, 2)}
        for name, server in servers.items():
            cost[f"{name}_cpu_s"] = round(server.cpu() - before[name], 2)
        cost["b_client_cpu_s"] = round(own_cpu() - own, 2)
        ours = sum(cost[f"{name}_cpu_s"] for name in servers) + cost["b_client_cpu_s"]
        if flood is not None:
            ours += flood.server.cpu() - flood_before
        #: Busy CPU time of everything else on the machine (other processes, the kernel's
        #: own threads): near 0 when the benchmark ran alone.
        cost["other_cpu_s"] = round(machine_cpu() - busy - ours, 2)
    finally:
        stop.set()
        if sampler is not None:
            await sampler
        flood_result = flood.stop() if flood is not None else None
    if flood_result is not None:
        cost["flood"] = flood_result
    return ttfts, cost


def _ms(values: list[float], q: float) -> float | None:
    return round(percentile(sorted(values), q), 2) if values else None


def proxy_timings(lines: list[dict[str, Any]], ttft_s: dict[str, float]) -> dict[str, Any]:
    """The proxy's own view of one phase's B requests (access log), and what it does not see.

    ``ttft_ms`` runs from the first bytes of the request's head on the
    proxy's socket to the first token written; ``upstream_ms`` is the
    engine's part of it (dispatch to its first byte), so ``ttft_ms`` less
    ``upstream_ms`` (``not_upstream_ms``) is the proxy's: parsing, admission,
    the queue, dispatch, and the first token's relay; less ``queue_ms`` too
    (``own_ms``), what is left is the proxy's handling with no wait for a
    seat (a B request waits only for B's seats). ``outside_ms`` is the
    client's TTFT less the proxy's: connecting, the network, and the client's
    own loop reading the token.
    """
    fields: dict[str, list[float]] = {
        "queue_ms": [], "ttft_ms": [], "upstream_ms": [], "not_upstream_ms": [], "own_ms": [],
        "outside_ms": [],
    }  # fmt: skip
    for line in lines:
        queue, ttft, upstream = line.get("queue_ms"), line.get("ttft_ms"), line.get("upstream_ms")
        if queue is None or ttft is None or upstream is None:
            continue
        fields["queue_ms"].append(float(queue))
        fields["ttft_ms"].append(float(ttft))
        fields["upstream_ms"].append(float(upstream))
        fields["not_upstream_ms"].append(float(ttft) - float(upstream))
        fields["own_ms"].append(float(ttft) - float(upstream) - float(queue))
        client = ttft_s.get(str(line.get("request_id")))
        if client is not None:
            fields["outside_ms"].append(client * 1000.0 - float(ttft))
    summary: dict[str, Any] = {"lines": len(fields["ttft_ms"])}
    for name, values in fields.items():
        summary[name] = {"p50": _ms(values, 0.50), "p99": _ms(values, 0.99),
                         "max": round(max(values), 2) if values else None}  # fmt: skip
    summary["queued"] = sum(1 for q in fields["queue_ms"] if q > 1.0)
    return summary


def ratio_entry(name: str, numerator: list[float], denominator: list[float]) -> dict[str, Any]:
    ratio = p99_ratio(numerator, denominator)
    return {
        "name": name,
        "value": round(ratio.value, 3),
        "interval_95": [round(ratio.low, 3), round(ratio.high, 3)],
        "target": f"<= {TARGET_P99_RATIO}",
        "point_passed": ratio.value <= TARGET_P99_RATIO,
        "verdict": ratio.verdict(TARGET_P99_RATIO),
    }


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    try:
        engine = ensure()
    except MissingToolchain as exc:
        raise SystemExit(f"model_isolation: {exc}") from exc
    print(cpu_line(), flush=True)
    arrangement = ARRANGEMENTS[args.arrangement]
    if arrangement.others is not None:
        os.sched_setaffinity(0, arrangement.others)  # inherited by the proxy and the flood
    rng = random.Random(15)
    offsets: list[float] = []
    at = 0.0
    while len(offsets) < args.requests:
        at += rng.expovariate(B_RATE)
        offsets.append(at)
    ttfts: dict[str, list[float | None]] = {}
    costs: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-model-isolation-") as tmp:
        workdir = Path(tmp)
        running: Fleet
        with fleet() as running:
            prefixes = (arrangement.engine_a, arrangement.engine_b)
            for index, alias in enumerate(MODELS):
                port = free_port()
                argv = [*prefixes[index], str(engine.server), "-m", str(engine.model),
                        "--host", "127.0.0.1", "--port", str(port), "--parallel", str(SLOTS),
                        "-c", str(4096 * SLOTS), "-t", "1", "--metrics", "--no-webui",
                        "-a", alias]  # fmt: skip
                server = start_server(
                    f"llama-{index}", argv, port, "/health", workdir, scrubbed_env()
                )
                running.engines.append(server)
                if arrangement.background_nice:
                    renice_session(server.process.pid, arrangement.background_nice)
            async with load_session(256, connect_s=5.0) as session:
                for server in running.engines:
                    await wait_ready(session, server, 60.0)
                config = proxy_config([e.url for e in running.engines])
                proxy = await start_proxy(running, workdir, "proxy", config)
                await wait_ready(session, proxy, 60.0)
                await b_phase(session, proxy.url, offsets[:8], "warmup")
                await b_phase(session, running.engines[1].url, offsets[:8], "warmup")
                for phase in PHASES:
                    if phase.name.startswith("bare") and args.no_bare:
                        continue
                    ttfts[phase.name], costs[phase.name] = await run_phase(
                        phase,
                        session,
                        running,
                        proxy,
                        offsets,
                        workdir,
                        arrangement.background_nice,
                    )
                    print(f"{phase.name}: done", flush=True)
            log = proxy.stdout_path
        lines = list(access_log_requests(log.read_text(errors="replace"))) if log else []
    phases: dict[str, Any] = {}
    for name, values in ttfts.items():
        ok = [t for t in values if t is not None]
        by_id = {f"{name}-{i}": t for i, t in enumerate(values) if t is not None}
        mine = [line for line in lines if str(line.get("request_id", "")).split("-")[0] == name]
        phases[name] = {
            "requests": len(values),
            "ok": len(ok),
            "ttft_p50_ms": _ms([t * 1000.0 for t in ok], 0.50),
            "ttft_p99_ms": _ms([t * 1000.0 for t in ok], 0.99),
            "ttft_max_ms": round(max(ok) * 1000.0, 2) if ok else None,
            "proxy": proxy_timings(mine, by_id) if mine else None,
            "ttft_ms": [None if t is None else round(t * 1000.0, 2) for t in values],
            **costs[name],
        }

    def ok_ms(*names: str) -> list[float]:
        return [t * 1000.0 for name in names for t in ttfts.get(name, []) if t is not None]

    alone = ok_ms("alone", "alone_again")
    ratios = [
        ratio_entry("flooded through the proxy / alone", ok_ms("flooded"), alone),
        ratio_entry("flooded direct / alone", ok_ms("flooded_direct"), alone),
        ratio_entry(
            "flooded through the proxy / flooded direct", ok_ms("flooded"), ok_ms("flooded_direct")
        ),
    ]
    if not args.no_bare:
        ratios.append(
            ratio_entry(
                "bare: flooded / alone (no proxy)", ok_ms("bare_flooded"), ok_ms("bare_alone")
            )
        )
    return {
        "benchmark": "model_isolation",
        "revision": revision(),
        "arrangement": args.arrangement,
        "machine": machine(arrangement.note),
        "setup": {
            "b_rate": B_RATE,
            "b_requests": len(offsets),
            "b_max_tokens": B_MAX_TOKENS,
            "flood_clients": FLOOD_CLIENTS,
            "a_max_tokens": A_MAX_TOKENS,
            "a_streamed": True,
            "slots": SLOTS,
        },
        "phases": phases,
        "alone_pooled_ttft_p99_ms": _ms(alone, 0.99),
        "ratios": ratios,
    }


def report(result: dict[str, Any]) -> None:
    print(f"arrangement: {result['arrangement']} ({result['machine']['note']})")
    print("| phase | B ok | TTFT p50 ms | TTFT p99 ms | proxy ttft p99 | upstream p99 | "
          "not-upstream p99 | own p99 | outside p99 | B queued | A depth mean | A answers | "
          "proxy CPU s | engine A / B CPU s | flood / B client CPU s | other CPU s | "
          "wall s |")  # fmt: skip
    print("|---|" + "---:|" * 16)
    for name, p in result["phases"].items():
        proxy = p["proxy"] or {}
        flood = p.get("flood") or {}

        def p99(field: str, proxy: dict[str, Any] = proxy) -> str:
            return str(proxy[field]["p99"]) if field in proxy else "-"

        print(
            f"| {name} | {p['ok']}/{p['requests']} | {p['ttft_p50_ms']} | {p['ttft_p99_ms']} | "
            f"{p99('ttft_ms')} | {p99('upstream_ms')} | {p99('not_upstream_ms')} | "
            f"{p99('own_ms')} | {p99('outside_ms')} | "
            f"{proxy.get('queued', '-')} | {flood.get('depth_mean', '-')} | "
            f"{flood.get('answers', '-')} | {p['proxy_cpu_s']} | "
            f"{p['engine_a_cpu_s']} / {p['engine_b_cpu_s']} | "
            f"{flood.get('client_cpu_s', '-')} / {p['b_client_cpu_s']} | {p['other_cpu_s']} | "
            f"{p['wall_s']} |"
        )
    print(f"alone pooled p99: {result['alone_pooled_ttft_p99_ms']} ms")
    for ratio in result["ratios"]:
        low, high = ratio["interval_95"]
        print(f"{ratio['name']}: {ratio['value']:.2f} [{low:.2f}, {high:.2f}] "
              f"(wanted {ratio['target']}): {ratio['verdict']}")  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--requests", type=int, default=DEFAULT_REQUESTS, help="B's requests per phase"
    )
    parser.add_argument("--arrangement", choices=sorted(ARRANGEMENTS), default="gpu-host")
    parser.add_argument("--no-bare", action="store_true", help="skip the phases without proxy")
    parser.add_argument("--output", type=Path, default=None, help="JSON results file")
    args = parser.parse_args()
    if args.arrangement != "shared" and (
        not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2
    ):
        parser.error(f"--arrangement {args.arrangement} needs Linux and at least 2 CPUs")
    result = uvloop.run(main_async(args))
    report(result)
    output = args.output or RESULTS / f"model_isolation-{args.arrangement}.json"
    write_results(output, result)
    print(f"written to {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
