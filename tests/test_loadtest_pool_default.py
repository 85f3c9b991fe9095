"""``loadtest staircase`` without ``--model`` through a two-pool proxy.

``--model`` defaults to the first of ``URL/v1/models``, and the idle check
reads that model's pool either way: another pool's traffic must not mark the
run's levels busy (it did when the pool was resolved only for ``--model``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace

import aiohttp
import pytest

from proxy.loadtest.staircase import StaircasePlan, run_staircase
from proxy.sim import SimConfig, SimServer, start_sim
from tests.conftest import ProxyUnderTest
from tests.helpers import KEY_A, make_config, wait_for

Start = Callable[..., Awaitable[ProxyUnderTest]]
FAST = SimConfig(slots=2, decode_base_ms=2.0, decode_per_seq_ms=0.5, prefill_ms_per_token=0.0)


@pytest.fixture
async def alpha_fast_beta_slow() -> AsyncIterator[dict[str, SimServer]]:
    sims = {
        "alpha": await start_sim(replace(FAST, model_name="alpha")),
        "beta": await start_sim(replace(FAST, model_name="beta", decode_base_ms=200.0)),
    }
    try:
        yield sims
    finally:
        for sim in sims.values():
            await sim.close()


@pytest.mark.parametrize("model", [None, "alpha"], ids=["default-model", "explicit-model"])
async def test_staircase_default_model_idle_check_reads_its_pool(
    start_proxy: Start, alpha_fast_beta_slow: dict[str, SimServer], model: str | None
) -> None:
    """beta's pool runs one long request; the staircase discovers (or is given) alpha
    and loads it, whose pool is idle: its levels read idle at start either way."""
    sims = alpha_fast_beta_slow
    config = make_config(
        [],
        replicas=[
            {"name": f"r-{n}", "url": s.url, "max_concurrency": 2, "models": [n]}
            for n, s in sims.items()
        ],
    )
    proxy = await start_proxy(config, access_log=False)
    headers = {"Authorization": f"Bearer {KEY_A}"}
    body = {"model": "beta", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 500}
    async with aiohttp.ClientSession() as session:
        long = asyncio.create_task(
            session.post(proxy.url + "/v1/chat/completions", json=body, headers=headers)
        )
        try:
            beta = proxy.runtime.pool.get("r-beta")
            assert beta is not None
            await wait_for(lambda: beta.inflight == 1)  # beta's seat is taken
            plan = StaircasePlan(
                url=proxy.url, model=model, levels=(1,), requests_per_level=3, max_tokens=4,
                input_tokens=(8, 16), api_key=KEY_A, cool_down_s=0.0, rerun=False,
            )  # fmt: skip
            result = await run_staircase(plan)
        finally:
            long.cancel()
    assert result.model == "alpha"
    assert all(level.error_count == 0 for level in result.levels), result.levels
    assert [level.idle_at_start for level in result.levels] == [True], (
        [level.busy_at_start for level in result.levels],
        result.notes,
    )
