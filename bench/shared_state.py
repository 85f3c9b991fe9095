"""Shared state benchmark (issue 17): what ``state.backend: redis`` costs, and what
``serve --workers 2`` buys, against the local backend and a bare pass-through.

Five targets in one run, each behind the same closed loop of small
non-streaming chat completions to ``bench.fast_upstream`` (the floor):

- ``passthrough``: ``bench.passthrough``, the in-run baseline;
- ``local``: ``admission-proxy serve``, ``state.backend: local``;
- ``redis``: the same with ``state.backend: redis`` on a ``redis-server`` the
  benchmark starts (no persistence, loopback);
- ``redis-w2``: ``serve --workers 2`` on that Redis.

The tenant has ``max_concurrency`` and ``rate_per_s`` (both far above the
load) so every request pays every shared call: the rate bucket, the tenant
place, the replica seat and their releases. Figures per target: req/s, p50
and p99 latency, CPU per request of the front (every worker process, never
the parent, the upstream or Redis), and for Redis targets Redis commands per
request (``INFO``: script calls, the round trips, and every command run,
those inside scripts included). Rounds rotate the order; each figure is the median over rounds.

    .venv/bin/python -m bench.shared_state [--requests 3000] [--concurrency 32] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import aiohttp
import uvloop
import yaml

from bench.common import cpu_line, machine, revision, write_results
from bench.load import Requester, closed_loop, load_session
from bench.processes import (
    Server,
    cpu_seconds,
    free_port,
    spawn,
    start_redis,
    start_upstream_and_passthrough,
    stop_server,
    wait_ready,
)

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "shared_state.json"
TARGETS = ("passthrough", "local", "redis", "redis-w2")
API_KEY = "sk-bench-shared"
PATH = "/v1/chat/completions"
BODY = json.dumps(
    {"model": "bench-model", "messages": [{"role": "user", "content": "ok"}], "max_tokens": 8}
).encode()
HEADERS = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
RUN_CAP_S = 30.0
SEATS = 256


def _config(workdir: Path, port: int, upstream: str, redis_url: str | None) -> Path:
    tenant: dict[str, Any] = {
        "api_keys": [API_KEY], "queue_capacity": 256, "max_concurrency": 512,
        "rate_per_s": 1_000_000, "burst": 1_000_000,
    }  # fmt: skip
    document: dict[str, Any] = {
        "server": {"host": "127.0.0.1", "port": port},
        "replicas": [{"name": "fast", "url": upstream, "max_concurrency": SEATS}],
        "tenants": {"bench": tenant},
    }
    if redis_url is not None:
        document["state"] = {"backend": "redis", "redis_url": redis_url, "timeout_ms": 500}
    path = workdir / f"proxy-{port}.yaml"
    path.write_text(yaml.safe_dump(document))
    return path


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


def front_cpu(server: Server) -> float:
    """CPU seconds of the serving processes: the process itself, or its workers."""
    workers = _children(server.process.pid)
    return sum(cpu_seconds(p) for p in workers) if workers else server.cpu()


def redis_commands(port: int) -> tuple[int, int]:
    """Commands Redis ran (those inside scripts included), and script calls (round trips)."""
    out = subprocess.run(
        ["redis-cli", "-p", str(port), "INFO", "all"], capture_output=True, check=True, text=True
    ).stdout
    total = calls = 0
    for line in out.splitlines():
        if line.startswith("total_commands_processed:"):
            total = int(line.split(":")[1])
        elif line.startswith(("cmdstat_evalsha:", "cmdstat_eval:")):
            calls += int(line.split("calls=")[1].split(",")[0])
    return total, calls


@contextmanager
def servers(workdir: Path) -> Iterator[tuple[dict[str, Server], Server]]:
    started: list[Server] = []
    python = sys.executable
    command = str(Path(python).parent / "admission-proxy")
    try:
        redis, port = start_redis(workdir)
        started.append(redis)
        redis_url = f"redis://127.0.0.1:{port}/0"
        upstream = start_upstream_and_passthrough(workdir, started)
        for name, url, workers in (
            ("local", None, 1), ("redis", redis_url, 1), ("redis-w2", redis_url, 2),
        ):  # fmt: skip
            port = free_port()
            config = _config(workdir, port, upstream.url, url)
            argv = [command, "serve", "--config", str(config), "--workers", str(workers)]
            started.append(spawn(
                name, argv, workdir, url=f"http://127.0.0.1:{port}", ready_path="/readyz",
            ))  # fmt: skip
        yield {s.name: s for s in started if s.name in TARGETS}, redis
    finally:
        for server in reversed(started):
            stop_server(server)


async def measure(
    target: Server, redis_port: int, requests: int, concurrency: int, warmup: int
) -> dict[str, float]:
    async with load_session(concurrency, total_s=10.0) as session:
        warm = Requester(session, target.url + PATH, BODY, HEADERS)
        await closed_loop(warm, warmup, concurrency, RUN_CAP_S)
        requester = Requester(session, target.url + PATH, BODY, HEADERS)
        cpu0, (ops0, calls0) = front_cpu(target), redis_commands(redis_port)
        sample = await closed_loop(requester, requests, concurrency, RUN_CAP_S)
        cpu1, (ops1, calls1) = front_cpu(target), redis_commands(redis_port)
    ok = max(1, sample.ok)
    return {
        "rps": sample.rps(),
        "p50_ms": sample.percentile_ms(0.5),
        "p99_ms": sample.percentile_ms(0.99),
        "cpu_ms_per_request": (cpu1 - cpu0) * 1000 / ok,
        "redis_commands_per_request": (ops1 - ops0) / ok,
        "redis_round_trips_per_request": (calls1 - calls0) / ok,
        "errors": float(sample.errors),
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    rounds: list[dict[str, dict[str, float]]] = []
    with tempfile.TemporaryDirectory() as tmp, servers(Path(tmp)) as (targets, redis):
        redis_port = int(redis.url.rsplit(":", 1)[1])
        async with aiohttp.ClientSession() as session:
            for server in targets.values():
                await wait_ready(session, server)
        for index in range(args.rounds):
            order = TARGETS[index % len(TARGETS) :] + TARGETS[: index % len(TARGETS)]
            figures = {}
            for name in order:
                figures[name] = await measure(
                    targets[name], redis_port, args.requests, args.concurrency, args.warmup
                )
                redis_cpu = redis.cpu()
                figures[name]["redis_cpu_s_total"] = redis_cpu
            rounds.append(figures)
            print(f"round {index + 1}: " + json.dumps(figures), file=sys.stderr)
    medians = {
        name: {
            key: statistics.median(r[name][key] for r in rounds)
            for key in rounds[0][name]
            if key != "redis_cpu_s_total"
        }
        for name in TARGETS
    }
    base, local, shared = medians["passthrough"], medians["local"], medians["redis"]
    return {
        "benchmark": "shared_state",
        "revision": revision(),
        "machine": machine(cpu_line()),
        "requests": args.requests,
        "concurrency": args.concurrency,
        "rounds": args.rounds,
        "medians": medians,
        "redis_added_p50_ms": shared["p50_ms"] - local["p50_ms"],
        "redis_added_cpu_ms_per_request": shared["cpu_ms_per_request"]
        - local["cpu_ms_per_request"],
        "rps_ratio_redis_vs_local": shared["rps"] / local["rps"],
        "rps_ratio_w2_vs_w1": medians["redis-w2"]["rps"] / shared["rps"],
        "rps_ratio_local_vs_passthrough": local["rps"] / base["rps"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--warmup", type=int, default=300)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    result = uvloop.run(run(args))
    write_results(RESULTS, result)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
