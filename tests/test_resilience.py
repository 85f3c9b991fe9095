"""Upstream resilience end to end: retries, budget, health, saturation, GPU guard."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from proxy.sim import SimServer
from proxy.telemetry.gpu import FakeGpuProbe, GpuReading
from tests.conftest import ProxyUnderTest
from tests.helpers import KEY_A, make_config, running_sims, wait_for

Start = Callable[..., Awaitable[ProxyUnderTest]]
CHAT = "/v1/chat/completions"
AUTH = {"Authorization": f"Bearer {KEY_A}"}
QUICK_RETRY = {"base_backoff_ms": 5, "max_backoff_ms": 20}


@pytest.fixture
async def sims() -> AsyncIterator[list[SimServer]]:
    async with running_sims() as servers:
        yield servers


def body(**extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, **extra}


def upstream_requests(sims: list[SimServer]) -> int:
    """Inference requests the simulators received (injected errors included)."""
    return sum(s.state.requests_total for s in sims)


async def send(proxy: ProxyUnderTest, n: int, batch: int = 40, **extra: Any) -> list[int]:
    statuses: list[int] = []

    async def one() -> None:
        resp = await proxy.client.post(CHAT, json=body(**extra), headers=AUTH)
        await resp.read()
        statuses.append(resp.status)

    for start in range(0, n, batch):
        await asyncio.gather(*(one() for _ in range(min(batch, n - start))))
    return statuses


async def test_one_replica_failing_30_percent_is_masked(
    start_proxy: Start, sims: list[SimServer]
) -> None:
    """One of two replicas answers 503 to 30% of requests: at least 99% of clients
    succeed, with at most 1.25 upstream attempts per client request."""
    proxy = await start_proxy(make_config([s.url for s in sims], seats=8, retry=QUICK_RETRY))
    await sims[0].set_faults(error_rate=0.3, error_status=503)
    before = upstream_requests(sims)
    statuses = await send(proxy, 400)
    attempts = upstream_requests(sims) - before
    assert statuses.count(200) / 400 >= 0.99
    assert 400 < attempts <= 1.25 * 400
    assert sims[0].state.dice.errors_injected > 0
    proxy.assert_idle()


async def test_refusing_replica_is_ejected_and_returns_after_warmup(
    start_proxy: Start, sims: list[SimServer]
) -> None:
    """A replica refusing connections is ejected and traffic moves to the other; once
    it accepts again it is probed, warmed, and serves again."""
    config = make_config(
        [s.url for s in sims],
        seats=8,
        retry={**QUICK_RETRY, "max_attempts": 3},
        health={"interval_ms": 100, "eject_after_failures": 2, "eject_ms": 300},
    )
    proxy = await start_proxy(config)
    await sims[1].refuse_for(None)
    statuses = await send(proxy, 60, batch=10)
    assert statuses.count(200) == 60
    r1 = proxy.runtime.pool.get("r1")
    assert r1 is not None and r1.ejected
    served = sims[1].engine.stats().completed
    await sims[1].accept()
    await wait_for(lambda: not r1.ejected and r1.serving, timeout_s=10)
    assert sims[1].engine.stats().completed > served  # its warm-up ran before traffic
    await send(proxy, 40, batch=20)
    assert sims[1].engine.stats().completed > served + 1
    proxy.assert_idle()


async def test_all_replicas_down_answers_at_once(start_proxy: Start, sims: list[SimServer]) -> None:
    """Every replica ejected: 503 no_healthy_replica within milliseconds, not after timeouts."""
    proxy = await start_proxy(make_config([s.url for s in sims]))
    # Only a replica healthy once is ejected (one still starting is held for its next
    # probe), and a warm-up still running would make it serving after the ejection.
    await wait_for(lambda: all(r.serving for r in proxy.runtime.pool.replicas), timeout_s=10)
    for replica in proxy.runtime.pool.replicas:
        proxy.runtime.health._eject(replica)
    submitted = [s.engine.stats().submitted for s in sims]
    started = time.monotonic()
    resp = await proxy.client.post(CHAT, json=body(), headers=AUTH)
    elapsed = time.monotonic() - started
    assert resp.status == 503
    assert resp.headers["X-Admission-Reason"] == "no_healthy_replica"
    assert 1 <= int(resp.headers["Retry-After"]) <= 60
    # Answered without waiting out any layer: waiting for a replica would have taken the
    # queue budget (2 s), and trying one the first-byte budget (10 s).
    assert elapsed < proxy.runtime.rules.config.budgets.queue_ms / 1000.0
    assert [s.engine.stats().submitted for s in sims] == submitted
    assert (await proxy.client.get("/readyz")).status == 503


async def test_first_byte_timeout_is_not_retried_by_default(
    start_proxy: Start, sims: list[SimServer]
) -> None:
    """A hanging replica: 504 within the first-byte budget; one attempt only by default."""
    proxy = await start_proxy(make_config([sims[0].url], budgets={"first_byte_ms": 300}))
    await sims[0].set_faults(hang_before_first_byte_ms=-1)
    before = upstream_requests(sims)
    started = time.monotonic()
    resp = await proxy.client.post(CHAT, json=body(stream=True), headers=AUTH)
    assert resp.status == 504
    assert resp.headers["X-Admission-Reason"] == "first_byte_timeout"
    assert 0.3 <= time.monotonic() - started < 1.5
    assert upstream_requests(sims) - before == 1


async def test_first_byte_timeout_is_retried_when_configured(
    start_proxy: Start, sims: list[SimServer]
) -> None:
    """With first_byte_timeout in retry_on, the stream is retried on the healthy replica."""
    retry = {**QUICK_RETRY, "retry_on": ["first_byte_timeout", "connect_error"]}
    config = make_config([s.url for s in sims], budgets={"first_byte_ms": 300}, retry=retry)
    proxy = await start_proxy(config)
    await sims[0].set_faults(hang_before_first_byte_ms=-1)
    statuses = await send(proxy, 6, batch=3, stream=True)
    assert statuses == [200] * 6
    assert sims[0].state.requests_total > 1  # some went to the hanging replica first


async def test_upstream_429_retry_after_is_honoured_when_it_fits(
    start_proxy: Start, sims: list[SimServer]
) -> None:
    """429 with Retry-After: 2 is retried no sooner than 2 s when the deadline allows,
    and passed through at once when it does not."""
    retry = {**QUICK_RETRY, "retry_on": ["http_429"]}
    proxy = await start_proxy(make_config([sims[0].url], retry=retry))
    dice = sims[0].state.dice
    injected = dice.errors_injected
    await sims[0].set_faults(error_rate=1.0, error_status=429, error_retry_after_s=2)
    started = time.monotonic()
    waiting = asyncio.ensure_future(proxy.client.post(CHAT, json=body(), headers=AUTH))
    await wait_for(lambda: dice.errors_injected > injected)  # the first attempt got its 429
    await sims[0].set_faults(error_rate=0.0)
    resp = await waiting
    assert resp.status == 200
    assert time.monotonic() - started >= 2.0

    await sims[0].set_faults(error_rate=1.0, error_status=429, error_retry_after_s=2)
    started = time.monotonic()
    short = {**AUTH, "X-Request-Timeout-Ms": "1500"}
    resp = await proxy.client.post(CHAT, json=body(), headers=short)
    assert resp.status == 429
    assert resp.headers["X-Admission-Reason"] == "upstream_status"
    assert time.monotonic() - started < 1.0
    proxy.assert_idle()


async def test_retry_budget_refuses_a_retry_storm(
    start_proxy: Start, sims: list[SimServer]
) -> None:
    """Both replicas fail everything: retries stop at the budget, refused with 503
    retry_budget_exhausted, and attempts stay near one per request."""
    retry = {**QUICK_RETRY, "max_attempts": 3, "budget_ratio": 0.1, "min_retries_per_s": 0.5}
    proxy = await start_proxy(make_config([s.url for s in sims], seats=8, retry=retry))
    for sim in sims:
        await sim.set_faults(error_rate=1.0, error_status=503)
    before = upstream_requests(sims)
    statuses = await send(proxy, 200)
    attempts = upstream_requests(sims) - before
    assert statuses.count(503) == 200
    assert attempts <= 200 * 1.2
    assert proxy.runtime.telemetry.metrics.retry_budget_exhausted._value.get() > 0
    proxy.assert_idle()


async def test_saturated_replica_receives_nothing_until_it_recovers(
    start_proxy: Start, sims: list[SimServer]
) -> None:
    """Engine metrics over max_waiting hold a replica off; fresh metrics under it release it."""
    config = make_config(
        [sims[0].url],
        saturation={"max_waiting": 0, "stale_ms": 60000},
        health={"interval_ms": 100},
    )
    proxy = await start_proxy(config)
    health = proxy.runtime.health
    r0 = proxy.runtime.pool.replicas[0]
    health._readings["r0"] = health_reading(proxy, waiting=5)
    health.refresh_saturation()
    assert r0.saturated
    waiting = asyncio.ensure_future(proxy.client.post(CHAT, json=body(), headers=AUTH))
    await wait_for(lambda: len(proxy.runtime.dispatcher.scheduler) == 1)
    assert r0.inflight == 0
    health._readings["r0"] = health_reading(proxy, waiting=0)
    health.refresh_saturation()
    assert (await waiting).status == 200


async def test_stale_or_broken_metrics_never_block_dispatch(
    start_proxy: Start, sims: list[SimServer]
) -> None:
    """A saturated reading that goes stale, or a metrics URL that fails, blocks nothing."""
    config = make_config(
        [sims[0].url],
        saturation={"max_waiting": 0, "stale_ms": 200},
        health={"interval_ms": 50},
        replicas=[{"name": "r0", "url": sims[0].url, "max_concurrency": 4,
                   "metrics_url": sims[0].url + "/no-such-metrics"}],
    )  # fmt: skip
    proxy = await start_proxy(config)
    health = proxy.runtime.health
    health._readings["r0"] = health_reading(proxy, waiting=9)
    health.refresh_saturation()
    r0 = proxy.runtime.pool.replicas[0]
    assert r0.saturated
    await wait_for(lambda: not r0.saturated, timeout_s=3)  # the reading went stale
    assert (await proxy.client.post(CHAT, json=body(), headers=AUTH)).status == 200


async def test_real_engine_metrics_are_read(start_proxy: Start, sims: list[SimServer]) -> None:
    """The simulator's vLLM-style /metrics are scraped; an idle engine is not saturated."""
    config = make_config(
        [sims[0].url],
        saturation={"max_waiting": 0},
        health={"interval_ms": 50},
        replicas=[{"name": "r0", "url": sims[0].url, "max_concurrency": 4,
                   "metrics_url": sims[0].url + "/metrics"}],
    )  # fmt: skip
    proxy = await start_proxy(config)
    await wait_for(lambda: "r0" in proxy.runtime.health._readings)
    reading = proxy.runtime.health._readings["r0"]
    assert reading.waiting == 0 and reading.kv_cache is not None
    assert not proxy.runtime.pool.replicas[0].saturated
    state = await (await proxy.client.get("/admin/state")).json()
    assert state["replicas"]["r0"]["engine"]["waiting"] == 0


@pytest.mark.parametrize(
    ("text", "waiting", "running", "kv"),
    [
        (
            'vllm:num_requests_waiting{model_name="m"} 3\n'
            'vllm:num_requests_running{model_name="m"} 7\n'
            'vllm:kv_cache_usage_perc{model_name="m"} 0.5\n',
            3, 7, 0.5,
        ),
        ("sglang:num_queue_reqs 2\nsglang:num_running_reqs 5\nsglang:token_usage 0.25\n",
         2, 5, 0.25),
        ("tgi_queue_size 4\ntgi_batch_current_size 6\n", 4, 6, None),
        (
            "# HELP llamacpp:requests_deferred Number of requests deferred.\n"
            "# TYPE llamacpp:requests_deferred gauge\nllamacpp:requests_deferred 1\n"
            "# TYPE llamacpp:requests_processing gauge\nllamacpp:requests_processing 2\n",
            1, 2, None,
        ),
        ("# an engine without these metrics\nother_metric 1\n", None, None, None),
    ],
    ids=["vllm", "sglang", "tgi", "llamacpp", "unknown"],
)  # fmt: skip
def test_engine_metrics_of_every_engine_are_understood(
    text: str, waiting: float | None, running: float | None, kv: float | None
) -> None:
    from proxy.health import parse_engine_metrics

    reading = parse_engine_metrics(text, at=1.0)
    assert (reading.waiting, reading.running, reading.kv_cache) == (waiting, running, kv)


def health_reading(proxy: ProxyUnderTest, waiting: float) -> Any:
    from proxy.health import EngineReading

    return EngineReading(proxy.runtime.clock.now(), waiting, None)


async def test_gpu_guard_holds_dispatch_over_the_threshold(
    start_proxy: Start, sims: list[SimServer]
) -> None:
    """Fake NVML probe: memory over gpu.memory_guard stops dispatch to that replica;
    under it, dispatch resumes."""
    probe = FakeGpuProbe([GpuReading(0, 0.5, 95, 100)])
    config = make_config(
        [sims[0].url],
        gpu={"memory_guard": 0.9, "sample_ms": 20},
        replicas=[{"name": "r0", "url": sims[0].url, "max_concurrency": 4, "gpu_index": 0}],
    )
    proxy = await start_proxy(config, gpu=probe, ready=False)
    r0 = proxy.runtime.pool.replicas[0]
    await wait_for(lambda: r0.gpu_guarded)
    waiting = asyncio.ensure_future(proxy.client.post(CHAT, json=body(), headers=AUTH))
    await wait_for(lambda: len(proxy.runtime.dispatcher.scheduler) == 1)
    probe.readings = [GpuReading(0, 0.5, 50, 100)]
    assert (await waiting).status == 200
    assert not r0.gpu_guarded
    metrics = await (await proxy.client.get("/metrics")).text()
    assert 'admission_gpu_memory_used_ratio{gpu="0"} 0.5' in metrics
