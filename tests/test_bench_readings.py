"""Benchmarks survive a missing reading: an engine that does not answer its /metrics,
answers an error or a page that does not parse is recorded as missing and the run goes on."""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import cast

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from bench.common import Readings, cpu_flags, cpu_model
from bench.head_to_head import sim_stats
from bench.head_to_head_report import Phase, Slo, detail_table, main_table, missing_report
from bench.head_to_head_report import summarize as summarize_phase
from bench.head_to_head_traffic import Outcome
from bench.processes import Server
from tests.conftest import ServerFactory

LLAMA_PAGE = (
    "llamacpp:tokens_predicted_total 10\nllamacpp:n_decode_total 5\n"
    "llamacpp:requests_processing 0\nllamacpp:requests_deferred 0\n"
)


@pytest.fixture
async def engines(aiohttp_server: ServerFactory) -> AsyncIterator[dict[str, TestServer]]:
    """Four llama-like engines: one answers, one never answers /metrics, one 500s,
    one answers a page that is not Prometheus text."""
    never = asyncio.Event()

    def metrics(behaviour: str) -> web.Application:
        async def handler(request: web.Request) -> web.Response:
            if behaviour == "hang":
                await never.wait()
            if behaviour == "error":
                return web.Response(status=503, text="busy")
            if behaviour == "garbage":
                return web.Response(text="<html>all threads busy</html>")
            return web.Response(text=LLAMA_PAGE)

        app = web.Application()
        app.router.add_get("/metrics", handler)
        return app

    servers = {b: await aiohttp_server(metrics(b)) for b in ("ok", "hang", "error", "garbage")}
    yield servers
    never.set()


def engine(name: str, server: TestServer) -> Server:
    """A benchmark ``Server`` record for an engine the test runs in process (no child)."""
    url = str(server.make_url("")).rstrip("/")
    return Server(name, url, "/health", cast("subprocess.Popen[bytes]", None), Path("/nonexistent"))


@pytest.mark.parametrize(
    ("behaviour", "reason"),
    [("hang", "TimeoutError"), ("error", "ClientResponseError"), ("garbage", "ValueError")],
)
async def test_a_failed_engine_reading_is_recorded_as_missing(
    engines: dict[str, TestServer], behaviour: str, reason: str
) -> None:
    """One engine of two fails its reading: the snapshot is None, the reason is kept,
    and the healthy engine's reading alone is not passed off as the fleet's."""
    readings = Readings(timeout_s=0.3)
    fleet = [engine("llama-0", engines["ok"]), engine("llama-1", engines[behaviour])]
    async with aiohttp.ClientSession() as session:
        assert await sim_stats(session, fleet[:1], readings, "counters") == [
            {"tokens_generated": 10.0, "steps": 5.0, "running": 0.0, "waiting": 0.0}
        ]
        assert await sim_stats(session, fleet, readings, "counters") is None
    assert len(readings.missing) == 1
    missing = readings.missing[0]
    assert missing.what == "counters (llama-1)"
    assert missing.reason.startswith(reason)
    assert str(missing).startswith("counters (llama-1): n/a (missing: " + reason)


def test_a_phase_without_engine_readings_prints_na_and_counts_them() -> None:
    """The phase's engine figures are n/a, not zero, and the report counts what is missing."""
    outcomes = [Outcome(due_s=0.0, measured=True, max_tokens=4, status=200, reason="",
                        ttft_s=0.1, total_s=0.2, tokens=4)]  # fmt: skip
    phase: Phase = summarize_phase(
        "direct", 2.0, 1.0, 1.0, outcomes, Slo(1000.0, 2000.0), engine=None, window=None
    )
    phase.front_outcomes = None
    phase.missing = ["engine counters after (llama-1): n/a (missing: TimeoutError)"]
    assert phase.wasted_tokens is None and phase.mean_batch is None
    assert phase.good == 1
    assert main_table([phase]).splitlines()[-1].endswith("| n/a | n/a |")
    assert "n/a, n/a, n/a | n/a |" in detail_table([phase])
    report = missing_report([phase])
    assert report.splitlines()[0].startswith("readings missing: 1")
    assert "direct 2x: engine counters after (llama-1): n/a (missing: TimeoutError)" in report
    assert missing_report([]) == "readings missing: 0"


def test_cpu_model_and_flags_come_from_cpuinfo(tmp_path: Path) -> None:
    """Published figures carry the CPU model and its notable flags."""
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(
        "processor\t: 0\nmodel name\t: Example CPU 9000\nflags\t\t: fpu avx2 sse4_2 amx_tile\n"
    )
    assert cpu_model(cpuinfo) == "Example CPU 9000"
    flags = cpu_flags(cpuinfo)
    assert flags["notable"] == ["avx2", "amx_tile", "sse4_2"]  # in NOTABLE_CPU_FLAGS order
    assert flags["all_sha256_12"] is not None and len(flags["all_sha256_12"]) == 12
    assert cpu_flags(tmp_path / "absent") == {"notable": [], "all_sha256_12": None}
    assert cpu_model(tmp_path / "absent")  # platform fallback, never empty
