"""The pause fault: a phase freezes a real engine process (SIGSTOP) through a controller.

The engine here is a simulator run as its own process (``admission-proxy
sim``), so it can be frozen like llama-server would be; the controller is
``proxy.loadtest.pause`` on a loopback port. No timed assertions: the
controller answers only once the kernel reports the new process state.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from proxy.loadtest.pause import is_stopped, pause_app
from proxy.loadtest.phases import PhasesPlan, run_phases
from proxy.loadtest.workload import WorkloadError, parse_workload, workload_from_mapping
from proxy.sim import SimConfig, SimServer, start_sim
from tests.conftest import ProxyUnderTest
from tests.engine import free_port
from tests.helpers import KEY_A, make_config

Start = Callable[..., Awaitable[ProxyUnderTest]]
READY_TIMEOUT_S = 30.0


@pytest.fixture
def sim_process() -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """A simulator in its own process (so it can be frozen), stopped at the end."""
    port = free_port()
    argv = [sys.executable, "-m", "proxy", "sim", "--port", str(port), "--slots", "4",
            "--decode-base-ms", "2", "--decode-per-seq-ms", "0.5",
            "--prefill-ms-per-token", "0"]  # fmt: skip
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield process, f"http://127.0.0.1:{port}"
    finally:
        if process.poll() is None and is_stopped(process.pid):
            process.send_signal(signal.SIGCONT)  # so that the terminate below is acted on
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


async def wait_healthy(url: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + READY_TIMEOUT_S
    async with aiohttp.ClientSession() as session:
        while loop.time() < deadline:
            try:
                async with session.get(url + "/health") as resp:
                    if resp.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.05)
    raise AssertionError(f"{url} never became healthy")


@pytest.fixture
async def controller(
    sim_process: tuple[subprocess.Popen[bytes], str],
) -> AsyncIterator[str]:
    """The pause controller for the simulator process, on an OS-chosen port."""
    runner = web.AppRunner(pause_app(sim_process[0].pid))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def test_controller_freezes_and_lets_go_of_the_process(
    sim_process: tuple[subprocess.Popen[bytes], str], controller: str
) -> None:
    """POST pause true: the process is stopped when the answer comes; false: running;
    GET reports the state; bad bodies get 400 and change nothing."""
    process, url = sim_process
    await wait_healthy(url)
    async with aiohttp.ClientSession() as session:
        async with session.get(controller + "/sim/faults") as resp:
            assert await resp.json() == {"pause": False}
        async with session.post(controller + "/sim/faults", json={"pause": True}) as resp:
            assert resp.status == 200
        assert is_stopped(process.pid)
        async with session.get(controller + "/sim/faults") as resp:
            assert await resp.json() == {"pause": True}
        for bad in ({"pause": "yes"}, {"error_rate": 0.3}, [1]):
            async with session.post(controller + "/sim/faults", json=bad) as resp:
                assert resp.status == 400
        assert is_stopped(process.pid)
        async with session.post(controller + "/sim/faults", json={"pause": False}) as resp:
            assert resp.status == 200
        assert not is_stopped(process.pid)
    await wait_healthy(url)


async def test_controller_lets_the_process_go_when_it_stops(
    sim_process: tuple[subprocess.Popen[bytes], str],
) -> None:
    """A controller shut down while the engine is frozen resumes it."""
    process, url = sim_process
    await wait_healthy(url)
    runner = web.AppRunner(pause_app(process.pid))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"http://127.0.0.1:{port}/sim/faults", json={"pause": True}) as resp,
    ):
        assert resp.status == 200
    assert is_stopped(process.pid)
    await runner.cleanup()
    assert not is_stopped(process.pid)


def _fault_issues(fault: str) -> dict[str, str]:
    text = f"""
request_classes: {{short: {{input_tokens: [8, 16], max_tokens: 4}}}}
tenants: {{a: {{api_key: k, mix: {{short: 1}}}}}}
phases:
  - {{name: hung, duration_s: 1, rate_per_s: 5, fault: {fault}}}
"""
    with pytest.raises(WorkloadError) as caught:
        parse_workload(text, "w.yaml")
    return {issue.path: issue.message for issue in caught.value.issues}


def test_pause_fault_stands_alone_and_must_be_true() -> None:
    assert _fault_issues("{pause: true, error_rate: 0.3}") == {
        "phases[0].fault.error_rate": (
            "pause stands alone: a pause controller knows no other fault field"
        )
    }
    assert _fault_issues("{pause: false}") == {
        "phases[0].fault.pause": "must be true (the phase freezes the engine)"
    }


def pause_workload(controller_url: str) -> dict[str, Any]:
    return {
        "seed": 5,
        "metrics_interval_s": 0.1,
        "timeline_bin_s": 0.5,
        "drain_timeout_s": 20,
        "request_timeout_s": 15,
        "slo": {"total_ms": 2000},
        "request_classes": {"short": {"input_tokens": [8, 32], "max_tokens": 8}},
        "tenants": {"a": {"api_key": KEY_A, "share": 1, "mix": {"short": 1}}},
        "phases": [
            {"name": "baseline", "duration_s": 1.0, "rate_per_s": 10},
            {"name": "hung", "duration_s": 1.5, "rate_per_s": 10,
             "fault": {"target": controller_url, "pause": True}},
            {"name": "recovery", "duration_s": 1.0, "rate_per_s": 10},
        ],
    }  # fmt: skip


async def test_phases_run_freezes_a_replica_for_its_fault_phase(
    start_proxy: Start,
    sim_process: tuple[subprocess.Popen[bytes], str],
    controller: str,
) -> None:
    """A phase with ``pause: true`` freezes replica 0 through the controller: the proxy
    times out or ejects it, every request is answered, the capacity table's fault row is
    that phase's good share (recounted here), and the engine runs again afterwards."""
    process, url = sim_process
    await wait_healthy(url)
    other: SimServer = await start_sim(
        SimConfig(slots=4, decode_base_ms=2.0, decode_per_seq_ms=0.5, prefill_ms_per_token=0.0)
    )
    try:
        config = make_config(
            [url, other.url],
            seats=4,
            budgets={"queue_ms": 1000, "first_byte_ms": 500, "total_ms": 5000},
            retry={"base_backoff_ms": 5, "max_backoff_ms": 20, "min_retries_per_s": 50},
            health={"interval_ms": 200},
        )
        proxy = await start_proxy(config, access_log=False)
        workload = workload_from_mapping(pause_workload(controller))
        plan = PhasesPlan(url=proxy.url, workload=workload, workload_source="test")
        result = await run_phases(plan)
    finally:
        await other.close()

    # The switch worked both ways (a failed switch is a note), and the engine is back.
    assert not [n for n in result.generator_notes if "fault" in n], result.generator_notes
    assert not is_stopped(process.pid)
    await wait_healthy(url)
    assert result.overloaded == result.unfinished == 0
    assert len(result.results) == len(result.arrivals) > 0

    table = {row.name: row for row in result.capacity}
    fault = table["fault_degradation"]
    hung = [r for r in result.results if r.phase == "hung"]
    good = [r for r in hung if r.error is None and r.latency_s * 1000 <= 2000]
    assert fault.phase == "hung"
    assert fault.value == pytest.approx(len(good) / len(hung))
    assert "pause=True" in fault.config
    assert fault.figures["faults"] == {"hung": {"pause": True}}
    # The phase with the fault is not counted as stable load.
    assert table["stable_load"].phase != "hung"
    await asyncio.sleep(0)
    proxy.assert_idle()
