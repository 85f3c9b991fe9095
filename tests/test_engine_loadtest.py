"""``loadtest staircase`` against one real ``llama-server --parallel 4``: the knee is near 4."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from proxy.loadtest.report import write_staircase_report
from proxy.loadtest.staircase import StaircasePlan, run_staircase
from scripts.real_engine import Engine
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


async def test_staircase_recommends_about_the_engines_slot_count(
    four_slots: LlamaServer, tmp_path: Path
) -> None:
    """Throughput rises while slots are free and stops at four; past four, requests
    wait in the engine and p99 climbs. The knee and the recommendation land at 3 to
    5 (seen: knee 4 every time; p99 at 4 is about twice level 1's, so the latency
    limit is 3 or 4). Short prompts: a long prefill stalls the other sequences'
    decoding on a CPU and flattens the curve."""
    plan = StaircasePlan(
        url=four_slots.url,
        levels=(1, 2, 3, 4, 5, 6, 8),
        requests_per_level=40,
        max_tokens=64,
        input_tokens=(8, 16),
        ignore_eos=True,
        model=MODEL,
        metrics_url=four_slots.url + "/metrics",
        request_timeout_s=60.0,
        level_timeout_s=90.0,
    )
    result = await run_staircase(plan)
    verdict = result.verdict
    table = [
        (level.concurrency, round(level.requests_per_s, 1), level.latency_p99_ms)
        for level in result.levels
    ]
    assert all(level.error_count == 0 for level in result.levels), table
    assert verdict.throughput_knee is not None and 3 <= verdict.throughput_knee <= 5, table
    assert verdict.recommended_max_concurrency is not None, table
    assert 3 <= verdict.recommended_max_concurrency <= 5, (verdict, table)
    by_level = {level.concurrency: level for level in result.levels}
    if 8 in by_level:  # past the slots the engine queues: no more throughput
        assert by_level[8].requests_per_s < 1.3 * by_level[4].requests_per_s, table
    paths = write_staircase_report(result, tmp_path / "out")
    assert all(path.stat().st_size > 0 for path in paths)
