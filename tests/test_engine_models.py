"""Model discovery against real engines: two llama-servers serving different model names.

What discovery reads from a real engine, that ``proxy/models.py`` turns it
into the right pools, and the proxy routing by ``model`` (aliases included)
and answering ``GET /v1/models`` over two real servers.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import urllib.request
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import openai
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from bench.real_engine import Engine
from proxy.models import ModelTable, PoolChoice, parse_model_list
from proxy.settings import parse_config
from tests.conftest import ProxyUnderTest
from tests.engine import LlamaServer
from tests.helpers import KEY_A, KEY_B, wait_for

Start = Callable[..., Awaitable[ProxyUnderTest]]

pytestmark = [pytest.mark.engine, pytest.mark.timeout(180)]

ALIASES = {"llama-0": "llama-3.1-8b", "llama-1": "qwen2.5-7b"}


@pytest.fixture(scope="module")
def aliased_pair(
    real_engine: Engine, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[LlamaServer]]:
    """Two one-slot, one-thread servers of the tiny model, each under its own --alias."""
    log_dir = tmp_path_factory.mktemp("llama-models")
    servers = [
        LlamaServer(real_engine, log_dir, name, parallel=1, alias=alias)
        for name, alias in ALIASES.items()
    ]
    with contextlib.ExitStack() as stack:
        for server in servers:
            stack.callback(server.stop)
            server.start()
        yield servers


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10.0) as response:
        body: bytes = response.read()
        return body


def test_each_replica_lists_its_alias(aliased_pair: list[LlamaServer]) -> None:
    """GET /v1/models on each server: exactly its --alias, parsed as that one model."""
    for server in aliased_pair:
        assert parse_model_list(_get(server.url + "/v1/models")) == frozenset({server.alias})


def test_discovered_lists_make_one_pool_per_model(aliased_pair: list[LlamaServer]) -> None:
    """Both servers discovered into one table (with an alias on top): each model's pool is the
    one server that serves it, and /v1/models lists both models plus the alias."""
    table = ModelTable({s.name: None for s in aliased_pair}, {"gpt-4o-mini": "llama-3.1-8b"})
    for server in aliased_pair:
        assert table.update(server.name, parse_model_list(_get(server.url + "/v1/models")))
    assert table.select("llama-3.1-8b", allowed=None) == PoolChoice(
        "llama-3.1-8b", frozenset({"llama-0"})
    )
    assert table.select("gpt-4o-mini", allowed=None) == PoolChoice(
        "llama-3.1-8b", frozenset({"llama-0"})
    )
    assert table.select("qwen2.5-7b", allowed=None) == PoolChoice(
        "qwen2.5-7b", frozenset({"llama-1"})
    )
    assert table.models_for_tenant(None) == ["gpt-4o-mini", "llama-3.1-8b", "qwen2.5-7b"]


def test_engine_answers_under_its_alias(aliased_pair: list[LlamaServer]) -> None:
    """A completion sent to the second server names its alias as the model in the answer, so
    the name upstream gets is the one discovery read."""
    server = aliased_pair[1]
    request = urllib.request.Request(
        server.url + "/v1/completions",
        data=b'{"model": "qwen2.5-7b", "prompt": "Hello", "max_tokens": 2}',
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60.0) as response:
        assert response.status == 200
        assert b'"model":"qwen2.5-7b"' in response.read().replace(b" ", b"")


async def _wait_warmed(proxy: ProxyUnderTest) -> None:
    """Both models discovered and both replicas serving: their warm-up requests are done."""
    table, replicas = proxy.runtime.models, proxy.runtime.pool.replicas
    await wait_for(
        lambda: len(table.served_models()) == 2 and all(r.serving for r in replicas), 30.0
    )


async def test_the_proxy_routes_by_model_to_real_engines(
    aliased_pair: list[LlamaServer], start_proxy: Start
) -> None:
    """Through the proxy, replicas with models: null: discovery reads each server's
    --alias, /v1/models lists both plus the alias, and each name (an alias
    included) is answered by the one server that serves it."""
    log = io.StringIO()
    doc = {
        "replicas": [
            {"name": s.name, "url": s.url, "max_concurrency": 1, "models": None}
            for s in aliased_pair
        ],
        "tenants": {"a": {"api_keys": [KEY_A]}},
        "model_aliases": {"gpt-4o-mini": "llama-3.1-8b"},
    }
    proxy = await start_proxy(parse_config(yaml.safe_dump(doc)), access_log=log)
    # Discovered is not yet serving: /v1/models lists a replica once its warm-up is done.
    await _wait_warmed(proxy)
    auth = {"Authorization": f"Bearer {KEY_A}"}
    listing = await (await proxy.client.get("/v1/models", headers=auth)).json()
    assert [m["id"] for m in listing["data"]] == ["gpt-4o-mini", "llama-3.1-8b", "qwen2.5-7b"]
    expected = {"gpt-4o-mini": "llama-0", "llama-3.1-8b": "llama-0", "qwen2.5-7b": "llama-1"}
    for name in expected:
        resp = await proxy.client.post(
            "/v1/completions",
            json={"model": name, "prompt": "Hello", "max_tokens": 2},
            headers={**auth, "X-Request-Id": f"via-{name}"},
        )
        assert resp.status == 200, await resp.text()
        assert (await resp.json())["model"] == ALIASES[expected[name]]
    await wait_for(lambda: not proxy.runtime.active)
    lines = [json.loads(line) for line in log.getvalue().splitlines()]
    served = {
        line["request_id"][4:]: line["replica"]
        for line in lines
        if line.get("request_id", "").startswith("via-")
    }
    assert served == expected
    proxy.assert_idle()


def _pooled_config(servers: list[LlamaServer]) -> dict[str, Any]:
    """Both servers with models: null; tenant b may use only qwen2.5-7b (llama-1)."""
    return {
        "replicas": [
            {"name": s.name, "url": s.url, "max_concurrency": 1, "models": None} for s in servers
        ],
        "tenants": {
            "a": {"api_keys": [KEY_A], "queue_capacity": 32},
            "b": {"api_keys": [KEY_B], "allowed_models": ["qwen2.5-7b"]},
        },
        "budgets": {"queue_ms": 60_000, "first_byte_ms": 60_000, "total_ms": 120_000},
    }


def _engine_work(server: LlamaServer) -> dict[str, float]:
    """What the engine has computed since it started: prompt and generated tokens, decodes."""
    names = ("llamacpp:prompt_tokens_total", "llamacpp:tokens_predicted_total",
             "llamacpp:n_decode_total")  # fmt: skip
    text = _get(server.url + "/metrics").decode()
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name in names
    }


async def test_a_tenant_limited_to_one_model_is_refused_the_other(
    aliased_pair: list[LlamaServer], start_proxy: Start
) -> None:
    """Tenant b may use only qwen2.5-7b: through the openai client, llama-3.1-8b (and
    its alias) is 403 model_not_allowed with the error body, and the llama-0 engine
    computes nothing for it (its token and decode counters do not move); qwen2.5-7b
    is answered as usual."""
    proxy = await start_proxy(parse_config(yaml.safe_dump(_pooled_config(aliased_pair))))
    await _wait_warmed(proxy)
    before = _engine_work(aliased_pair[0])
    async with openai.AsyncOpenAI(
        base_url=proxy.url + "/v1", api_key=KEY_B, max_retries=0
    ) as client:
        with pytest.raises(openai.PermissionDeniedError) as info:
            await client.chat.completions.create(
                model="llama-3.1-8b", messages=[{"role": "user", "content": "Hi"}], max_tokens=4
            )
        assert info.value.response.headers["X-Admission-Reason"] == "model_not_allowed"
        assert info.value.code == "model_not_allowed"
        with pytest.raises(openai.PermissionDeniedError):
            await client.completions.create(model="llama-3.1-8b", prompt="Hi", max_tokens=4)
        reply = await client.chat.completions.create(
            model="qwen2.5-7b", messages=[{"role": "user", "content": "Hi"}], max_tokens=4
        )
        assert reply.model == "qwen2.5-7b"
    await wait_for(lambda: not proxy.runtime.active)
    assert _engine_work(aliased_pair[0]) == before
    proxy.assert_idle()


async def test_a_flooded_model_does_not_hold_back_the_other(
    aliased_pair: list[LlamaServer], start_proxy: Start
) -> None:
    """llama-3.1-8b (one seat) gets six long requests, so five wait in its pool's
    queue; then three qwen2.5-7b requests, sent one after the other through the
    openai client, are all answered while llama's queue still holds tickets that
    were queued before them: they never waited behind it (with one queue for the
    fleet they would have). Afterwards every llama request completes too."""
    log = io.StringIO()
    config = parse_config(yaml.safe_dump(_pooled_config(aliased_pair)))
    proxy = await start_proxy(config, access_log=log)
    await _wait_warmed(proxy)
    dispatcher = proxy.runtime.dispatcher
    auth = {"Authorization": f"Bearer {KEY_A}"}
    flood_body = {"model": "llama-3.1-8b", "prompt": "Once", "max_tokens": 1500,
                  "ignore_eos": True}  # fmt: skip
    flood = [
        asyncio.create_task(
            proxy.client.post(
                "/v1/completions", json=flood_body, headers={**auth, "X-Request-Id": f"a-{i}"}
            )
        )
        for i in range(6)
    ]
    try:
        await wait_for(lambda: dispatcher.scheduler.depth_of_model("llama-3.1-8b") == 5, 30.0)
        async with openai.AsyncOpenAI(
            base_url=proxy.url + "/v1", api_key=KEY_A, max_retries=0
        ) as client:
            for i in range(3):
                reply = await client.completions.create(
                    model="qwen2.5-7b", prompt="Hi", max_tokens=4,
                    extra_headers={"X-Request-Id": f"b-{i}"},
                )  # fmt: skip
                assert reply.model == "qwen2.5-7b"
        # No llama request arrived since the flood: whatever is queued was queued before b-0.
        assert dispatcher.scheduler.depth_of_model("llama-3.1-8b") > 0
        assert dispatcher.scheduler.depth_of_model("qwen2.5-7b") == 0
    finally:
        answers = await asyncio.gather(*flood)
    assert [r.status for r in answers] == [200] * 6
    await wait_for(lambda: not proxy.runtime.active)
    lines = [json.loads(line) for line in log.getvalue().splitlines()]
    served = {
        line["request_id"]: line["replica"]
        for line in lines
        if line.get("request_id", "")[:2] in ("a-", "b-")
    }
    assert served == {**{f"a-{i}": "llama-0" for i in range(6)},
                      **{f"b-{i}": "llama-1" for i in range(3)}}  # fmt: skip
    proxy.assert_idle()
