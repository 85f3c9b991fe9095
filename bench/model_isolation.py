"""Model isolation benchmark (issue 15): does flooding model A delay model B's requests?

Two real ``llama-server`` replicas (the tiny model, ``--parallel 2``, one
thread each), one serving ``model-a`` and one ``model-b`` (``--alias``),
behind the proxy as two model pools of two seats each, one tenant. Model B
gets the same open-loop Poisson arrivals of short streamed chats three times:
alone, with model A flooded (``FLOOD_CLIENTS`` closed-loop clients on A, far
beyond its two seats, so A's pool queue in the proxy stays deep), and alone
again (the machine's drift between phases). Reported: B's TTFT p50/p99 per
phase, B's queue wait in the proxy (the access log's ``queue_ms``), A's queue
depth while flooded (``admission_model_queue_depth{model="model-a"}``), and the
ratio of B's TTFT p99 flooded to alone (both alone phases pooled). Target:
at most 1.2.

The proxy's part is structural (B's tickets never wait in A's queue); what a
flood can still do to B on this machine is take CPU: engines, proxy and load
generator share two cores, so A's busy engine and its traffic compete with
B's. On a GPU host each engine has its own device. ``--pin`` models that on
a CPU machine: A's engine runs on CPU 0 alone, and B's engine, the proxy and
the load generator share CPU 1 in every phase, so what the flood still adds
to B's TTFT is the proxy's own work for A's traffic (which shares B's CPU)
and what the two CPUs share (caches, memory bandwidth).

    .venv/bin/python -m bench.model_isolation [--seconds 15] [--pin] [--output PATH]
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
    revision,
    scrubbed_env,
    write_results,
)
from bench.load import DONE, load_session, percentile, sse_data
from bench.prefix_affinity import API_KEY, Fleet, fleet, start_proxy
from bench.processes import free_port, start_server, wait_ready
from bench.real_engine import MissingToolchain, ensure
from proxy.loadtest.client import request_resending_stale
from proxy.settings import parse_config
from proxy.sse import has_token

RESULTS = ROOT / "bench" / "results" / "model_isolation.json"
MODELS = ("model-a", "model-b")
SLOTS = 2
PATH = "/v1/chat/completions"
#: Model B's arrivals per second (well under its two seats' capacity).
B_RATE = 4.0
B_MAX_TOKENS = 32
#: Closed-loop clients on model A: its two seats plus a deep queue.
FLOOD_CLIENTS = 16
A_MAX_TOKENS = 64
REQUEST_DEADLINE_S = 60.0
TARGET_P99_RATIO = 1.2
HEADERS = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}


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


async def flood_a(session: aiohttp.ClientSession, url: str, stop: asyncio.Event) -> int:
    """Closed-loop clients on model A until ``stop``; the number of answers they got."""
    payload = chat(MODELS[0], A_MAX_TOKENS, False, 8)
    done = 0

    async def client(index: int) -> None:
        nonlocal done
        n = 0
        while not stop.is_set():
            n += 1
            headers = {**HEADERS, "X-Request-Id": f"flood-{index}-{n}"}
            with contextlib.suppress(TimeoutError, aiohttp.ClientError):
                async with asyncio.timeout(REQUEST_DEADLINE_S):
                    response = await request_resending_stale(
                        session, "POST", url + PATH, payload, headers
                    )
                    async with response:
                        await response.read()
                        done += response.status == 200

    await asyncio.gather(*(client(i) for i in range(FLOOD_CLIENTS)))
    return done


async def a_queue_depth(session: aiohttp.ClientSession, url: str) -> float | None:
    try:
        async with asyncio.timeout(2.0):
            async with session.get(url + "/metrics") as response:
                text = await response.text()
    except (TimeoutError, aiohttp.ClientError):
        return None
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if (
                sample.name == "admission_model_queue_depth"
                and sample.labels.get("model") == MODELS[0]
            ):
                return sample.value
    return None


async def sample_depth(
    session: aiohttp.ClientSession, url: str, stop: asyncio.Event, out: list[float]
) -> None:
    while not stop.is_set():
        depth = await a_queue_depth(session, url)
        if depth is not None:
            out.append(depth)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.5)


def _ms(values: list[float], q: float) -> float | None:
    return percentile(sorted(values), q) * 1000.0 if values else None


def phase_summary(ttfts: list[float | None], queue_ms: list[float]) -> dict[str, Any]:
    ok = [t for t in ttfts if t is not None]
    return {
        "requests": len(ttfts),
        "ok": len(ok),
        "ttft_p50_ms": _ms(ok, 0.50),
        "ttft_p99_ms": _ms(ok, 0.99),
        "queue_ms_max": max(queue_ms) if queue_ms else None,
        #: Waited in the proxy's queue for more than a millisecond (a grant at once reads ~0.05).
        "queued": sum(1 for q in queue_ms if q > 1.0),
    }


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    try:
        engine = ensure()
    except MissingToolchain as exc:
        raise SystemExit(f"model_isolation: {exc}") from exc
    print(cpu_line(), flush=True)
    pinned = bool(args.pin)
    if pinned:
        # Inherited by B's engine and the proxy, started below; A's engine is
        # moved to CPU 0 by taskset.
        os.sched_setaffinity(0, {1})
    rng = random.Random(15)
    offsets: list[float] = []
    at = 0.0
    while at < args.seconds:
        at += rng.expovariate(B_RATE)
        offsets.append(at)
    phases: dict[str, list[float | None]] = {}
    depths: list[float] = []
    flooded_answers = 0
    with tempfile.TemporaryDirectory(prefix="bench-model-isolation-") as tmp:
        workdir = Path(tmp)
        running: Fleet
        with fleet() as running:
            for index, alias in enumerate(MODELS):
                port = free_port()
                argv = [str(engine.server), "-m", str(engine.model), "--host", "127.0.0.1",
                        "--port", str(port), "--parallel", str(SLOTS), "-c", str(4096 * SLOTS),
                        "-t", "1", "--metrics", "--no-webui", "-a", alias]  # fmt: skip
                if pinned and index == 0:  # model-a: the flooded engine, alone on CPU 0
                    argv = ["taskset", "-c", "0", *argv]
                running.engines.append(
                    start_server(f"llama-{index}", argv, port, "/health", workdir, scrubbed_env())
                )
            async with load_session(256, connect_s=5.0) as session:
                for server in running.engines:
                    await wait_ready(session, server, 60.0)
                config = proxy_config([e.url for e in running.engines])
                proxy = await start_proxy(running, workdir, "proxy", config)
                await wait_ready(session, proxy, 60.0)
                await b_phase(session, proxy.url, offsets[:8], "warmup")
                phases["alone"] = await b_phase(session, proxy.url, offsets, "alone")
                stop = asyncio.Event()
                flood = asyncio.create_task(flood_a(session, proxy.url, stop))
                sampler = asyncio.create_task(sample_depth(session, proxy.url, stop, depths))
                try:
                    deadline = time.monotonic() + 30.0
                    while time.monotonic() < deadline:  # until A's queue is deep
                        depth = await a_queue_depth(session, proxy.url)
                        if depth is not None and depth >= FLOOD_CLIENTS - 2 * SLOTS:
                            break
                        await asyncio.sleep(0.1)
                    phases["flooded"] = await b_phase(session, proxy.url, offsets, "flooded")
                finally:
                    stop.set()
                    flooded_answers = await flood
                    await sampler
                phases["alone_again"] = await b_phase(session, proxy.url, offsets, "again")
            log = proxy.stdout_path
        lines = list(access_log_requests(log.read_text(errors="replace"))) if log else []
    queue: dict[str, list[float]] = {"alone": [], "flooded": [], "alone_again": []}
    tags = {"alone": "alone", "flooded": "flooded", "again": "alone_again"}
    for line in lines:
        tag = str(line.get("request_id", "")).split("-")[0]
        if tag in tags and line.get("queue_ms") is not None:
            queue[tags[tag]].append(float(line["queue_ms"]))
    summary = {name: phase_summary(ttfts, queue[name]) for name, ttfts in phases.items()}
    alone = [t for name in ("alone", "alone_again") for t in phases[name] if t is not None]
    alone_p99 = _ms(alone, 0.99)
    flooded_p99 = summary["flooded"]["ttft_p99_ms"]
    ratio = flooded_p99 / alone_p99 if alone_p99 and flooded_p99 is not None else None
    return {
        "benchmark": "model_isolation",
        "revision": revision(),
        "machine": machine(
            "model-a's engine on CPU 0; B's engine, proxy and load generator on CPU 1"
            if pinned
            else "engines, proxy and load generator share the machine"
        ),
        "pinned": pinned,
        "setup": {
            "b_rate": B_RATE,
            "b_requests": len(offsets),
            "flood_clients": FLOOD_CLIENTS,
            "slots": SLOTS,
            "b_max_tokens": B_MAX_TOKENS,
            "a_max_tokens": A_MAX_TOKENS,
        },
        "phases": summary,
        "alone_pooled_ttft_p99_ms": alone_p99,
        "a_queue_depth_while_flooded": {
            "samples": len(depths),
            "min": min(depths) if depths else None,
            "mean": sum(depths) / len(depths) if depths else None,
        },
        "a_answers_while_flooded": flooded_answers,
        "verdict": {
            "name": "B TTFT p99 flooded / alone",
            "value": ratio,
            "target": f"<= {TARGET_P99_RATIO}",
            "passed": None if ratio is None else ratio <= TARGET_P99_RATIO,
        },
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=15.0, help="length of each B phase")
    parser.add_argument("--output", type=Path, default=RESULTS, help="JSON results file")
    parser.add_argument(
        "--pin",
        action="store_true",
        help="model-a's engine alone on CPU 0, everything else on CPU 1 (needs 2 CPUs, Linux)",
    )
    args = parser.parse_args()
    if args.pin and (not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2):
        parser.error("--pin needs Linux and at least 2 CPUs")
    result = uvloop.run(main_async(args))
    print("| phase | B ok | B TTFT p50 ms | B TTFT p99 ms | B queued > 1 ms | B queue_ms max |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, p in result["phases"].items():
        print(
            f"| {name} | {p['ok']}/{p['requests']} | {p['ttft_p50_ms']:.0f} | "
            f"{p['ttft_p99_ms']:.0f} | {p['queued']} | {p['queue_ms_max']} |"
        )
    depth = result["a_queue_depth_while_flooded"]
    print(f"model-a queue depth while flooded: min {depth['min']}, mean {depth['mean']}")
    verdict = result["verdict"]
    passed = verdict["passed"]
    shown = "n/a" if verdict["value"] is None else f"{verdict['value']:.3f}"
    status = "n/a" if passed is None else ("PASS" if passed else "MISS")
    print(f"{verdict['name']}: {shown} (wanted {verdict['target']}) {status}")
    write_results(args.output, result)
    print(f"written to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
