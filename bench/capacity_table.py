"""Capacity table runs (issue 19): ``loadtest phases`` through the proxy, end to end.

Starts two replicas (``--engine sim``: ``admission-proxy sim`` processes;
``--engine llama``: real ``llama-server --parallel 4`` processes with the
120 MB knee model of ``scripts/real-engine``), the proxy in front of them, then runs the
product's own command, ``admission-proxy loadtest phases``, with the workload
below, and prints the capacity table that ends its report. Every server is a
child process on a loopback port, stopped in ``finally``.

Each run has a fault phase. Simulated: one replica answers 30% of requests
with 503 (the simulator's ``/sim/faults``). Real engines: ``llama-server``
has no fault switch, so the harness runs a pause controller
(``python -m proxy.loadtest.pause``) for replica 0's process and the phase
freezes it (SIGSTOP, SIGCONT when the phase ends): a hung replica, with its
connections open and nothing answered, for the proxy's first-byte timeout,
retries and health ejection to handle.

    .venv/bin/python -m bench.capacity_table [--engine sim|llama] [--duration-scale F]
        [--out DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from bench.common import scrubbed_env
from bench.head_to_head_traffic import MODEL
from bench.processes import ROOT, Server, free_port, start_server, stop_server, wait_ready
from bench.real_engine import ensure as ensure_engine
from proxy.settings import parse_config

SLOTS = 4
SIM_ARGS = (
    "--decode-base-ms",
    "20",
    "--decode-per-seq-ms",
    "2.5",
    "--prefill-ms-per-token",
    "0.02",
)
KEYS = {"chat": "bench-chat-key", "batch": "bench-batch-key"}


def workload(engine: str) -> dict[str, Any]:
    """Two tenants, short and long requests, and phases around each setup's capacity.

    The mix averages about 32 output tokens: the simulated pair (8 slots at
    20 to 30 ms a step) serves about 8 req/s of it, so the ramp ends past
    capacity and the burst is about 4 times it. The llama pair runs the
    120 MB "knee" model of ``scripts/real-engine`` (decode bound by reading
    its weights, as on a GPU), one thread each, with a similar capacity.
    """
    rates = {"sim": (4.0, 10.0, 30.0), "llama": (2.0, 8.0, 25.0)}[engine]
    low, high, burst = rates
    phases: list[dict[str, Any]] = [
        {"name": "baseline", "duration_s": 20, "rate_per_s": low},
        {"name": "ramp", "duration_s": 20, "rate_per_s": low, "to_rate_per_s": high},
        {"name": "burst", "duration_s": 10, "rate_per_s": burst},
    ]
    if engine == "sim":
        phases.append(
            {"name": "replica-errors", "duration_s": 20, "rate_per_s": low * 1.5,
             "fault": {"target": 0, "error_rate": 0.3, "error_status": 503}}
        )  # fmt: skip
    else:
        phases.append(
            {"name": "replica-hung", "duration_s": 20, "rate_per_s": low * 1.5,
             "fault": {"target": 0, "pause": True}}
        )  # fmt: skip
    phases.append({"name": "recovery", "duration_s": 20, "rate_per_s": low})
    return {
        "seed": 3,
        "metrics_interval_s": 0.5,
        "drain_after": "burst",
        "request_timeout_s": 60,
        "slo": {"ttft_ms": 2000, "total_ms": 10000},
        "request_classes": {
            "short": {"input_tokens": [16, 64], "max_tokens": 16},
            "long": {"input_tokens": [128, 384], "max_tokens": 48},
        },
        "tenants": {
            "chat": {
                "api_key": KEYS["chat"],
                "share": 2,
                "mix": {"short": 3, "long": 1},
                "slo": {"ttft_ms": 1000, "total_ms": 5000},
            },
            "batch": {
                "api_key": KEYS["batch"],
                "share": 1,
                "mix": {"long": 1},
                "slo": {"ttft_ms": 10000, "total_ms": 30000},
            },
        },
        "phases": phases,
    }


def proxy_config(port: int, urls: Sequence[str], engine: str) -> str:
    document = {
        "server": {"host": "127.0.0.1", "port": port},
        "replicas": [
            {"name": f"{engine}-{i}", "url": url, "max_concurrency": SLOTS}
            for i, url in enumerate(urls)
        ],
        "budgets": {"queue_ms": 1000, "first_byte_ms": 10000, "total_ms": 30000},
        "tenants": {
            "chat": {"api_keys": [KEYS["chat"]], "priority": "interactive", "queue_capacity": 32},
            "batch": {"api_keys": [KEYS["batch"]], "priority": "batch", "queue_capacity": 32},
        },
    }
    text = yaml.safe_dump(document, sort_keys=False)
    parse_config(text)
    return text


def start_replicas(engine: str, workdir: Path) -> list[Server]:
    servers = []
    built = ensure_engine() if engine == "llama" else None
    for index in range(2):
        port = free_port()
        if built is None:
            argv = [sys.executable, "-m", "proxy", "sim", "--port", str(port), "--slots",
                    str(SLOTS), "--seed", str(index), *SIM_ARGS]  # fmt: skip
        else:
            argv = [str(built.server), "-m", str(built.knee_model), "--host", "127.0.0.1",
                    "--port", str(port), "--parallel", str(SLOTS), "-c", str(4096 * SLOTS),
                    "-t", "1", "--metrics", "--no-webui", "-a", MODEL]  # fmt: skip
        servers.append(
            start_server(f"{engine}-{index}", argv, port, "/health", workdir, scrubbed_env())
        )
    return servers


def start_pause_controller(engine: Server, workdir: Path) -> Server:
    """The fault switch for ``engine``'s process: ``{"pause": true}`` freezes it."""
    port = free_port()
    argv = [sys.executable, "-m", "proxy.loadtest.pause", "--pid", str(engine.process.pid),
            "--port", str(port)]  # fmt: skip
    return start_server("pause-" + engine.name, argv, port, "/health", workdir, scrubbed_env())


async def wait_all(servers: Sequence[Server]) -> None:
    async with aiohttp.ClientSession() as session:
        for server in servers:
            await wait_ready(session, server, timeout_s=60.0)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", choices=("sim", "llama"), default="sim")
    parser.add_argument("--duration-scale", type=float, default=1.0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    out = args.out or ROOT / "bench" / "results" / f"capacity-{args.engine}"
    servers: list[Server] = []
    with tempfile.TemporaryDirectory(prefix="capacity-") as tmp:
        workdir = Path(tmp)
        try:
            servers += start_replicas(args.engine, workdir)
            asyncio.run(wait_all(servers))
            port = free_port()
            config = workdir / "proxy.yaml"
            config.write_text(proxy_config(port, [s.url for s in servers], args.engine))
            serve = [sys.executable, "-m", "proxy", "serve", "--config", str(config)]
            proxy = start_server("proxy", serve, port, "/readyz", workdir, scrubbed_env())
            servers.append(proxy)
            asyncio.run(wait_all([proxy]))
            load = workdir / "workload.yaml"
            load.write_text(yaml.safe_dump(workload(args.engine), sort_keys=False))
            command = [sys.executable, "-m", "proxy", "loadtest", "phases", "--url", proxy.url,
                       "--workload", str(load), "--out", str(out), "--quiet",
                       "--duration-scale", str(args.duration_scale)]  # fmt: skip
            if args.engine == "sim":
                command += ["--fault-url", servers[0].url]
            else:  # stopped before the engines (reversed below), so it lets go of them first
                servers.append(start_pause_controller(servers[0], workdir))
                asyncio.run(wait_all([servers[-1]]))
                command += ["--fault-url", servers[-1].url]
            status = subprocess.run(command, cwd=ROOT, check=False).returncode
            out.mkdir(parents=True, exist_ok=True)
            (out / "workload.yaml").write_text(load.read_text())
            (out / "proxy.yaml").write_text(config.read_text())
        finally:
            for server in reversed(servers):
                stop_server(server)
    report = (out / "report.md").read_text() if (out / "report.md").exists() else ""
    print(report.split("## Capacity", 1)[-1] if "## Capacity" in report else report)
    return status


if __name__ == "__main__":
    raise SystemExit(main())
