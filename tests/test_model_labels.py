"""Model names as metric labels under adapter churn: bounded, and never stuck at ``other``.

A fleet that loads and unloads LoRA adapters sees many model names in a
proxy's life. The labels stay at most ``telemetry.max_tenant_labels`` at once;
a model no replica serves any more gives its name (and its series) up to a
new one, so the new model is counted under its own name, not ``other``.
"""

from __future__ import annotations

from proxy.telemetry.metrics import ModelLabels
from tests.helpers import samples_by_label, wait_for
from tests.test_model_pools import (
    AUTH_A,
    COMPLETIONS,
    ServerFactory,
    Start,
    pooled_config,
    start_replica,
)


def test_a_model_no_longer_served_gives_its_name_up_oldest_first() -> None:
    served = {"base", "lora-1", "lora-2"}
    forgotten: list[str] = []
    labels = ModelLabels(3, served=lambda: served, forget=forgotten.append)
    assert [labels(m) for m in ("base", "lora-1", "lora-2")] == ["base", "lora-1", "lora-2"]
    served |= {"lora-3"}
    assert labels("lora-3") == "other"  # every name is held by a model still served
    assert forgotten == []
    served -= {"lora-1", "lora-2"}
    labels("lora-2")  # used again: lora-1 is now the oldest use
    assert labels("lora-3") == "lora-3"
    assert forgotten == ["lora-1"]
    assert labels("lora-2") == "lora-2"  # still named: a request in flight ends under it
    served -= {"base"}
    served |= {"lora-4"}
    assert labels("lora-4") == "lora-4"
    assert forgotten == ["lora-1", "base"]


def test_a_lowered_cap_frees_enough_names_for_the_next_model() -> None:
    """A reload lowers the cap below the names held: the next new model frees the
    surplus plus one, when that many are no longer served."""
    forgotten: list[str] = []
    labels = ModelLabels(4, served=lambda: {"a", "e"}, forget=forgotten.append)
    for model in "abcd":
        labels(model)
    labels.max_labels = 2
    assert labels("e") == "e"
    assert forgotten == ["b", "c", "d"]


def test_a_lowered_cap_gives_up_the_names_no_longer_served_even_too_few_for_a_new_one() -> None:
    """Cap 4 lowered to 2 with four names, two of them still served: the next new
    model is other (two names left, the cap), and the two no longer served give their
    names and series up (they held them past the cap until two more models went)."""
    forgotten: list[str] = []
    labels = ModelLabels(4, served=lambda: {"a", "b", "e"}, forget=forgotten.append)
    for model in "abcd":
        labels(model)
    labels.max_labels = 2
    assert labels("e") == "other"
    assert forgotten == ["c", "d"]
    assert labels("c") == "other"  # a model gone comes back: the names are all served


async def test_adapters_churning_through_discovery_keep_their_own_names(
    aiohttp_server: ServerFactory, start_proxy: Start
) -> None:
    """max_tenant_labels 2; r0 serves base and lists one adapter at a time (discovered).
    Each adapter, once the one before it is unloaded, is counted under its own name in
    admission_model_requests_total; the unloaded ones' series are gone, so the scrape
    holds at most two model names."""
    url0, replica = await start_replica(aiohttp_server, ["base", "lora-0"])
    url1, _ = await start_replica(aiohttp_server, ["other-model"])
    config = pooled_config(
        [url0, url1], [None, None], health={"interval_ms": 50}, telemetry={"max_tenant_labels": 2}
    )
    proxy = await start_proxy(config)
    table = proxy.runtime.models
    for i in range(4):
        adapter = f"lora-{i}"
        replica.models = ["base", adapter]
        await wait_for(lambda adapter=adapter: table.pool(adapter) == {"r0"})  # type: ignore[misc]
        for model in (adapter, "base"):
            answer = await proxy.client.post(
                COMPLETIONS, json={"model": model, "prompt": "x"}, headers=AUTH_A
            )
            assert answer.status == 200
        text = await (await proxy.client.get("/metrics")).text()
        counted = samples_by_label(text, "admission_model_requests_total", "model")
        assert counted == {adapter: 1.0, "base": float(i + 1)}, counted
    proxy.assert_idle()
