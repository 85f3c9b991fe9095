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
from structlog.testing import capture_logs

from proxy.admin import _authorized
from proxy.settings import load_config
from proxy.telemetry.gpu import FakeGpuProbe, GpuReading
from proxy.telemetry.metrics import TenantLabels
from tests.conftest import ProxyUnderTest
from tests.helpers import KEY_A, KEY_B, SteadyLoad, handshake_never_completes, make_config, wait_for

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
    proxy = await start_proxy(load_config(path), config_path=str(path))

    async def chat() -> int:
        resp = await proxy.client.post(CHAT, json={"hang_ms": 5}, headers=AUTH)
        await resp.read()
        return resp.status

    async with SteadyLoad(chat, clients=8) as load:
        await wait_for(lambda: len(load.statuses) > 20)
        _write(path, _document(upstream_url, weight=5, extra_tenant=True))
        assert (await (await proxy.client.post("/admin/reload")).json())["result"] == "ok"
        state = await (await proxy.client.get("/admin/state")).json()
        assert state["tenants"]["a"]["weight"] == 5
        resp = await proxy.client.post(CHAT, json={}, headers={"Authorization": "Bearer sk-new"})
        assert resp.status == 200
        before = proxy.runtime.rules
        path.write_text("replicas: []\ntenants: {a: {weight: -1}}\n")
        resp = await proxy.client.post("/admin/reload")
        assert resp.status == 422
        paths = {e["path"] for e in (await resp.json())["errors"]}
        assert {"replicas", "tenants.a.weight"} <= paths
        assert proxy.runtime.rules is before
        await wait_for(lambda: len(load.statuses) > 60)
        await load.stop()
    statuses = load.statuses
    assert set(statuses) == {200}
    metrics = await (await proxy.client.get("/metrics")).text()
    reloads = samples(metrics, "admission_config_reloads_total")
    assert reloads[(("result", "ok"),)] == 1 and reloads[(("result", "invalid"),)] == 1
    proxy.assert_idle()


async def test_file_change_is_picked_up_without_a_signal(
    start_proxy: Start, upstream_url: str, tmp_path: Path
) -> None:
    """The watcher reloads when the file's content changes (ConfigMap symlink swaps):
    a tenant added to the file is served without a signal, and the reload is counted."""
    path = tmp_path / "proxy.yaml"
    _write(path, _document(upstream_url, weight=1))
    proxy = await start_proxy(load_config(path), config_path=str(path))
    new_key = {"Authorization": "Bearer sk-new"}
    assert (await proxy.client.post(CHAT, json={}, headers=new_key)).status == 401
    _write(path, _document(upstream_url, weight=1, extra_tenant=True))
    statuses: list[int] = []

    async def new_tenant_served() -> bool:
        resp = await proxy.client.post(CHAT, json={}, headers=new_key)
        await resp.read()
        statuses.append(resp.status)
        return resp.status == 200

    async with asyncio.timeout(8):
        while not await new_tenant_served():
            await asyncio.sleep(0.05)
    assert set(statuses[:-1]) <= {401}
    metrics = await (await proxy.client.get("/metrics")).text()
    assert samples(metrics, "admission_config_reloads_total")[(("result", "ok"),)] == 1


async def test_removed_replica_drains_and_a_new_one_warms_first(
    start_proxy: Start, upstream_url: str, tmp_path: Path
) -> None:
    """Reload replacing r0 with r1: r0 leaves the pool, r1 serves after probe and warm-up."""
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


async def _reload(proxy: ProxyUnderTest, path: Path, document: dict[str, Any]) -> None:
    _write(path, document)
    resp = await proxy.client.post("/admin/reload")
    assert (await resp.json())["result"] == "ok", await resp.text()


def _tenants(*names: str) -> dict[str, Any]:
    return {name: {"api_keys": [f"sk-{name}"]} for name in names}


async def _served_as(proxy: ProxyUnderTest, tenant: str) -> str:
    """Send one request as ``tenant``; the ``tenant`` label it was counted under."""
    before = samples(await (await proxy.client.get("/metrics")).text(), "admission_requests_total")
    resp = await proxy.client.post(CHAT, json={}, headers={"Authorization": f"Bearer sk-{tenant}"})
    assert resp.status == 200
    after = samples(await (await proxy.client.get("/metrics")).text(), "admission_requests_total")
    grown = [dict(k)["tenant"] for k, v in after.items() if v > before.get(k, 0.0)]
    assert len(grown) == 1, grown
    return grown[0]


async def test_reload_labels_a_new_tenant_within_the_new_cap(
    start_proxy: Start, upstream_url: str, tmp_path: Path
) -> None:
    """A tenant added by reload gets its own metric label at once when the cap has room;
    with the cap full it folds into "other"; raising the cap by reload labels it."""
    path = tmp_path / "proxy.yaml"
    replicas = [{"name": "r0", "url": upstream_url, "max_concurrency": 4}]
    document = {"replicas": replicas, "tenants": _tenants("a", "b"),
                "telemetry": {"max_tenant_labels": 3}}  # fmt: skip
    _write(path, document)
    proxy = await start_proxy(load_config(path), config_path=str(path))
    assert await _served_as(proxy, "b") == "b"
    await _reload(proxy, path, {**document, "tenants": _tenants("a", "b", "c")})
    assert await _served_as(proxy, "c") == "c"
    await _reload(proxy, path, {**document, "tenants": _tenants("a", "b", "c", "d")})
    assert await _served_as(proxy, "d") == "other"
    await _reload(proxy, path, {**document, "tenants": _tenants("a", "b", "c", "d"),
                                "telemetry": {"max_tenant_labels": 4}})  # fmt: skip
    assert await _served_as(proxy, "d") == "d"
    assert [await _served_as(proxy, t) for t in ("a", "b", "c")] == ["a", "b", "c"]


@pytest.mark.parametrize(
    ("before", "reloads", "labelled", "folded"),
    [
        # existing labels keep theirs; a newcomer takes a free place, in file order
        (("a", "b"), [(("a", "b", "c", "d"), 3)], {"a", "b", "c"}, {"d"}),
        # a newcomer listed first still comes after those already labelled
        (("a", "b"), [(("c", "a", "b"), 2)], {"a", "b"}, {"c"}),
        # a lower cap keeps the first labelled ones in file order
        (("a", "b", "c"), [(("a", "b", "c"), 1)], {"a"}, {"b", "c"}),
        # a removed tenant with requests still running (b, below) keeps its label
        # (they still end) but frees its place for a newcomer
        (("a", "b"), [(("a", "c"), 2)], {"a", "b", "c"}, {"d"}),
        # ...until it comes back: then it counts again, behind the cap
        (("a", "b"), [(("a", "c"), 2), (("a", "c", "b"), 2)], {"a", "c"}, {"b"}),
    ],
)
def test_tenant_labels_after_reload(
    before: tuple[str, ...],
    reloads: list[tuple[tuple[str, ...], int]],
    labelled: set[str],
    folded: set[str],
) -> None:
    """Which tenants have their own label after reloads (table: tenants in, labels out);
    tenant b has requests in the proxy at each reload."""
    labels = TenantLabels(before, len(before))
    for tenants, cap in reloads:
        labels.reconfigure(tenants, cap, busy={"b"})
    assert {t for t in labelled | folded if labels(t) == t} == labelled
    assert {labels(t) for t in folded} == {"other"}
    assert labels("unknown") == "unknown"


def test_a_removed_tenant_is_forgotten_once_it_has_no_request() -> None:
    """Removed while busy, b keeps its label; at the next reload, idle, it is forgotten
    (returned, for its series to be dropped) and counts under "other"."""
    labels = TenantLabels(("a", "b"), 2)
    assert labels.reconfigure(("a", "c"), 2, busy={"b"}) == frozenset()
    assert labels("b") == "b"
    assert labels.reconfigure(("a", "c", "d"), 2) == {"b"}
    assert (labels("a"), labels("b"), labels("c"), labels("d")) == ("a", "other", "c", "other")


async def test_reload_applies_the_connect_timeout(start_proxy: Start, tmp_path: Path) -> None:
    """A replica whose handshake never completes: after a reload lowers connect_ms from
    60 s to 200 ms, a new request fails with 504 connect_timeout, not its total budget."""
    with handshake_never_completes() as port:
        path = tmp_path / "proxy.yaml"
        document: dict[str, Any] = {
            "replicas": [{"name": "r0", "url": f"http://127.0.0.1:{port}", "max_concurrency": 4}],
            "tenants": {"a": {"api_keys": [KEY_A]}},
            "warmup": {"requests": 0},
            "budgets": {"queue_ms": 1000, "first_byte_ms": 2000, "total_ms": 3000},
            "retry": {"max_attempts": 1},
            "timeouts": {"connect_ms": 60_000},
        }
        _write(path, document)
        proxy = await start_proxy(load_config(path), config_path=str(path))
        await _reload(proxy, path, {**document, "timeouts": {"connect_ms": 200}})
        resp = await proxy.client.post(CHAT, json={}, headers=AUTH)
        assert resp.status == 504
        assert resp.headers["X-Admission-Reason"] == "connect_timeout"
        proxy.assert_idle()


class CountingProbe(FakeGpuProbe):
    """A fake GPU that counts how often it was read."""

    def __init__(self) -> None:
        super().__init__([GpuReading(0, 0.5, 50, 100)])
        self.samples = 0

    def sample(self) -> list[GpuReading]:
        self.samples += 1
        return super().sample()


async def test_reload_applies_the_gpu_sample_interval(
    start_proxy: Start, upstream_url: str, tmp_path: Path
) -> None:
    """Sampling every 10 minutes, then a reload to every 20 ms: the sampler does not
    finish its long wait first, it samples again at once and keeps the new pace."""
    path = tmp_path / "proxy.yaml"
    document = {**_document(upstream_url, weight=1), "gpu": {"sample_ms": 600_000}}
    _write(path, document)
    probe = CountingProbe()
    proxy = await start_proxy(load_config(path), config_path=str(path), gpu=probe)
    await wait_for(lambda: probe.samples == 1)
    await _reload(proxy, path, {**document, "gpu": {"sample_ms": 20}})
    await wait_for(lambda: probe.samples >= 5)


async def test_reload_applies_the_body_limit(
    start_proxy: Start, upstream_url: str, tmp_path: Path
) -> None:
    """server.max_body_bytes raised by reload: a body refused with 413 before is served."""
    path = tmp_path / "proxy.yaml"
    document = {**_document(upstream_url, weight=1), "server": {"max_body_bytes": 1000}}
    _write(path, document)
    proxy = await start_proxy(load_config(path), config_path=str(path))
    body = json.dumps({"pad": "x" * 3000})
    refused = await proxy.client.post(CHAT, data=body, headers=AUTH)
    assert refused.status == 413
    await _reload(proxy, path, {**document, "server": {"max_body_bytes": 10_000}})
    assert (await proxy.client.post(CHAT, data=body, headers=AUTH)).status == 200


async def test_reload_applies_everything_but_the_listener(
    start_proxy: Start, upstream_url: str, tmp_path: Path
) -> None:
    """A reload changing server.host/port and the other server keys: the listener's two
    are logged as needing a restart and stay as they run; the others apply."""
    path = tmp_path / "proxy.yaml"
    document = _document(upstream_url, weight=1)
    _write(path, document)
    proxy = await start_proxy(load_config(path), config_path=str(path))
    server = {"host": "127.0.0.2", "port": 9999, "shutdown_grace_ms": 1234, "entrance_ms": 777}
    with capture_logs() as logs:
        await _reload(proxy, path, {**document, "server": server})
    restart = {e["key"]: (e["running"], e["configured"]) for e in logs if "key" in e}
    assert restart == {"server.host": ("0.0.0.0", "127.0.0.2"), "server.port": (8080, 9999)}
    running = yaml.safe_load(await (await proxy.client.get("/admin/config")).text())["server"]
    assert (running["host"], running["port"]) == ("0.0.0.0", 8080)
    assert (running["shutdown_grace_ms"], running["entrance_ms"]) == (1234, 777)


async def test_a_removed_tenants_queued_request_keeps_its_rules(
    start_proxy: Start, upstream_url: str, tmp_path: Path
) -> None:
    """Tenant c (class bulk, queue budget 5 s) waits behind a held seat while a reload
    removes c, its class and its budget (the global queue budget is 100 ms): its request
    is still served, in its class, and counted under its own label."""
    path = tmp_path / "proxy.yaml"
    tenants = {
        "a": {"api_keys": [KEY_A]},
        "c": {"api_keys": ["sk-c"], "priority": "bulk", "budgets": {"queue_ms": 5000}},
    }
    document: dict[str, Any] = {
        "replicas": [{"name": "r0", "url": upstream_url, "max_concurrency": 1}],
        "tenants": tenants,
        "priorities": {"standard": {"weight": 1}, "bulk": {"weight": 1}},
        "budgets": {"queue_ms": 100},
    }
    _write(path, document)
    log = io.StringIO()
    proxy = await start_proxy(load_config(path), config_path=str(path), access_log=log)
    holder = asyncio.ensure_future(proxy.client.post(CHAT, json={"hang_ms": 1000}, headers=AUTH))
    await wait_for(lambda: proxy.runtime.pool.total_inflight() == 1)
    queued = asyncio.ensure_future(
        proxy.client.post(CHAT, json={}, headers={"Authorization": "Bearer sk-c"})
    )
    await wait_for(lambda: len(proxy.runtime.dispatcher.scheduler) == 1)
    await _reload(proxy, path, {**document, "tenants": {"a": tenants["a"]},
                                "priorities": {"standard": {"weight": 1}}})  # fmt: skip
    assert (await holder).status == 200
    served = await queued
    assert served.status == 200, await served.text()
    gone = await proxy.client.post(CHAT, json={}, headers={"Authorization": "Bearer sk-c"})
    assert gone.status == 401  # a new request meets the new rules
    await wait_for(lambda: not proxy.runtime.active)
    lines = [json.loads(text) for text in log.getvalue().splitlines()]
    line = next(x for x in lines if x["tenant"] == "c" and x["status"] == 200)
    assert line["priority"] == "bulk" and line["queue_ms"] >= 100
    metrics = await (await proxy.client.get("/metrics")).text()
    counted = samples(metrics, "admission_requests_total")
    key = (("outcome", "completed"), ("priority", "bulk"), ("reason", "none"), ("tenant", "c"))
    assert counted[key] == 1
    proxy.assert_idle()


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
    await proxy.wait_idle()  # its seat stays taken for the cancel grace
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
