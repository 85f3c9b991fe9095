"""Degrading instead of refusing: the output limit capped under pressure, listed classes only."""

from __future__ import annotations

import asyncio
import io
import json
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import pytest

from proxy.degrade import cap_max_tokens
from tests.conftest import ProxyUnderTest
from tests.helpers import KEY_A, KEY_B, make_config, samples_by_label, wait_for
from tests.upstreams import Upstream

Start = Callable[..., Awaitable[ProxyUnderTest]]
CHAT = "/v1/chat/completions"
CAP = 2


@pytest.mark.parametrize(
    ("route", "doc", "expected"),
    [
        # chat: no limit -> max_tokens inserted (every engine reads it)
        (CHAT, {"messages": []}, {"messages": [], "max_tokens": 2}),
        (CHAT, {"max_tokens": 50}, {"max_tokens": 2}),
        (CHAT, {"max_completion_tokens": 50}, {"max_completion_tokens": 2}),
        (
            CHAT,
            {"max_completion_tokens": 50, "max_tokens": 1},
            {"max_completion_tokens": 2, "max_tokens": 1},
        ),
        (CHAT, {"max_tokens": None}, {"max_tokens": 2}),
        (CHAT, {"max_tokens": "many"}, {"max_tokens": 2}),
        (CHAT, {"max_tokens": 2}, None),
        (CHAT, {"max_completion_tokens": 1}, None),
        ("/v1/completions", {"prompt": "x"}, {"prompt": "x", "max_tokens": 2}),
        ("/v1/completions", {"max_tokens": 9}, {"max_tokens": 2}),
        ("/v1/completions", {"max_tokens": 2}, None),
        ("/generate", {"inputs": "x"}, {"inputs": "x", "parameters": {"max_new_tokens": 2}}),
        (
            "/generate_stream",
            {"parameters": {"max_new_tokens": 9, "top_k": 3}},
            {"parameters": {"max_new_tokens": 2, "top_k": 3}},
        ),
        ("/generate", {"parameters": {"max_new_tokens": 1}}, None),
        # SGLang's /generate: its limit is in sampling_params
        ("/generate", {"text": "x"}, {"text": "x", "sampling_params": {"max_new_tokens": 2}}),
        (
            "/generate",
            {"input_ids": [1], "sampling_params": {"max_new_tokens": 9, "n": 2}},
            {"input_ids": [1], "sampling_params": {"max_new_tokens": 2, "n": 2}},
        ),
        ("/generate", {"text": "x", "sampling_params": {"max_new_tokens": 2}}, None),
        # SGLang's batch: one sampling_params per prompt, each capped, none lost
        (
            "/generate",
            {
                "text": ["x", "y"],
                "sampling_params": [{"max_new_tokens": 9, "temperature": 0}, {"stop": ["."]}],
            },
            {
                "text": ["x", "y"],
                "sampling_params": [
                    {"max_new_tokens": 2, "temperature": 0},
                    {"stop": ["."], "max_new_tokens": 2},
                ],
            },
        ),
        ("/generate", {"text": ["x"], "sampling_params": [{"max_new_tokens": 1}]}, None),
        # llama.cpp's own API: n_predict (-1 is "until the end")
        ("/completion", {"prompt": "x"}, {"prompt": "x", "n_predict": 2}),
        ("/completions", {"n_predict": -1}, {"n_predict": 2}),
        ("/infill", {"n_predict": 9}, {"n_predict": 2}),
        ("/completion", {"n_predict": 1}, None),
        # llama.cpp takes n_predict over max_tokens on its OpenAI routes too
        (CHAT, {"max_tokens": 1, "n_predict": 500}, {"max_tokens": 1, "n_predict": 2}),
        ("/v1/completions", {"n_predict": -1}, {"n_predict": 2, "max_tokens": 2}),
        (CHAT, {"max_tokens": 1, "n_predict": 2}, None),
        ("/v1/embeddings", {"input": "x"}, None),
    ],
)
def test_cap_max_tokens_by_route(
    route: str, doc: dict[str, Any], expected: dict[str, Any] | None
) -> None:
    """Each route's output limit lowered or inserted; one at or under the cap is untouched."""
    before = json.dumps(doc)
    assert cap_max_tokens(doc, route, CAP) == expected
    assert json.dumps(doc) == before  # the parsed body is never changed in place


def _config(upstream_url: str, *, cap: int | None = CAP, at: float = 0.8) -> Any:
    """One seat; tenant a interactive, tenant b batch; a queue budget of 100 ms, so a
    request that finds the seat held times out in the queue: pressure 1 in its class."""
    tenants = {
        "a": {"api_keys": [KEY_A], "priority": "interactive"},
        "b": {"api_keys": [KEY_B], "priority": "batch"},
    }
    overload = {"max_tokens_cap": cap, "at": at, "classes": ["batch"]}
    budgets = {"queue_ms": 100, "first_byte_ms": 10000, "total_ms": 60000}
    return make_config([upstream_url], seats=1, tenants=tenants, overload=overload, budgets=budgets)


async def _time_out_one(
    proxy: ProxyUnderTest, upstream: Upstream, key: str
) -> tuple[aiohttp.ClientResponse, aiohttp.ClientResponse]:
    """Hold the one seat with a slow request; a second one times out in the queue. Returns
    both answers (slow, refused)."""
    auth = {"Authorization": f"Bearer {key}"}
    before = upstream.active
    slow = asyncio.ensure_future(proxy.client.post(CHAT, json={"hang_ms": 1500}, headers=auth))
    await wait_for(lambda: upstream.active > before)
    refused = await proxy.client.post(CHAT, json={}, headers=auth)
    assert refused.status == 503
    assert refused.headers["X-Admission-Reason"] == "queue_timeout"
    answer = await slow
    assert answer.status == 200
    return answer, refused


def _degraded_counts(text: str) -> dict[str, float]:
    return samples_by_label(text, "admission_degraded_requests_total", "priority")


def _pressure(text: str) -> dict[str, float]:
    return samples_by_label(text, "admission_budget_pressure", "priority")


async def test_a_listed_class_is_degraded_only_above_the_threshold(
    start_proxy: Start, upstream_url: str, upstream_state: Upstream
) -> None:
    """Batch under pressure 0: its request is untouched. After one queue timeout in three
    (p95 = 1 > 0.8) its next request asks the replica for the cap: the engine answers with that
    many tokens, the client sees X-Admission-Degraded, the access line and the counter
    say so. Interactive, not listed, is never degraded even at pressure 1."""
    log = io.StringIO()
    proxy = await start_proxy(_config(upstream_url), access_log=log)
    batch, interactive = {"Authorization": f"Bearer {KEY_B}"}, {"Authorization": f"Bearer {KEY_A}"}

    calm = await proxy.client.post(CHAT, json={"max_tokens": 5}, headers=batch)
    assert calm.status == 200 and "X-Admission-Degraded" not in calm.headers
    assert (await calm.json())["usage"]["completion_tokens"] == 5

    await _time_out_one(proxy, upstream_state, KEY_B)
    await _time_out_one(proxy, upstream_state, KEY_A)
    metrics = await (await proxy.client.get("/metrics")).text()
    assert _pressure(metrics)["batch"] == 1.0 and _pressure(metrics)["interactive"] == 1.0

    degraded = await proxy.client.post(CHAT, json={"max_tokens": 5}, headers=batch)
    assert degraded.status == 200
    assert degraded.headers["X-Admission-Degraded"] == "max_tokens"
    assert (await degraded.json())["usage"]["completion_tokens"] == CAP  # what the replica got
    inserted = await proxy.client.post(CHAT, json={"stream": True}, headers=batch)
    assert inserted.headers["X-Admission-Degraded"] == "max_tokens"
    assert (await inserted.read()).count(b'"tok') == CAP  # no limit sent: the cap inserted
    untouched = await proxy.client.post(CHAT, json={"max_tokens": 1}, headers=batch)
    assert "X-Admission-Degraded" not in untouched.headers  # already under the cap

    not_listed = await proxy.client.post(CHAT, json={"max_tokens": 5}, headers=interactive)
    assert not_listed.status == 200 and "X-Admission-Degraded" not in not_listed.headers
    assert (await not_listed.json())["usage"]["completion_tokens"] == 5

    metrics = await (await proxy.client.get("/metrics")).text()
    assert _degraded_counts(metrics) == {"batch": 2.0}
    lines = [json.loads(line) for line in log.getvalue().splitlines()]
    assert [line["degraded"] for line in lines if line["status"] == 200].count("max_tokens") == 2
    assert all(line["degraded"] is None for line in lines if line["priority"] == "interactive")
    proxy.assert_idle()


async def test_below_the_threshold_or_without_a_cap_nothing_is_degraded(
    start_proxy: Start, upstream_url: str, upstream_state: Upstream
) -> None:
    """One queue timeout among 32 batch requests keeps the p95 at 0 (< at): no degradation;
    and with max_tokens_cap null even pressure 1 changes no request."""
    proxy = await start_proxy(_config(upstream_url, at=0.5))
    batch = {"Authorization": f"Bearer {KEY_B}"}
    for _ in range(30):
        assert (await proxy.client.post(CHAT, json={}, headers=batch)).status == 200
    await _time_out_one(proxy, upstream_state, KEY_B)
    metrics = await (await proxy.client.get("/metrics")).text()
    assert _pressure(metrics)["batch"] == 0.0
    answer = await proxy.client.post(CHAT, json={"max_tokens": 5}, headers=batch)
    assert "X-Admission-Degraded" not in answer.headers
    assert (await answer.json())["usage"]["completion_tokens"] == 5

    off = await start_proxy(_config(upstream_url, cap=None))
    await _time_out_one(off, upstream_state, KEY_B)
    answer = await off.client.post(CHAT, json={"max_tokens": 5}, headers=batch)
    assert "X-Admission-Degraded" not in answer.headers
    assert (await answer.json())["usage"]["completion_tokens"] == 5
    assert _degraded_counts(await (await off.client.get("/metrics")).text()) == {}


async def test_a_degraded_request_refused_later_still_says_so(
    start_proxy: Start, upstream_url: str, upstream_state: Upstream
) -> None:
    """Degrading does not bypass the queue: a degraded request that times out in the
    queue carries X-Admission-Degraded on the error answer too."""
    proxy = await start_proxy(_config(upstream_url))
    await _time_out_one(proxy, upstream_state, KEY_B)
    answer, refused = await _time_out_one(proxy, upstream_state, KEY_B)  # both degraded now
    assert answer.headers["X-Admission-Degraded"] == "max_tokens"
    assert refused.status == 503 and refused.headers["X-Admission-Degraded"] == "max_tokens"
    later = await proxy.client.post(CHAT, json={}, headers={"Authorization": f"Bearer {KEY_B}"})
    assert later.status == 200 and later.headers["X-Admission-Degraded"] == "max_tokens"


async def test_tenant_caps_and_full_queues_do_not_raise_the_class_pressure(
    start_proxy: Start, upstream_url: str, upstream_state: Upstream
) -> None:
    """A tenant refused for its own cap says nothing about the fleet's capacity: the
    class's pressure stays 0 and nobody is degraded."""
    tenants = {"b": {"api_keys": [KEY_B], "priority": "batch", "max_concurrency": 1,
                     "queue_capacity": 0}}  # fmt: skip
    config = make_config([upstream_url], seats=4, tenants=tenants,
                         overload={"max_tokens_cap": CAP})  # fmt: skip
    proxy = await start_proxy(config)
    auth = {"Authorization": f"Bearer {KEY_B}"}
    slow = asyncio.ensure_future(proxy.client.post(CHAT, json={"hang_ms": 1500}, headers=auth))
    await wait_for(lambda: upstream_state.active > 0)
    for _ in range(3):
        refused = await proxy.client.post(CHAT, json={}, headers=auth)
        assert refused.headers["X-Admission-Reason"] == "tenant_concurrency"
    assert (await slow).status == 200
    assert _pressure(await (await proxy.client.get("/metrics")).text())["batch"] == 0.0
    answer = await proxy.client.post(CHAT, json={"max_tokens": 5}, headers=auth)
    assert "X-Admission-Degraded" not in answer.headers


def test_overload_classes_must_be_configured_when_a_cap_is_set() -> None:
    """A typo in classes would degrade nobody: refused at its YAML path, only with a cap."""
    from proxy.settings import ConfigError

    with pytest.raises(ConfigError) as info:
        make_config(["http://127.0.0.1:1"], overload={"max_tokens_cap": 8, "classes": ["bulk"]})
    assert [i.path for i in info.value.issues] == ["overload.classes[0]"]
    config = make_config(["http://127.0.0.1:1"], overload={"classes": ["bulk"]})
    assert config.overload.max_tokens_cap is None


async def test_the_simulated_engine_generates_the_cap(start_proxy: Start) -> None:
    """Against the simulated replica, through the OpenAI client: a batch request held back
    by a long one times out in the queue, and from then on a batch request asking for 400
    tokens, or for none (the engine's default is 64), is generated with the cap;
    interactive keeps its 40."""
    import openai

    from proxy.sim import SimConfig, start_sim

    sim = await start_sim(SimConfig(slots=4, decode_base_ms=10.0, decode_per_seq_ms=0.0))
    try:
        proxy = await start_proxy(_config(sim.url))
        headers = {"Authorization": f"Bearer {KEY_B}"}
        long = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 150}
        held = asyncio.ensure_future(proxy.client.post(CHAT, json=long, headers=headers))
        await wait_for(lambda: proxy.runtime.pool.total_inflight() == 1)
        refused = await proxy.client.post(CHAT, json=long, headers=headers)
        assert refused.headers["X-Admission-Reason"] == "queue_timeout"
        assert (await held).status == 200
        messages: Any = [{"role": "user", "content": "hello there"}]
        for key, priority, asked, expected in (
            (KEY_B, "batch", 400, CAP), (KEY_B, "batch", None, CAP), (KEY_A, "interactive", 40, 40),
        ):  # fmt: skip
            async with openai.AsyncOpenAI(
                base_url=proxy.url + "/v1", api_key=key, max_retries=0
            ) as client:
                raw = await client.chat.completions.with_raw_response.create(
                    model="sim-model", messages=messages, max_tokens=asked or openai.omit
                )
            reply = raw.parse()
            assert reply.usage is not None and reply.usage.completion_tokens == expected, priority
            degraded = raw.headers.get("X-Admission-Degraded")
            assert degraded == ("max_tokens" if priority == "batch" else None)
        proxy.assert_idle()
    finally:
        await sim.close()


async def test_only_the_congested_pool_is_degraded(
    start_proxy: Start, upstream_url: str, upstream_state: Upstream
) -> None:
    """Two model pools of one seat each; batch times out in alpha's queue (the class's
    pressure 1). A batch request for alpha is degraded; one for beta, whose pool nobody
    waited for, keeps its max_tokens: one congested model does not shorten the answers
    of an idle one (as its queue does not hold them up)."""
    config = _config(upstream_url)
    replicas = [
        {"name": name, "url": upstream_url, "max_concurrency": 1, "models": [model]}
        for name, model in (("r0", "alpha"), ("r1", "beta"))
    ]
    config = config.model_validate({**config.model_dump(), "replicas": replicas})
    proxy = await start_proxy(config)
    await wait_for(lambda: all(r.serving for r in proxy.runtime.pool.replicas))
    batch = {"Authorization": f"Bearer {KEY_B}"}
    slow = asyncio.ensure_future(
        proxy.client.post(CHAT, json={"model": "alpha", "hang_ms": 1500}, headers=batch)
    )
    await wait_for(lambda: upstream_state.active == 1)
    refused = await proxy.client.post(CHAT, json={"model": "alpha"}, headers=batch)
    assert refused.headers["X-Admission-Reason"] == "queue_timeout"
    assert (await slow).status == 200
    metrics = await (await proxy.client.get("/metrics")).text()
    assert _pressure(metrics)["batch"] == 1.0

    idle = await proxy.client.post(CHAT, json={"model": "beta", "max_tokens": 5}, headers=batch)
    assert idle.status == 200 and "X-Admission-Degraded" not in idle.headers
    assert (await idle.json())["usage"]["completion_tokens"] == 5
    hot = await proxy.client.post(CHAT, json={"model": "alpha", "max_tokens": 5}, headers=batch)
    assert hot.headers["X-Admission-Degraded"] == "max_tokens"
    assert (await hot.json())["usage"]["completion_tokens"] == CAP
    proxy.assert_idle()
