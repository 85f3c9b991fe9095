"""Benchmarks survive a missing reading: an engine that does not answer its /metrics
(or a simulator its /sim/stats), answers an error or a page that does not parse is
recorded as missing and the run goes on."""

from __future__ import annotations

import asyncio
import math
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import cast

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from bench import retry_storm
from bench.common import Readings, cpu_flags, cpu_model
from bench.head_to_head import sim_stats
from bench.head_to_head_report import Phase, Slo, detail_table, main_table, missing_report
from bench.head_to_head_report import summarize as summarize_phase
from bench.head_to_head_traffic import Outcome
from bench.processes import Server
from bench.retry_storm_report import Entry, Result, rounds_table, run_stats
from bench.retry_storm_report import Run as RetryRun
from bench.retry_storm_report import missing_report as retry_missing_report
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


@pytest.fixture
async def sims(aiohttp_server: ServerFactory) -> dict[str, str]:
    """Two simulator-like replicas: one answers ``/sim/stats``, one answers 503."""

    def stats(behaviour: str) -> web.Application:
        async def handler(request: web.Request) -> web.Response:
            if behaviour == "error":
                return web.Response(status=503, text="busy")
            return web.json_response({"requests_total": 7, "errors_injected": 3})

        app = web.Application()
        app.router.add_get("/sim/stats", handler)
        return app

    return {
        b: str((await aiohttp_server(stats(b))).make_url("")).rstrip("/") for b in ("ok", "error")
    }


async def test_retry_storm_records_a_missing_sim_stats_reading_and_goes_on(
    sims: dict[str, str],
) -> None:
    """A replica whose /sim/stats fails: the fleet's count is None with the reason kept,
    and the run's replica figures come out n/a while the access-log ones stand."""
    readings = Readings(timeout_s=2.0)
    async with aiohttp.ClientSession() as session:
        assert await retry_storm._requests_total(session, [sims["ok"]], readings, "before") == [7]
        fleet = [sims["ok"], sims["error"]]
        assert await retry_storm._requests_total(session, fleet, readings, "after") is None
    assert [m.what for m in readings.missing] == ["after (sim-1)"]
    assert readings.missing[0].reason.startswith("ClientResponseError")

    results = [Result("r0", 1.0, 200, "", 0.1), Result("r1", 1.5, 200, "", 0.2)]
    log = {"r0": Entry(1, "ok", "", "sim-0"), "r1": Entry(2, "ok", "", "sim-0")}
    run = RetryRun(
        policy="budgeted", round=0, rate=2.0, window=(0.0, 2.0), results=results, log=log,
        replicas_in_window=retry_storm._differences(None, [1, 2]),
        replicas_total=retry_storm._differences([5, 6], [1, 2]), errors_injected=None,
        retry_budget_exhausted=0.0, elapsed_s=2.0, missing=[str(readings.missing[0])],
    )  # fmt: skip
    stats = run_stats(run, 1000.0, [1000.0], faulty="sim-1")
    assert stats.attempts_log == 3 and stats.per_dispatched_log == 1.5
    assert stats.attempts_replicas is None and stats.replicas_total == 8
    assert math.isnan(stats.per_dispatched_replicas)
    row = rounds_table({"budgeted": [stats]})[-1]
    assert "| 3; n/a | 1.500; n/a |" in row and "| 3 / 8 |" in row
    report = retry_missing_report({"budgeted": [stats]})
    assert report[0] == "readings missing: 1"
    assert report[1].startswith("- round 0 budgeted: after (sim-1): n/a (missing: ClientResponse")
