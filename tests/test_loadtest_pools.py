"""Load tests per model pool: two simulators serving different models behind one proxy.

``loadtest staircase --model`` and ``loadtest phases --model`` must load the
named pool only, and their reports must name it.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml

from proxy.cli import main
from proxy.loadtest.phases import PhasesPlan, run_phases
from proxy.loadtest.phases_report import write_phases_report
from proxy.loadtest.report import write_staircase_report
from proxy.loadtest.scrape import parse_metrics
from proxy.loadtest.staircase import StaircasePlan, run_staircase
from proxy.loadtest.target import pool_in_state, pool_labels
from proxy.loadtest.workload import workload_from_mapping
from proxy.sim import SimConfig, SimServer, start_sim
from tests.conftest import ProxyUnderTest
from tests.helpers import KEY_A, make_config
from tests.test_loadtest_runs import phases_workload, sim_in_thread

Start = Callable[..., Awaitable[ProxyUnderTest]]
FAST = SimConfig(slots=2, decode_base_ms=2.0, decode_per_seq_ms=0.5, prefill_ms_per_token=0.0)


@pytest.fixture
async def two_pools() -> AsyncIterator[dict[str, SimServer]]:
    """Two simulated replicas: ``alpha`` served by one, ``beta`` by the other."""
    sims = {name: await start_sim(replace(FAST, model_name=name)) for name in ("alpha", "beta")}
    try:
        yield sims
    finally:
        for sim in sims.values():
            await sim.close()


def pool_config(sims: dict[str, SimServer]) -> dict[str, Any]:
    return {
        "replicas": [
            {"name": f"r-{name}", "url": sim.url, "max_concurrency": 2, "models": [name]}
            for name, sim in sims.items()
        ],
    }


def submitted(sim: SimServer) -> int:
    return sim.engine.stats().submitted


async def test_staircase_with_model_loads_only_that_pool(
    start_proxy: Start, two_pools: dict[str, SimServer], tmp_path: Path
) -> None:
    """A staircase for ``beta`` through the proxy: beta's replica serves every request,
    alpha's none; the report names beta, and the idle check reads beta's pool."""
    config = make_config([], **pool_config(two_pools))
    proxy = await start_proxy(config, access_log=False)
    before = {name: submitted(sim) for name, sim in two_pools.items()}
    plan = StaircasePlan(
        url=proxy.url,
        model="beta",
        levels=(1, 2),
        requests_per_level=6,
        max_tokens=4,
        input_tokens=(8, 16),
        api_key=KEY_A,
        cool_down_s=0.0,
    )
    result = await run_staircase(plan)
    assert all(level.error_count == 0 for level in result.levels), result.levels
    sent = sum(level.requests for level in result.levels)
    warmups = sum(plan.warmup_for(level.concurrency) for level in result.levels)
    assert submitted(two_pools["beta"]) - before["beta"] >= sent + warmups
    assert submitted(two_pools["alpha"]) == before["alpha"]
    assert result.model == "beta"
    assert all(level.idle_at_start is True for level in result.levels)
    write_staircase_report(result, tmp_path)
    assert json.loads((tmp_path / "report.json").read_text())["model"] == "beta"
    markdown = (tmp_path / "report.md").read_text()
    assert "model `beta`" in markdown
    # Measured through the proxy: no replica entry whose url is the proxy's own (pasted
    # into the config, the proxy would forward to itself), but what the figure is.
    snippet = markdown.split("```yaml\n")[1].split("```")[0]
    assert yaml.safe_load(snippet) is None and proxy.url not in snippet
    assert "through the proxy" in snippet


async def test_staircase_through_an_alias_measures_its_pool(
    start_proxy: Start, two_pools: dict[str, SimServer]
) -> None:
    """--model names an alias of beta: /admin/state lists it under beta's pool, beta's
    replica gets the load, and no note says the name is no pool; a name that is no
    pool at all gets that note (its figures are the fleet's)."""
    config = make_config([], **pool_config(two_pools), model_aliases={"b-alias": "beta"})
    proxy = await start_proxy(config, access_log=False)
    state = await (await proxy.client.get("/admin/state")).json()
    assert state["pools"]["beta"]["aliases"] == ["b-alias"]
    before = {name: submitted(sim) for name, sim in two_pools.items()}
    plan = StaircasePlan(
        url=proxy.url, model="b-alias", levels=(1,), requests_per_level=4, max_tokens=4,
        input_tokens=(8, 16), api_key=KEY_A, cool_down_s=0.0,
    )  # fmt: skip
    result = await run_staircase(plan)
    assert all(level.error_count == 0 for level in result.levels), result.levels
    assert submitted(two_pools["beta"]) > before["beta"]
    assert submitted(two_pools["alpha"]) == before["alpha"]
    assert not [n for n in result.notes if "no model pool" in n], result.notes
    stray = await run_staircase(replace(plan, model="gamma", levels=(1,), requests_per_level=1))
    assert [n for n in stray.notes if "'gamma' is no model pool" in n], stray.notes


async def test_staircase_stops_at_once_when_the_proxy_refuses_its_requests(
    start_proxy: Start, two_pools: dict[str, SimServer]
) -> None:
    """A key the proxy does not know: every request of the first level is 401. That is
    the load test's own setup, not the fleet's capacity: no confirming re-run (which
    waits a cool-down), and a note saying what to fix, not a failed stop line."""
    config = make_config([], **pool_config(two_pools))
    proxy = await start_proxy(config, access_log=False)
    plan = StaircasePlan(
        url=proxy.url, model="beta", levels=(1, 2), requests_per_level=3, max_tokens=4,
        input_tokens=(8, 16), api_key="sk-not-a-key", cool_down_s=0.0,
    )  # fmt: skip
    result = await run_staircase(plan)
    assert [(level.concurrency, level.run) for level in result.levels] == [(1, 1)]
    assert [n for n in result.notes if "unauthenticated" in n and "--api-key" in n], result.notes


def test_a_pool_is_found_by_its_name_or_an_alias() -> None:
    """/admin/state's pools: beta by name and through its alias, nothing for a stranger;
    the proxy's pool gauge names the pools."""
    state = {"pools": {"alpha": {"aliases": []}, "beta": {"aliases": ["b-alias"]}}}
    assert pool_in_state(state, "beta") == "beta"
    assert pool_in_state(state, "b-alias") == "beta"
    assert pool_in_state(state, "gamma") is None
    metrics = (
        "# TYPE admission_model_queue_depth gauge\n"
        'admission_model_queue_depth{model="beta"} 0.0\n'
        'admission_model_queue_depth{model="alpha"} 2.0\n'
    )
    assert pool_labels(metrics) == ["alpha", "beta"]


async def test_phases_with_model_loads_only_that_pool(
    start_proxy: Start, two_pools: dict[str, SimServer], tmp_path: Path
) -> None:
    """A phases run aimed at ``alpha``: alpha's replica gets the load, beta's none, and the
    report names alpha."""
    config = make_config([], **pool_config(two_pools))
    proxy = await start_proxy(config, access_log=False)
    before = {name: submitted(sim) for name, sim in two_pools.items()}
    doc = phases_workload(
        phases=[
            {"name": "baseline", "duration_s": 0.5, "rate_per_s": 10},
            {"name": "burst", "duration_s": 0.5, "rate_per_s": 40},
        ]
    )
    plan = PhasesPlan(url=proxy.url, workload=workload_from_mapping(doc), model="alpha")
    result = await run_phases(plan)
    assert result.model == "alpha"
    answered = [r for r in result.results if r.status == 200]
    assert answered
    assert submitted(two_pools["alpha"]) - before["alpha"] >= len(answered)
    assert submitted(two_pools["beta"]) == before["beta"]
    write_phases_report(result, tmp_path)
    assert json.loads((tmp_path / "report.json").read_text())["model"] == "alpha"


def test_parse_metrics_reads_one_pools_queue() -> None:
    """With a model named, the queue depth is that pool's, not every tenant's."""
    text = (
        'admission_queue_depth{tenant="a",priority="standard"} 5\n'
        'admission_model_queue_depth{model="alpha"} 3\n'
        'admission_model_queue_depth{model="beta"} 2\n'
    )
    assert parse_metrics(text, 0.0).total_depth == 5
    assert parse_metrics(text, 0.0, "beta").total_depth == 2
    assert parse_metrics(text, 0.0, "gamma").total_depth == 5  # no such pool: the whole queue


def test_cli_phases_model_flag_reaches_the_named_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`loadtest phases --model NAME` overrides the workload's model: the report names it,
    and the command prints the capacity table."""
    doc = phases_workload(
        phases=[{"name": "baseline", "duration_s": 0.5, "rate_per_s": 10}], slo={}
    )
    for tenant in doc["tenants"].values():
        tenant.pop("slo", None)
    workload = tmp_path / "workload.json"
    workload.write_text(json.dumps(doc))
    with sim_in_thread(replace(FAST, model_name="gamma")) as url:
        argv = ["loadtest", "phases", "--url", url, "--workload", str(workload), "--quiet"]
        status = main([*argv, "--model", "named-by-flag", "--out", str(tmp_path / "out")])
    assert status == 0
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["model"] == "named-by-flag"
    assert "capacity" in report
    assert "stable load:" in capsys.readouterr().out
