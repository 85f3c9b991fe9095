"""Staircase resources: CPU and memory per level, the GPU memory stop line, the
cool-down and the "not idle at the start" note, against real simulators.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import aiohttp
import pytest

from proxy.loadtest.client import build_spec, make_session, send_one
from proxy.loadtest.knee import StopLine
from proxy.loadtest.report import write_staircase_report
from proxy.loadtest.resources import listening_pids
from proxy.loadtest.staircase import (
    REAL_COOL_DOWN_S,
    SIM_COOL_DOWN_S,
    StaircasePlan,
    _cool_down,
    run_staircase,
)
from proxy.loadtest.target import TargetInfo
from proxy.sim import SimConfig, SimServer, start_sim
from proxy.telemetry.gpu import GpuReading
from tests.conftest import ProxyUnderTest
from tests.helpers import KEY_A, make_config

Start = Callable[..., Awaitable[ProxyUnderTest]]
GIB = 1 << 30
FAST = SimConfig(slots=4, decode_base_ms=1.0, decode_per_seq_ms=0.2, prefill_ms_per_token=0.0)


def quick_plan(url: str, **overrides: object) -> StaircasePlan:
    settings: dict[str, object] = {
        "url": url,
        "levels": (1, 2),
        "requests_per_level": 8,
        "max_tokens": 4,
        "input_tokens": (8, 16),
        "cool_down_s": 0.0,
        "request_timeout_s": 20.0,
        "level_timeout_s": 30.0,
    }
    settings.update(overrides)
    return StaircasePlan(**settings)  # type: ignore[arg-type]


def test_listening_pids_finds_the_listener() -> None:
    """A socket listening in this process is found by its port in /proc."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(1)
        port = sock.getsockname()[1]
        assert listening_pids([port]) == {port: (os.getpid(),)}
    assert listening_pids([port]) == {}


@contextlib.contextmanager
def sim_process(tmp_path: Path) -> Iterator[str]:
    """``admission-proxy sim`` as a child process on an OS-chosen port: its URL."""
    log = tmp_path / "sim.log"
    argv = [sys.executable, "-m", "proxy", "sim", "--port", "0", "--slots", "4"]
    argv += ["--decode-base-ms", "2", "--prefill-ms-per-token", "0"]
    with log.open("wb") as out:
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    try:
        url = None
        for _ in range(300):  # up to 30 s on a loaded machine
            text = log.read_text()
            if " on http://" in text:
                url = text.split(" on ", 1)[1].split()[0]
                break
            assert process.poll() is None, text
            time.sleep(0.1)
        assert url is not None, log.read_text()
        yield url
    finally:
        process.terminate()
        process.wait(10)


async def test_staircase_reads_the_engine_processes_cpu_and_memory(tmp_path: Path) -> None:
    """A simulator in its own process: each level records its CPU (from /proc, above zero)
    and resident memory; the cool-down is waited between levels only; the engine was idle
    at every level's start; and the report says what it could not read (or read) of the GPU."""
    with sim_process(tmp_path) as url:
        # Enough work per level that the engine's CPU time spans many of /proc's
        # 10 ms clock ticks: eight tiny requests could land between two ticks and read 0.
        plan = quick_plan(url, cool_down_s=0.2, requests_per_level=48, max_tokens=16)
        result = await run_staircase(plan)
    assert result.target is not None and result.target.kind == "engine"
    assert result.target.simulator is True
    assert [level.cool_down_s for level in result.levels] == [0.0, 0.2]
    for level in result.levels:
        assert level.cpu_source == "proc"
        assert level.engine_cpu is not None and level.engine_cpu > 0
        assert level.engine_rss_bytes is not None and level.engine_rss_bytes > 10 << 20
        assert level.proxy_cpu is None  # no proxy in front
        assert level.idle_at_start is True
    if result.levels[0].gpu_source is None:  # no GPU here: the report says why
        assert any(note.startswith("GPU: ") for note in result.resource_notes)
    write_staircase_report(result, tmp_path / "out")
    markdown = (tmp_path / "out" / "report.md").read_text()
    assert "## Resources" in markdown and "| engine CPU |" in markdown


class FillingGpu:
    """A GPU probe: 40 GiB free before the load, 0.5 GiB free once the load runs."""

    def __init__(self) -> None:
        self.calls = 0

    def available(self) -> bool:
        return True

    def sample(self) -> list[GpuReading]:
        self.calls += 1
        free = 40 * GIB if self.calls == 1 else GIB // 2
        return [GpuReading(0, 0.7, 80 * GIB - free, 80 * GIB)]


@pytest.fixture
async def fast_sim() -> AsyncIterator[SimServer]:
    sim = await start_sim(FAST)
    try:
        yield sim
    finally:
        await sim.close()


async def test_under_1_gib_free_stops_the_staircase_and_says_why(
    fast_sim: SimServer, tmp_path: Path
) -> None:
    """GPU memory under 1 GiB free at level 1 and on its re-run: the staircase stops there,
    recommends nothing, and its notes give the reading that crossed the line."""
    result = await run_staircase(quick_plan(fast_sim.url, gpu_probe=FillingGpu()))
    assert [(level.concurrency, level.run) for level in result.levels] == [(1, 1), (1, 2)]
    stop = result.verdict.stop
    assert stop is not None and StopLine.MEMORY_FREE in stop.lines
    assert result.verdict.recommended_max_concurrency is None
    level = result.levels[-1]
    assert level.gpu_memory_free_bytes == GIB // 2 and level.gpu_source == "probe"
    why = [note for note in result.notes if note.startswith("stopped after level 1 (re-run)")]
    assert why and "memory_under_1gb_free" in why[0] and "0.50 GiB free" in why[0]
    write_staircase_report(result, tmp_path)
    assert "512 MiB" in (tmp_path / "report.md").read_text()


async def test_a_level_that_starts_busy_is_noted(start_proxy: Start, fast_sim: SimServer) -> None:
    """A long request already in flight through the proxy when the staircase starts: the
    first level's start reads it from /admin/state and the report notes it."""
    proxy = await start_proxy(make_config([fast_sim.url], seats=4), access_log=False)
    await fast_sim.set_faults(hang_before_first_byte_ms=8_000)  # the next request holds a seat
    headers = {"Authorization": f"Bearer {KEY_A}"}
    async with make_session(2, 60.0) as session:
        spec = build_spec(endpoint="chat", model="sim-model", input_tokens=8, max_tokens=4,
                          rng=random.Random(1), headers=headers)  # fmt: skip
        held = asyncio.create_task(send_one(session, proxy.url, spec, index=0, zero=0.0))
        try:
            # Arrived at the sim (which keeps the faults it arrived under), not only
            # seated by the proxy: lifting the fault before then would lift its hang.
            async with asyncio.timeout(10):
                while fast_sim.state.in_flight < 1:
                    await asyncio.sleep(0.01)
            await fast_sim.set_faults(hang_before_first_byte_ms=0)
            result = await run_staircase(quick_plan(proxy.url, levels=(1,), api_key=KEY_A))
        finally:
            held.cancel()
            with contextlib.suppress(asyncio.CancelledError, aiohttp.ClientError):
                await held
    assert result.target is not None and result.target.kind == "proxy"
    assert result.target.simulator is True
    first = result.levels[0]
    assert first.idle_at_start is False
    assert first.busy_at_start is not None and "1 in flight" in first.busy_at_start
    assert any("not idle when these levels started" in note for note in result.notes)


def test_cool_down_default_depends_on_the_target() -> None:
    """30 s before a real engine (with a note), 1 s before simulators, else as given."""
    notes: list[str] = []
    plan = StaircasePlan(url="http://127.0.0.1:1")
    assert _cool_down(plan, TargetInfo(kind="engine"), notes) == REAL_COOL_DOWN_S == 30.0
    assert notes and "--cool-down" in notes[0]
    assert _cool_down(plan, TargetInfo(kind="proxy", simulator=True), []) == SIM_COOL_DOWN_S
    given = StaircasePlan(url="http://127.0.0.1:1", cool_down_s=5.0)
    assert _cool_down(given, TargetInfo(kind="engine"), []) == 5.0


async def test_through_the_proxy_memory_is_the_engines_kv_cache(
    start_proxy: Start, fast_sim: SimServer
) -> None:
    """Through the proxy, whose /metrics has no KV cache, each level's memory is the
    engines' KV-cache usage the proxy reads from its replicas (``/admin/state``)."""
    replicas = [{"name": "r0", "url": fast_sim.url, "max_concurrency": 4,
                 "metrics_url": fast_sim.url + "/metrics"}]  # fmt: skip
    config = make_config([], replicas=replicas, health={"interval_ms": 100})
    proxy = await start_proxy(config, access_log=False)
    async with asyncio.timeout(10):  # the first engine reading
        while proxy.runtime.health.engine_reading("r0") is None:
            await asyncio.sleep(0.02)
    result = await run_staircase(quick_plan(proxy.url, api_key=KEY_A))
    assert all(level.error_count == 0 for level in result.levels), result.levels
    for level in result.levels:
        assert level.memory_source == "kv_cache" and level.memory_ratio is not None, level
