"""What the fleet controls stays bounded: models and replicas that come and go.

A vLLM fleet lists each LoRA adapter as a model, and adapters are loaded and
unloaded under their own names for weeks; an autoscaled fleet is reloaded with
replicas added and removed. Whatever the proxy keeps per model pool or per
replica must follow the fleet of now, not every name it ever saw. End to end
through the real proxy against the small replicas of ``test_model_pools``,
which list their models on ``GET /v1/models``.
"""

from __future__ import annotations

from functools import partial

from prometheus_client.parser import text_string_to_metric_families

from proxy.reload import apply_config
from proxy.runtime import Runtime
from proxy.settings import Config
from proxy.sim import SimConfig, start_sim
from tests.helpers import make_config, wait_for
from tests.test_model_pools import (
    AUTH_A,
    COMPLETIONS,
    ServerFactory,
    Start,
    pooled_config,
    start_replica,
)

#: Distinct adapters loaded one after another: enough that a per-name leak shows.
ADAPTERS = 300
#: Probes far apart: the test is discovery's only caller after start (``fleet_changed``
#: below is the prober's hook, called as the prober calls it).
QUIET_HEALTH = {"interval_ms": 600_000}
CHAT = "/v1/chat/completions"
CHAT_BODY = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def scraped(runtime: Runtime, name: str) -> bool:
    return runtime.health.engine_reading(name) is not None


def _series(metrics: str, family: str) -> list[dict[str, str]]:
    return [
        dict(sample.labels)
        for fam in text_string_to_metric_families(metrics)
        if fam.name == family
        for sample in fam.samples
    ]


async def test_adapters_that_come_and_go_leave_no_pool_state(
    aiohttp_server: ServerFactory, start_proxy: Start
) -> None:
    """r0 discovers ``base`` plus one adapter at a time, each served one request, then
    unloaded for the next: the dispatcher keeps pools (queue, usage, turns, seat times)
    for the models served now only, and ``admission_model_queue_depth`` has a series
    for those only. Nothing is left in flight or queued."""
    url0, adapters = await start_replica(aiohttp_server, ["base"])
    url1, _ = await start_replica(aiohttp_server, ["other"])
    config = pooled_config([url0, url1], [None, ["other"]], health=QUIET_HEALTH)
    proxy = await start_proxy(config)
    table, dispatcher = proxy.runtime.models, proxy.runtime.dispatcher
    assert table.pool("base") == {"r0"}
    for i in range(ADAPTERS):
        name = f"lora-{i}"
        adapters.models = ["base", name]
        assert table.update("r0", frozenset(adapters.models))  # what discovery does
        dispatcher.fleet_changed()
        resp = await proxy.client.post(
            COMPLETIONS, json={"model": name, "prompt": "x"}, headers=AUTH_A
        )
        assert resp.status == 200, await resp.text()
    served = table.served_models()
    assert served == {"base", "other", f"lora-{ADAPTERS - 1}"}
    assert dispatcher.pool_models() <= served
    assert set(dispatcher.scheduler.depth_by_model()) <= served
    assert dispatcher.waits.seat_time_of("lora-0").count == 0
    metrics = await (await proxy.client.get("/metrics")).text()
    depth = {s["model"] for s in _series(metrics, "admission_model_queue_depth")}
    assert depth == served
    proxy.assert_idle()


async def test_reload_churn_of_replicas_leaves_no_per_replica_state(start_proxy: Start) -> None:
    """Thirty reloads, each replacing the second simulator replica by a new name with
    an engine metrics URL (scraped before the next reload): the pool, the engine
    readings and the replica gauges hold the two replicas of now only, and every
    request of the churn was served."""
    sims = [await start_sim(SimConfig(seed=i, decode_base_ms=1.0)) for i in range(2)]
    try:
        base = make_config([s.url for s in sims], health={"interval_ms": 20})

        def config(name: str) -> Config:
            second = base.replicas[1].model_copy(
                update={"name": name, "metrics_url": sims[1].url + "/metrics"}
            )
            return base.model_copy(update={"replicas": [base.replicas[0], second]})

        proxy = await start_proxy(config("gpu-0"))
        runtime = proxy.runtime
        for i in range(1, 31):
            await wait_for(partial(scraped, runtime, f"gpu-{i - 1}"))
            apply_config(runtime, config(f"gpu-{i}"))
            resp = await proxy.client.post(CHAT, json=CHAT_BODY, headers=AUTH_A)
            assert resp.status == 200, await resp.text()
        names = {r.name for r in runtime.pool.replicas}
        assert names == {"r0", "gpu-30"}
        assert runtime.health.reading_names() <= names
        metrics = await (await proxy.client.get("/metrics")).text()
        assert {s["replica"] for s in _series(metrics, "admission_replica_limit")} == names
        proxy.assert_idle()
    finally:
        for sim in sims:
            await sim.close()


async def test_reloads_that_rotate_static_models_leave_no_pool_state(
    aiohttp_server: ServerFactory, start_proxy: Start
) -> None:
    """Sixty reloads, each listing a new model on r0 (static ``models``) that then serves
    one request: the dispatcher keeps pools for the models of now only, and the model
    labels stay within ``telemetry.max_tenant_labels`` (the names of models no longer
    served are freed for new ones, their series dropped)."""
    url0, _ = await start_replica(aiohttp_server, ["base"])
    url1, _ = await start_replica(aiohttp_server, ["other"])

    def config(model: str) -> Config:
        return pooled_config(
            [url0, url1], [["base", model], ["other"]], health=QUIET_HEALTH,
            telemetry={"max_tenant_labels": 4},
        )  # fmt: skip

    proxy = await start_proxy(config("static-0"))
    runtime = proxy.runtime
    for i in range(60):
        name = f"static-{i}"
        apply_config(runtime, config(name))
        resp = await proxy.client.post(
            COMPLETIONS, json={"model": name, "prompt": "x"}, headers=AUTH_A
        )
        assert resp.status == 200, await resp.text()
    served = runtime.models.served_models()
    assert served == {"base", "other", "static-59"}
    assert runtime.dispatcher.pool_models() <= served
    metrics = await (await proxy.client.get("/metrics")).text()
    labels = {s["model"] for s in _series(metrics, "admission_model_requests")}
    assert len(labels) <= 4 and "static-59" in labels
    assert {s["model"] for s in _series(metrics, "admission_model_queue_depth")} == served
    proxy.assert_idle()
