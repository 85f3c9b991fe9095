"""Control plane and accounting: admin API, hot reload, the metrics' exact counts."""

from __future__ import annotations

import asyncio
import io
import json
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from aiohttp.test_utils import make_mocked_request
from prometheus_client.parser import text_string_to_metric_families

from proxy.admin import _authorized
from tests.conftest import ProxyUnderTest
from tests.helpers import KEY_A, KEY_B, make_config, wait_for

Start = Callable[..., Awaitable[ProxyUnderTest]]
CHAT = "/v1/chat/completions"
AUTH = {"Authorization": f"Bearer {KEY_A}"}


def samples(text: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    out: dict[tuple[tuple[str, str], ...], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                out[tuple(sorted(sample.labels.items()))] = sample.value
    return out


async def test_admin_needs_the_token_when_one_is_set(
    start_proxy: Start, upstream_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ADMISSION_ADMIN_TOKEN set, /admin/* refuses without it and works with it;
    /admin/config never shows an API key."""
    monkeypatch.setenv("ADMISSION_ADMIN_TOKEN", "s3cret")
    proxy = await start_proxy(make_config([upstream_url]))
    assert (await proxy.client.get("/admin/state")).status == 401
    bad = {"Authorization": "Bearer nope"}
    assert (await proxy.client.get("/admin/state", headers=bad)).status == 401
    good = {"Authorization": "Bearer s3cret"}
    state = await (await proxy.client.get("/admin/state", headers=good)).json()
    assert set(state["tenants"]) == {"a", "b"} and "r0" in state["replicas"]
    assert "retry_budget" in state
    text = await (await proxy.client.get("/admin/config", headers=good)).text()
    assert KEY_A not in text and KEY_B not in text
    assert yaml.safe_load(text)["tenants"]["a"]["api_keys"] == ["***"]


def test_admin_without_a_token_answers_loopback_only() -> None:
    """Token unset: loopback peers pass, any other address is refused."""

    class FakeRuntime:
        class rules:  # noqa: N801 - mimics the attribute path
            class config:  # noqa: N801
                class admin:  # noqa: N801
                    token_env = "ADMISSION_TEST_UNSET_TOKEN"

    for peer, allowed in ((("127.0.0.1", 1), True), (("::1", 1), True), (("10.1.2.3", 1), False)):
        transport = type("T", (), {"get_extra_info": lambda self, name, p=peer: p})()
        request = make_mocked_request("GET", "/admin/state", transport=transport)
        assert _authorized(request, FakeRuntime()) is allowed  # type: ignore[arg-type]


async def test_drain_and_undrain_a_replica(start_proxy: Start, upstream_url: str) -> None:
    """A drained replica gets no new work (here: 503 no_healthy_replica); undrained, it serves."""
    proxy = await start_proxy(make_config([upstream_url]))
    resp = await proxy.client.post("/admin/replicas/r0/drain")
    assert (await resp.json())["draining"] is True
    refused = await proxy.client.post(CHAT, json={}, headers=AUTH)
    assert refused.headers["X-Admission-Reason"] == "no_healthy_replica"
    await proxy.client.post("/admin/replicas/r0/undrain")
    assert (await proxy.client.post(CHAT, json={}, headers=AUTH)).status == 200
    assert (await proxy.client.post("/admin/replicas/nope/drain")).status == 404


def _write(path: Path, config: dict[str, Any]) -> None:
    path.write_text(yaml.safe_dump(config))


def _document(upstream_url: str, weight: float, extra_tenant: bool = False) -> dict[str, Any]:
    tenants: dict[str, Any] = {
        "a": {"api_keys": [KEY_A], "weight": weight, "queue_capacity": 64},
    }
    if extra_tenant:
        tenants["c"] = {"api_keys": ["sk-new"], "priority": "batch"}
    return {"replicas": [{"name": "r0", "url": upstream_url, "max_concurrency": 4}],
            "tenants": tenants}  # fmt: skip


async def test_reload_under_load_loses_nothing(
    start_proxy: Start, upstream_url: str, tmp_path: Path
) -> None:
    """Steady load while the config changes: every request gets exactly one answer, a
    valid file's weights and tenants apply, an invalid file changes nothing."""
    path = tmp_path / "proxy.yaml"
    _write(path, _document(upstream_url, weight=1))
    from proxy.settings import load_config

    proxy = await start_proxy(load_config(path), config_path=str(path))
    statuses: list[int] = []
    stop = asyncio.Event()

    async def load() -> None:
        while not stop.is_set():
            resp = await proxy.client.post(CHAT, json={"hang_ms": 5}, headers=AUTH)
            await resp.read()
            statuses.append(resp.status)

    workers = [asyncio.ensure_future(load()) for _ in range(8)]
    await wait_for(lambda: len(statuses) > 20)
    _write(path, _document(upstream_url, weight=5, extra_tenant=True))
    assert (await (await proxy.client.post("/admin/reload")).json())["result"] == "ok"
    assert proxy.runtime.rules.config.tenants["a"].weight == 5
    resp = await proxy.client.post(CHAT, json={}, headers={"Authorization": "Bearer sk-new"})
    assert resp.status == 200
    before = proxy.runtime.rules
    path.write_text("replicas: []\ntenants: {a: {weight: -1}}\n")
    resp = await proxy.client.post("/admin/reload")
    assert resp.status == 422
    paths = {e["path"] for e in (await resp.json())["errors"]}
    assert {"replicas", "tenants.a.weight"} <= paths
    assert proxy.runtime.rules is before
    await wait_for(lambda: len(statuses) > 60)
    stop.set()
    await asyncio.gather(*workers)
    assert set(statuses) == {200}
    metrics = await (await proxy.client.get("/metrics")).text()
    reloads = samples(metrics, "admission_config_reloads_total")
    assert reloads[(("result", "ok"),)] == 1 and reloads[(("result", "invalid"),)] == 1
    proxy.assert_idle()


async def test_file_change_is_picked_up_without_a_signal(
    start_proxy: Start, upstream_url: str, tmp_path: Path
) -> None:
    """The watcher reloads when the file's content changes (ConfigMap symlink swaps)."""
    from proxy.settings import load_config

    path = tmp_path / "proxy.yaml"
    _write(path, _document(upstream_url, weight=1))
    proxy = await start_proxy(load_config(path), config_path=str(path))
    _write(path, _document(upstream_url, weight=1, extra_tenant=True))
    await wait_for(lambda: "c" in proxy.runtime.rules.config.tenants, timeout_s=8)


async def test_removed_replica_drains_and_a_new_one_warms_first(
    start_proxy: Start, upstream_url: str, tmp_path: Path
) -> None:
    """Reload replacing r0 with r1: r0 leaves the pool, r1 serves after probe and warm-up."""
    from proxy.settings import load_config

    path = tmp_path / "proxy.yaml"
    _write(path, _document(upstream_url, weight=1))
    config = load_config(path)
    proxy = await start_proxy(config.model_copy(update={"health": config.health.model_copy(
        update={"interval_ms": 50})}), config_path=str(path))  # fmt: skip
    document = _document(upstream_url, weight=1)
    document["replicas"] = [{"name": "r1", "url": upstream_url, "max_concurrency": 2}]
    document["health"] = {"interval_ms": 50}
    _write(path, document)
    assert (await (await proxy.client.post("/admin/reload")).json())["result"] == "ok"
    assert proxy.runtime.pool.get("r0") is None
    r1 = proxy.runtime.pool.get("r1")
    assert r1 is not None
    await wait_for(lambda: r1.serving and not r1.ejected)
    assert (await proxy.client.post(CHAT, json={}, headers=AUTH)).status == 200


async def test_requests_total_counts_every_request_once_with_its_reason(
    start_proxy: Start, upstream_url: str
) -> None:
    """A mixed run (served, each kind of refusal, timed out, cancelled): the counter
    sums to exactly the requests sent and matches each reason seen by the client."""
    tenants = {
        "a": {"api_keys": [KEY_A], "queue_capacity": 1, "budgets": {"queue_ms": 300},
              "allowed_priorities": ["standard"]},
        "b": {"api_keys": [KEY_B], "rate_per_s": 0.1, "burst": 1},
    }  # fmt: skip
    config = make_config(
        [upstream_url], seats=1, tenants=tenants, server={"max_body_bytes": 1000},
        budgets={"first_byte_ms": 200},
    )  # fmt: skip
    log = io.StringIO()
    proxy = await start_proxy(config, access_log=log)
    seen: Counter[str] = Counter()

    async def call(headers: dict[str, str], **kwargs: Any) -> None:
        resp = await proxy.client.post(CHAT, headers=headers, **kwargs)
        await resp.read()
        seen[resp.headers.get("X-Admission-Reason", "none")] += 1

    await call(AUTH, json={})  # served
    await call({}, json={})  # unauthenticated
    await call({**AUTH, "X-Priority": "nope"}, json={})  # bad_request
    await call({**AUTH, "X-Priority": "batch"}, json={})  # priority_not_allowed
    await call(AUTH, data=b"x" * 2000)  # body_too_large
    await call({"Authorization": f"Bearer {KEY_B}"}, json={})  # served (the bucket's token)
    await call({"Authorization": f"Bearer {KEY_B}"}, json={})  # rate_limited
    await call(AUTH, json={"stream": True, "hang_ms": 1000})  # first_byte_timeout
    # one holds the seat, one queues then times out, one finds the queue full
    holder = asyncio.ensure_future(call(AUTH, json={"hang_ms": 800}))
    await wait_for(lambda: proxy.runtime.pool.total_inflight() == 1)
    queued = asyncio.ensure_future(call(AUTH, json={}))
    await wait_for(lambda: len(proxy.runtime.dispatcher.scheduler) == 1)
    await call(AUTH, json={})  # tenant_queue_full
    await queued  # queue_timeout
    # a client that leaves while waiting for its answer
    await holder
    leaving = asyncio.ensure_future(proxy.client.post(CHAT, json={"hang_ms": 2000}, headers=AUTH))
    await wait_for(lambda: proxy.runtime.pool.total_inflight() == 1)
    leaving.cancel()
    seen["client_disconnected"] += 1
    await wait_for(lambda: not proxy.runtime.active)
    sent = sum(seen.values())
    metrics = await (await proxy.client.get("/metrics")).text()
    counted = samples(metrics, "admission_requests_total")
    assert sum(counted.values()) == sent == 12
    by_reason: Counter[str] = Counter()
    for labels, value in counted.items():
        by_reason[dict(labels)["reason"]] += int(value)
    assert by_reason == seen
    outcomes = {dict(labels)["reason"]: dict(labels)["outcome"] for labels in counted}
    assert outcomes["none"] == "completed"
    assert outcomes["queue_timeout"] == outcomes["first_byte_timeout"] == "timed_out"
    assert outcomes["client_disconnected"] == "cancelled"
    assert outcomes["tenant_queue_full"] == outcomes["unauthenticated"] == "rejected"
    unknown = [dict(labels) for labels in counted if dict(labels)["reason"] == "unauthenticated"]
    assert unknown[0]["tenant"] == "unknown"
    lines = [json.loads(text) for text in log.getvalue().splitlines()]
    assert len(lines) == sent
    cancelled = [line for line in lines if line["outcome"] == "cancelled"]
    assert cancelled[0]["status"] == 499 and cancelled[0]["reason"] == "client_disconnected"
    timed_out = [line for line in lines if line["reason"] == "queue_timeout"]
    assert timed_out[0]["status"] == 503 and timed_out[0]["queue_ms"] >= 300
    rejected = [line for line in lines if line["reason"] == "rate_limited"]
    assert rejected[0]["tenant"] == "b" and rejected[0]["status"] == 429
    served = [line for line in lines if line["outcome"] == "completed"]
    assert all(line["replica"] == "r0" and line["attempts"] == 1 for line in served)
    timeouts = samples(metrics, "admission_timeouts_total")
    assert timeouts[(("layer", "queue"),)] == 1 and timeouts[(("layer", "first_byte"),)] == 1
