"""``loadtest staircase`` against one real ``llama-server --parallel 4``: the knee is near 4."""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.real_engine import Engine
from proxy.loadtest.client import build_spec, make_session, send_one
from proxy.loadtest.report import write_staircase_report
from proxy.loadtest.staircase import StaircasePlan, run_staircase
from tests.engine import MODEL, LlamaServer, llama_servers

pytestmark = [pytest.mark.engine, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def four_slots(
    real_engine: Engine, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LlamaServer]:
    """One replica with four slots and both cores, serving the model whose decode is
    bound by reading its weights (``KNEE_MODEL_SHAPE``), so batching pays up to the
    slot count as it does on a GPU."""
    log_dir = tmp_path_factory.mktemp("llama4")
    with llama_servers(
        real_engine, log_dir, 1, parallel=4, threads=2, model=real_engine.knee_model
    ) as servers:
        yield servers[0]


#: The p99 SLO the test gives the staircase, in multiples of one request's
#: latency alone: past the slots a request waits a whole service (p99 3.6 to
#: 4x at 5), within them batching costs 1.7 to 2.3x at 4 on this CPU.
SLO_OVER_ALONE = 2.8
#: One request alone timed before and after the staircase: further apart than this
#: ratio, the machine's load changed under the run and its knee is no measurement.
QUIET_RATIO = 1.5


async def latency_alone(url: str, count: int = 8) -> float:
    """Median latency in ms of ``count`` requests one after another (the staircase's shape)."""
    rng = random.Random(7)
    latencies = []
    async with make_session(1, 60.0) as session:
        zero = time.perf_counter()
        for index in range(count):
            spec = build_spec(endpoint="chat", model=MODEL, input_tokens=rng.randint(8, 16),
                              max_tokens=64, rng=rng, ignore_eos=True)  # fmt: skip
            result = await send_one(session, url, spec, index=index, zero=zero)
            assert result.ok, result
            latencies.append((result.ended_at - result.started_at) * 1000.0)
    return statistics.median(latencies)


async def test_staircase_recommends_about_the_engines_slot_count(
    four_slots: LlamaServer, tmp_path: Path
) -> None:
    """Throughput rises while slots are free and stops at four: the staircase
    finds the throughput knee at 3 to 5. With a p99 SLO (an operator's input;
    here 2.8 times one request's latency alone, above what batching within the
    slots costs) the SLO decides and recommends at least 3. Where past four the
    p99 crosses the SLO is a timing figure of this CPU (seen: 4 and 4 on a
    quiet machine; 8 once when other work slowed the alone measurement and the
    closed loop staggered the fifth request's wait), so it is left to
    docs/ENGINES.md, not asserted. Short prompts: a long prefill stalls the
    other sequences' decoding on a CPU.

    Without an SLO the staircase's own "p99 over twice level 1" line decides,
    and on a CPU engine, where each extra sequence slows every step, that line
    falls at 2 to 4 from run to run (docs/ENGINES.md)."""
    alone_ms = await latency_alone(four_slots.url)
    plan = StaircasePlan(
        url=four_slots.url,
        levels=(1, 2, 3, 4, 5, 6, 8),
        requests_per_level=40,
        max_tokens=64,
        input_tokens=(8, 16),
        ignore_eos=True,
        model=MODEL,
        metrics_url=four_slots.url + "/metrics",
        p99_slo_ms=SLO_OVER_ALONE * alone_ms,
        request_timeout_s=60.0,
        level_timeout_s=90.0,
        cool_down_s=1.0,  # not the real-engine default of 30 s: the test's time is bounded
    )
    result = await run_staircase(plan)
    after_ms = await latency_alone(four_slots.url)
    verdict = result.verdict
    table = [
        (level.concurrency, round(level.requests_per_s, 1), round(level.latency_p99_ms or 0))
        for level in result.levels
    ]
    context = (round(alone_ms), round(after_ms), verdict.explanation, table)
    errors = [(level.concurrency, level.errors) for level in result.levels if level.error_count]
    assert not errors, (errors, context)
    for level in result.levels:  # the engine's own process, found by its port in /proc
        assert level.cpu_source == "proc" and level.engine_cpu is not None, level
        assert level.engine_cpu > 0 and (level.engine_rss_bytes or 0) > 100 << 20, level
    paths = write_staircase_report(result, tmp_path / "out")
    assert all(path.stat().st_size > 0 for path in paths)

    # The knee is a measurement of this CPU, valid only if the machine's other work
    # stayed the same through the run: one request alone, timed before and after,
    # must agree. (Seen otherwise only with other suites running beside this one:
    # alone 1,863 ms before, level 1 at 451 ms, a stall at level 4.)
    if max(alone_ms, after_ms) > QUIET_RATIO * min(alone_ms, after_ms):
        pytest.skip(f"the machine's load changed during the staircase: {context}")
    # Timing verdicts from here: a level 1 stretched by other work crosses the SLO
    # (alone 521 ms before, 265 ms after, level 1's p99 1,613 ms: nothing recommended).
    assert verdict.recommended_max_concurrency is not None, context
    assert verdict.decided_by == "p99_slo", context
    assert verdict.throughput_knee is not None and 3 <= verdict.throughput_knee <= 5, context
    assert verdict.recommended_max_concurrency >= 3, context
    by_level = {level.concurrency: level for level in result.levels}
    if 8 in by_level:  # past the slots the engine queues: no more throughput
        assert by_level[8].requests_per_s < 1.3 * by_level[4].requests_per_s, context
