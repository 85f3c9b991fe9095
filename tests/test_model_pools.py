"""Model pools on the request path: the body's ``model`` picks the replicas.

End to end through the real proxy, against small aiohttp replicas that list
their models on ``GET /v1/models`` and report which model each request named;
and the dispatcher's per-pool queues on a fake clock.
"""

from __future__ import annotations

import asyncio
import io
import itertools
import json
import math
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import openai
import pytest
import yaml
from aiohttp import web
from aiohttp.test_utils import TestServer
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from proxy import pools as pools_module
from proxy.admitted import Deadline
from proxy.affinity import AffinityKey, HashRing
from proxy.clock import FakeClock
from proxy.dispatch import Dispatcher, TenantLimits
from proxy.models import ModelTable
from proxy.pools import AffinityRouter, PoolSeats
from proxy.replicas import Replica, ReplicaName, ReplicaPool
from proxy.runtime import Rules
from proxy.scheduler import FairScheduler, Ticket
from proxy.settings import DEFAULT_ROUTES, BudgetsConfig, Config, ReplicaConfig, parse_config
from tests.conftest import ProxyUnderTest
from tests.helpers import KEY_A, KEY_B, make_config, wait_for

Start = Callable[..., Awaitable[ProxyUnderTest]]
ServerFactory = Callable[..., Awaitable[TestServer]]
COMPLETIONS = "/v1/completions"
AUTH_A = {"Authorization": f"Bearer {KEY_A}"}
AUTH_B = {"Authorization": f"Bearer {KEY_B}"}


@dataclass
class ModelReplica:
    """What one fake replica lists, what it was sent, and a gate that holds requests."""

    models: list[str]
    bodies: list[bytes] = field(default_factory=list)
    listed: int = 0
    gate: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.gate.set()

    def named(self) -> list[str]:
        return [json.loads(body)["model"] for body in self.bodies]


REPLICA: web.AppKey[ModelReplica] = web.AppKey("replica", ModelReplica)


async def _list(request: web.Request) -> web.Response:
    state = request.app[REPLICA]
    state.listed += 1
    data = [{"id": m, "object": "model"} for m in state.models]
    return web.json_response({"object": "list", "data": data})


async def _health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def _complete(request: web.Request) -> web.Response:
    state = request.app[REPLICA]
    body = await request.read()
    if request.headers.get("X-Request-Id") != "admission-warmup":
        state.bodies.append(body)
        await state.gate.wait()
    return web.json_response({"id": "x", "object": "text_completion", "choices": []})


async def start_replica(
    aiohttp_server: ServerFactory, models: list[str]
) -> tuple[str, ModelReplica]:
    app = web.Application()
    app[REPLICA] = state = ModelReplica(list(models))
    app.router.add_get("/v1/models", _list)
    app.router.add_get("/health", _health)
    app.router.add_post(COMPLETIONS, _complete)
    server = await aiohttp_server(app)
    return str(server.make_url("")).rstrip("/"), state


def pooled_config(urls: list[str], models: list[list[str] | None], **sections: Any) -> Config:
    """Replicas r0, r1, ... of one seat each with the given ``models`` (None: discovered)."""
    doc: dict[str, Any] = {
        "replicas": [
            {"name": f"r{i}", "url": url, "max_concurrency": 1, "models": m}
            for i, (url, m) in enumerate(zip(urls, models, strict=True))
        ],
        "tenants": {"a": {"api_keys": [KEY_A]}, "b": {"api_keys": [KEY_B]}},
    }
    doc.update(sections)
    return parse_config(yaml.safe_dump(doc))


TENANTS = {
    "a": {"api_keys": [KEY_A]},
    "b": {"api_keys": [KEY_B], "allowed_models": ["qwen"]},
}


R = TypeVar("R")


async def pooled_pair(
    aiohttp_server: ServerFactory,
    start_proxy: Start,
    start: Callable[[ServerFactory, list[str]], Awaitable[tuple[str, R]]],
) -> tuple[ProxyUnderTest, R, R]:
    """r0 serves llama (alias mini), r1 serves qwen, both listed statically, each
    replica made by ``start``; tenant b may use only qwen."""
    url0, llama = await start(aiohttp_server, ["llama"])
    url1, qwen = await start(aiohttp_server, ["qwen"])
    config = pooled_config(
        [url0, url1], [["llama"], ["qwen"]], tenants=TENANTS, model_aliases={"mini": "llama"}
    )
    proxy = await start_proxy(config)
    await wait_for(lambda: all(r.serving for r in proxy.runtime.pool.replicas))
    return proxy, llama, qwen


async def two_pools(
    aiohttp_server: ServerFactory, start_proxy: Start
) -> tuple[ProxyUnderTest, ModelReplica, ModelReplica]:
    """``pooled_pair`` of replicas that answer completions (``start_replica``)."""
    return await pooled_pair(aiohttp_server, start_proxy, start_replica)


async def test_model_refusals_carry_the_error_and_take_no_seat(
    aiohttp_server: ServerFactory, start_proxy: Start
) -> None:
    """Unknown model 404, a model outside allowed_models 403, no model with two
    pools 400: each with the error body and reason header, nothing upstream."""
    proxy, llama, qwen = await two_pools(aiohttp_server, start_proxy)
    cases = [
        (AUTH_A, {"model": "gpt-9", "prompt": "x"}, 404, "model_not_found"),
        (AUTH_B, {"model": "llama", "prompt": "x"}, 403, "model_not_allowed"),
        (AUTH_B, {"model": "mini", "prompt": "x"}, 403, "model_not_allowed"),
        (AUTH_A, {"prompt": "x"}, 400, "bad_request"),
        (AUTH_A, {"model": 7, "prompt": "x"}, 400, "bad_request"),
    ]
    for headers, body, status, reason in cases:
        resp = await proxy.client.post(
            COMPLETIONS, json=body, headers={**headers, "X-Request-Id": "req-1"}
        )
        assert resp.status == status, body
        assert resp.headers["X-Admission-Reason"] == reason
        assert resp.headers["X-Request-Id"] == "req-1"
        error = (await resp.json())["error"]
        assert error["code"] == reason and error["type"] == "admission_error"
    assert llama.bodies == [] and qwen.bodies == []
    proxy.assert_idle()


async def test_an_empty_allowed_models_list_allows_no_model(
    aiohttp_server: ServerFactory, start_proxy: Start
) -> None:
    """``allowed_models: []`` is a list of no names (the contract: null is every model,
    else the names listed): every model is refused 403 and ``/v1/models`` lists none.
    LiteLLM reads an empty list as every model; the docs say ours does not."""
    url0, llama = await start_replica(aiohttp_server, ["llama"])
    tenants = {"a": {"api_keys": [KEY_A]}, "b": {"api_keys": [KEY_B], "allowed_models": []}}
    proxy = await start_proxy(pooled_config([url0], [["llama"]], tenants=tenants))
    await wait_for(lambda: all(r.serving for r in proxy.runtime.pool.replicas))
    resp = await proxy.client.post(COMPLETIONS, json={"model": "llama", "prompt": "x"},
                                   headers=AUTH_B)  # fmt: skip
    assert resp.status == 403
    assert resp.headers["X-Admission-Reason"] == "model_not_allowed"
    listed = await proxy.client.get("/v1/models", headers=AUTH_B)
    assert listed.status == 200 and (await listed.json())["data"] == []
    assert llama.bodies == []
    proxy.assert_idle()


async def test_a_body_without_model_is_told_where_to_find_one(
    aiohttp_server: ServerFactory, start_proxy: Start
) -> None:
    """Two pools; tenant b may use qwen only. A body naming no model is 400, told to
    set one from GET /v1/models, and not told how many models the fleet serves (b's
    list shows one: the count was of models it may not see)."""
    proxy, llama, qwen = await two_pools(aiohttp_server, start_proxy)
    resp = await proxy.client.post(COMPLETIONS, json={"prompt": "x"}, headers=AUTH_B)
    assert resp.status == 400 and llama.bodies == [] and qwen.bodies == []
    message = (await resp.json())["error"]["message"]
    assert message == "the request names no model: set model to one GET /v1/models lists"
    proxy.assert_idle()


async def test_model_refusals_echo_nothing_the_client_sent(
    aiohttp_server: ServerFactory, start_proxy: Start
) -> None:
    """A 200 KB model name with markup (404), the alias mini for tenant b, who may not
    use its target (403), and GET /v1/models/{id} of a name with markup (404): the
    answers are short and hold no part of the name asked."""
    proxy, llama, qwen = await two_pools(aiohttp_server, start_proxy)
    hostile = "<script>alert(1)</script>" + "A" * 200_000
    cases = [
        (await proxy.client.post(
            COMPLETIONS, json={"model": hostile, "prompt": "x"}, headers=AUTH_A
        ), 404, "<script>"),
        (await proxy.client.post(
            COMPLETIONS, json={"model": "mini", "prompt": "x"}, headers=AUTH_B
        ), 403, "mini"),
        (await proxy.client.get("/v1/models/%3Cscript%3Ealert(1)", headers=AUTH_A),
         404, "<script>"),
    ]  # fmt: skip
    for answer, status, asked in cases:
        text = await answer.text()
        assert answer.status == status
        assert len(text) < 1000 and asked not in text
    assert llama.bodies == [] and qwen.bodies == []
    proxy.assert_idle()


async def test_each_model_reaches_its_pool_and_an_alias_its_target(
    aiohttp_server: ServerFactory, start_proxy: Start
) -> None:
    """An alias is rewritten to its target; any other body goes upstream byte for byte."""
    proxy, llama, qwen = await two_pools(aiohttp_server, start_proxy)
    raw = b'{"model":  "qwen",   "prompt": "x"}'
    for _ in range(3):
        resp = await proxy.client.post(
            COMPLETIONS, data=raw, headers={**AUTH_B, "Content-Type": "application/json"}
        )
        assert resp.status == 200
        resp = await proxy.client.post(
            COMPLETIONS, json={"model": "mini", "prompt": "é"}, headers=AUTH_A
        )
        assert resp.status == 200
        resp = await proxy.client.post(
            COMPLETIONS, json={"model": "llama", "prompt": "x"}, headers=AUTH_A
        )
        assert resp.status == 200
    assert qwen.bodies == [raw] * 3
    assert llama.named() == ["llama"] * 6
    assert json.loads(llama.bodies[0])["prompt"] == "é"
    # A lone surrogate escape survives the rewrite (the body is re-encoded as ASCII JSON).
    lone = b'{"model": "mini", "prompt": "\\ud800"}'
    resp = await proxy.client.post(
        COMPLETIONS, data=lone, headers={**AUTH_A, "Content-Type": "application/json"}
    )
    assert resp.status == 200
    assert json.loads(llama.bodies[-1]) == {"model": "llama", "prompt": "\ud800"}
    proxy.assert_idle()


async def test_models_listing_is_the_union_filtered_per_tenant(
    aiohttp_server: ServerFactory, start_proxy: Start
) -> None:
    """GET /v1/models is answered by the proxy in OpenAI's list format: served
    models plus aliases, only what the tenant may use; a static replica is never asked."""
    proxy, llama, qwen = await two_pools(aiohttp_server, start_proxy)
    resp = await proxy.client.get("/v1/models", headers=AUTH_A)
    assert resp.status == 200 and resp.headers["X-Request-Id"]
    listing = await resp.json()
    assert listing["object"] == "list"
    assert [m["id"] for m in listing["data"]] == ["llama", "mini", "qwen"]
    assert all(m["object"] == "model" for m in listing["data"])
    resp = await proxy.client.get("/v1/models", headers=AUTH_B)
    assert [m["id"] for m in (await resp.json())["data"]] == ["qwen"]
    resp = await proxy.client.get("/v1/models")
    assert resp.status == 401
    assert llama.listed == 0 and qwen.listed == 0
    # A replica that stops serving (here: removed from the pool) leaves the listing.
    proxy.runtime.pool.retire("r1")
    resp = await proxy.client.get("/v1/models", headers=AUTH_A)
    assert [m["id"] for m in (await resp.json())["data"]] == ["llama", "mini"]
    proxy.assert_idle()


async def test_one_model_is_answered_by_the_proxy_within_the_tenants_list(
    aiohttp_server: ServerFactory, start_proxy: Start
) -> None:
    """GET /v1/models/{id} is answered by the proxy with OpenAI's model object for a
    name in the tenant's list (an alias included), else 404 model_not_found with
    the error body: unknown, or served but not allowed. No replica is asked; the
    openai client's models.retrieve reads the answer."""
    proxy, llama, qwen = await two_pools(aiohttp_server, start_proxy)
    for name in ("llama", "mini", "qwen"):
        resp = await proxy.client.get(f"/v1/models/{name}", headers=AUTH_A)
        assert resp.status == 200 and resp.headers["X-Request-Id"]
        assert await resp.json() == {
            "id": name, "object": "model", "created": 0, "owned_by": "admission-proxy"
        }  # fmt: skip
    for headers, name in ((AUTH_A, "gpt-9"), (AUTH_B, "llama"), (AUTH_B, "mini")):
        resp = await proxy.client.get(
            f"/v1/models/{name}", headers={**headers, "X-Request-Id": "get-1"}
        )
        assert resp.status == 404, name
        assert resp.headers["X-Admission-Reason"] == "model_not_found"
        assert resp.headers["X-Request-Id"] == "get-1"
        error = (await resp.json())["error"]
        assert error["code"] == "model_not_found" and name not in error["message"]
    async with openai.AsyncOpenAI(
        base_url=str(proxy.client.make_url("/v1")), api_key=KEY_B, max_retries=0
    ) as client:
        assert (await client.models.retrieve("qwen")).id == "qwen"
        with pytest.raises(openai.NotFoundError):
            await client.models.retrieve("llama")
    assert llama.listed == 0 and qwen.listed == 0
    assert llama.bodies == [] and qwen.bodies == []
    proxy.assert_idle()


async def test_a_model_id_with_a_slash_is_retrieved_by_the_openai_client(
    aiohttp_server: ServerFactory, start_proxy: Start
) -> None:
    """Hugging Face names hold a slash and the openai client sends models.retrieve of one
    as ``/v1/models/meta-llama%2FLlama-3.1-8B``: the proxy answers it like the unencoded
    spelling, and an encoded slash that climbs out of /v1/models/ is still a 400."""
    name = "meta-llama/Llama-3.1-8B"
    url0, first = await start_replica(aiohttp_server, [name])
    url1, second = await start_replica(aiohttp_server, ["qwen"])
    proxy = await start_proxy(pooled_config([url0, url1], [[name], ["qwen"]], tenants=TENANTS))
    await wait_for(lambda: all(r.serving for r in proxy.runtime.pool.replicas))
    async with openai.AsyncOpenAI(
        base_url=str(proxy.client.make_url("/v1")), api_key=KEY_A, max_retries=0
    ) as client:
        assert (await client.models.retrieve(name)).id == name
        with pytest.raises(openai.NotFoundError):
            await client.models.retrieve("meta-llama/Llama-3.1-70B")
    for path in (f"/v1/models/{name}", "/v1/models/meta-llama%2fLlama-3.1-8B"):
        resp = await proxy.client.get(path, headers=AUTH_A)
        assert resp.status == 200 and (await resp.json())["id"] == name, path
    resp = await proxy.client.get("/v1/models/a%2F..%2F..%2F..%2Fadmin", headers=AUTH_A)
    assert resp.status == 400 and resp.headers["X-Admission-Reason"] == "bad_request"
    assert first.bodies == [] and second.bodies == []
    proxy.assert_idle()


async def test_one_discovered_model_routes_as_without_pools(
    aiohttp_server: ServerFactory, start_proxy: Start
) -> None:
    """No static lists, aliases or allowed_models and one discovered model: any
    model name goes unchanged to the replica, and /v1/models is the replica's own."""
    url, replica = await start_replica(aiohttp_server, ["m"])
    proxy = await start_proxy(make_config([url], seats=1))
    await wait_for(lambda: replica.listed > 0)
    assert proxy.runtime.models.served_models() == {"m"}
    assert not proxy.runtime.models.pooled
    for body in (b'{"model": "anything", "prompt": "x"}', b'{"prompt": "x"}'):
        resp = await proxy.client.post(
            COMPLETIONS, data=body, headers={**AUTH_A, "Content-Type": "application/json"}
        )
        assert resp.status == 200
    assert replica.bodies == [b'{"model": "anything", "prompt": "x"}', b'{"prompt": "x"}']
    listed = replica.listed
    resp = await proxy.client.get("/v1/models", headers=AUTH_A)
    assert resp.status == 200 and replica.listed == listed + 1
    proxy.assert_idle()


async def test_discovery_sends_the_replicas_api_key(
    aiohttp_server: ServerFactory, start_proxy: Start, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two replicas that guard /v1/* with an API key (vLLM's --api-key), models
    discovered: the proxy asks with the replica's key, so each model gets its pool
    and a request for qwen reaches only the qwen replica."""
    monkeypatch.setenv("REPLICA_KEY", "sk-replica")

    @web.middleware
    async def guard(request: web.Request, handler: Any) -> web.StreamResponse:
        if request.path.startswith("/v1") and (
            request.headers.get("Authorization") != "Bearer sk-replica"
        ):
            return web.json_response({"error": "unauthorized"}, status=401)
        response: web.StreamResponse = await handler(request)
        return response

    urls, states = [], []
    for models in (["llama"], ["qwen"]):
        app = web.Application(middlewares=[guard])
        app[REPLICA] = state = ModelReplica(models)
        app.router.add_get("/v1/models", _list)
        app.router.add_get("/health", _health)
        app.router.add_post(COMPLETIONS, _complete)
        server = await aiohttp_server(app)
        urls.append(str(server.make_url("")).rstrip("/"))
        states.append(state)
    doc = {
        "replicas": [
            {"name": f"r{i}", "url": url, "max_concurrency": 1, "api_key_env": "REPLICA_KEY"}
            for i, url in enumerate(urls)
        ],
        "tenants": {"a": {"api_keys": [KEY_A]}},
        "health": {"interval_ms": 50},
    }
    proxy = await start_proxy(parse_config(yaml.safe_dump(doc)))
    await wait_for(lambda: proxy.runtime.models.served_models() == {"llama", "qwen"})
    assert proxy.runtime.models.pooled
    resp = await proxy.client.post(
        COMPLETIONS, json={"model": "qwen", "prompt": "x"}, headers=AUTH_A
    )
    assert resp.status == 200
    assert states[0].named() == [] and states[1].named() == ["qwen"]
    proxy.assert_idle()


async def test_a_pool_not_yet_listed_is_503_not_404(
    aiohttp_server: ServerFactory, start_proxy: Start
) -> None:
    """Routed by model (tenant a limited to llama) with the one replica's models still
    unknown: its /v1/models fails (an engine still loading). A request naming llama
    and one naming no model get 503 no_healthy_replica with Retry-After (not 404
    model_not_found or 400, which would send the client away for a model served a
    probe later), and take no seat; once the replica lists llama, it is served."""
    listing = asyncio.Event()

    @web.middleware
    async def loading(request: web.Request, handler: Any) -> web.StreamResponse:
        if request.path == "/v1/models" and not listing.is_set():
            return web.json_response({"error": "loading"}, status=503)
        response: web.StreamResponse = await handler(request)
        return response

    app = web.Application(middlewares=[loading])
    app[REPLICA] = state = ModelReplica(["llama"])
    app.router.add_get("/v1/models", _list)
    app.router.add_get("/health", _health)
    app.router.add_post(COMPLETIONS, _complete)
    server = await aiohttp_server(app)
    config = pooled_config(
        [str(server.make_url("")).rstrip("/")],
        [None],
        tenants={"a": {"api_keys": [KEY_A], "allowed_models": ["llama"]}},
        health={"interval_ms": 50},
    )
    proxy = await start_proxy(config)
    assert proxy.runtime.models.pooled and not proxy.runtime.models.served_models()
    for body in ({"model": "llama", "prompt": "x"}, {"prompt": "x"}):
        resp = await proxy.client.post(COMPLETIONS, json=body, headers=AUTH_A)
        assert resp.status == 503, await resp.text()
        assert resp.headers["X-Admission-Reason"] == "no_healthy_replica"
        assert 1 <= int(resp.headers["Retry-After"]) <= 60
        assert (await resp.json())["error"]["code"] == "no_healthy_replica"
    assert state.bodies == []
    proxy.assert_idle()
    listing.set()
    await wait_for(lambda: proxy.runtime.models.served_models() == {"llama"})
    resp = await proxy.client.post(
        COMPLETIONS, json={"model": "llama", "prompt": "x"}, headers=AUTH_A
    )
    assert resp.status == 200 and state.named() == ["llama"]
    proxy.assert_idle()


async def test_discovery_moves_a_model_between_pools_without_a_reload(
    aiohttp_server: ServerFactory, start_proxy: Start
) -> None:
    """Replicas with models: null are asked on every probe; an adapter that
    appears on one replica and leaves another changes where it is served."""
    url0, first = await start_replica(aiohttp_server, ["llama", "lora-x"])
    url1, second = await start_replica(aiohttp_server, ["qwen"])
    config = pooled_config([url0, url1], [None, None], health={"interval_ms": 20})
    proxy = await start_proxy(config)
    table = proxy.runtime.models
    await wait_for(lambda: table.pool("qwen") == {"r1"} and table.pool("lora-x") == {"r0"})
    resp = await proxy.client.post(
        COMPLETIONS, json={"model": "lora-x", "prompt": "x"}, headers=AUTH_A
    )
    assert resp.status == 200 and first.named() == ["lora-x"]
    first.models, second.models = ["llama"], ["qwen", "lora-x"]
    await wait_for(lambda: table.pool("lora-x") == {"r1"})
    resp = await proxy.client.post(
        COMPLETIONS, json={"model": "lora-x", "prompt": "x"}, headers=AUTH_A
    )
    assert resp.status == 200 and second.named() == ["lora-x"]
    second.models = ["qwen"]
    await wait_for(lambda: not table.pool("lora-x"))
    resp = await proxy.client.post(
        COMPLETIONS, json={"model": "lora-x", "prompt": "x"}, headers=AUTH_A
    )
    assert resp.status == 404 and resp.headers["X-Admission-Reason"] == "model_not_found"
    proxy.assert_idle()


async def test_a_static_replica_is_never_asked_its_models(
    aiohttp_server: ServerFactory, start_proxy: Start
) -> None:
    url0, static = await start_replica(aiohttp_server, ["llama"])
    url1, discovered = await start_replica(aiohttp_server, ["qwen"])
    config = pooled_config([url0, url1], [["llama"], None], health={"interval_ms": 20})
    proxy = await start_proxy(config)
    await wait_for(lambda: discovered.listed >= 3)
    assert static.listed == 0
    assert proxy.runtime.models.pool("qwen") == {"r1"}


async def test_an_idle_pool_does_not_wait_behind_another_pools_queue(
    aiohttp_server: ServerFactory, start_proxy: Start
) -> None:
    """llama's one seat is held and two more llama requests queue; a qwen request
    is served at once, and no llama request ever reaches the qwen replica."""
    proxy, llama, qwen = await two_pools(aiohttp_server, start_proxy)
    llama.gate.clear()
    body = {"model": "llama", "prompt": "x"}
    held = [
        asyncio.create_task(proxy.client.post(COMPLETIONS, json=body, headers=AUTH_A))
        for _ in range(3)
    ]
    dispatcher = proxy.runtime.dispatcher
    await wait_for(lambda: len(dispatcher.scheduler) == 2 and len(llama.bodies) == 1)
    resp = await proxy.client.post(
        COMPLETIONS, json={"model": "qwen", "prompt": "y"}, headers=AUTH_A
    )
    assert resp.status == 200
    assert len(dispatcher.scheduler) == 2
    llama.gate.set()
    for task in held:
        assert (await task).status == 200
    assert llama.named() == ["llama"] * 3 and qwen.named() == ["qwen"]
    proxy.assert_idle()


BUDGETS = BudgetsConfig(queue_ms=1000, first_byte_ms=1000, total_ms=5000)


def two_pool_dispatcher(clock: FakeClock) -> Dispatcher:
    """r0 serves model a, r1 model b, one seat each."""
    replicas = [
        Replica(ReplicaConfig(name=n, url="http://127.0.0.1:1", max_concurrency=1))
        for n in ("r0", "r1")
    ]
    dispatcher = Dispatcher(
        ReplicaPool(replicas),
        FairScheduler({"standard": 1.0}),
        clock,
        {"t": TenantLimits(max_concurrency=None, queue_capacity=64)},
    )
    dispatcher.seats.models = ModelTable({"r0": ("a",), "r1": ("b",)}, {})
    return dispatcher


async def test_dispatcher_grants_only_seats_of_the_tickets_pool() -> None:
    """Fake clock: pool A (r0) flooded; pool B's ticket is granted at once on r1;
    A's backlog drains only onto r0, in order, as its seats come back."""
    clock = FakeClock()
    dispatcher = two_pool_dispatcher(clock)
    deadline = Deadline.start(clock.now(), BUDGETS)
    first = dispatcher.enqueue_in("a", "t", "standard", 1.0, deadline)
    backlog = [dispatcher.enqueue_in("a", "t", "standard", 1.0, deadline) for _ in range(3)]
    assert first.seat is not None and first.seat.replica.name == "r0"
    assert all(t.seat is None for t in backlog)
    other = dispatcher.enqueue_in("b", "t", "standard", 1.0, deadline)
    assert other.seat is not None and other.seat.replica.name == "r1"
    assert all(t.seat is None for t in backlog)  # r1 is b's, not a's
    dispatcher.finish(other, other.seat)
    assert all(t.seat is None for t in backlog)
    dispatcher.finish(first, first.seat)
    assert backlog[0].seat is not None and backlog[0].seat.replica.name == "r0"
    assert backlog[1].seat is None
    for ticket in backlog:
        seat = await dispatcher.wait(ticket)
        assert seat.replica.name == "r0"
        dispatcher.finish(ticket, seat)
    assert dispatcher.pool.total_inflight() == 0 and len(dispatcher.scheduler) == 0


async def test_pools_sharing_a_replica_take_its_seat_in_turn() -> None:
    """Fake clock: r0 serves models a and b with one seat. Tenant t queues five a
    tickets, then tenant u five b tickets; each release frees the one seat, and
    the pools take it in turn (a b a b ...), not pool a until its queue is empty."""
    clock = FakeClock()
    replica = Replica(ReplicaConfig(name="r0", url="http://127.0.0.1:1", max_concurrency=1))
    limits = TenantLimits(max_concurrency=None, queue_capacity=64)
    dispatcher = Dispatcher(
        ReplicaPool([replica]), FairScheduler({"standard": 1.0}), clock, {"t": limits, "u": limits}
    )
    dispatcher.seats.models = ModelTable({"r0": ("a", "b")}, {})
    deadline = Deadline.start(clock.now(), BudgetsConfig(queue_ms=60_000, total_ms=120_000))
    running = dispatcher.enqueue_in("a", "t", "standard", 1.0, deadline)
    queued = {dispatcher.enqueue_in("a", "t", "standard", 1.0, deadline): "a" for _ in range(5)}
    queued |= {dispatcher.enqueue_in("b", "u", "standard", 1.0, deadline): "b" for _ in range(5)}
    order = []
    for _ in range(10):
        clock.advance(1.0)
        assert running.seat is not None
        dispatcher.finish(running, running.seat)
        (running,) = [t for t in queued if t.seat is not None and t.granted_at == clock.now()]
        order.append(queued[running])
    assert order == ["a", "b"] * 5 or order == ["b", "a"] * 5
    assert running.seat is not None
    dispatcher.finish(running, running.seat)
    assert dispatcher.pool.total_inflight() == 0 and len(dispatcher.scheduler) == 0


async def test_headroom_compares_usage_within_the_pool() -> None:
    """Fake clock: r0 serves a, r1 serves b, one seat and one headroom seat each.
    Tenant light has worked only in pool b. Tenant flood, alone in pool a, gets no
    headroom for its second ticket (a lone tenant never does, whatever it did
    elsewhere); light, new to pool a, gets a's headroom seat at once."""
    clock = FakeClock()
    replicas = [
        Replica(ReplicaConfig(name=n, url="http://127.0.0.1:1", max_concurrency=1, headroom=1))
        for n in ("r0", "r1")
    ]
    limits = TenantLimits(max_concurrency=None, queue_capacity=64)
    dispatcher = Dispatcher(
        ReplicaPool(replicas), FairScheduler({"standard": 1.0}), clock,
        {"flood": limits, "light": limits},
    )  # fmt: skip
    dispatcher.seats.models = ModelTable({"r0": ("a",), "r1": ("b",)}, {})
    budgets = BudgetsConfig(queue_ms=60_000, total_ms=120_000)
    for _ in range(6):
        ticket = dispatcher.enqueue_in(
            "b", "light", "standard", 10.0, Deadline.start(clock.now(), budgets)
        )
        clock.advance(0.1)
        assert ticket.seat is not None
        dispatcher.finish(ticket, ticket.seat)
    deadline = Deadline.start(clock.now(), budgets)
    first = dispatcher.enqueue_in("a", "flood", "standard", 10.0, deadline)
    second = dispatcher.enqueue_in("a", "flood", "standard", 10.0, deadline)
    assert first.seat is not None and not first.seat.headroom
    assert second.seat is None  # queued: no headroom for the pool's only tenant
    light = dispatcher.enqueue_in("a", "light", "standard", 10.0, deadline)
    assert light.seat is not None and light.seat.headroom
    assert light.seat.replica.name == "r0"
    for ticket in (first, light):
        assert ticket.seat is not None
        dispatcher.finish(ticket, ticket.seat)
    seat = await dispatcher.wait(second)
    dispatcher.finish(second, seat)
    assert dispatcher.pool.total_inflight() == 0 and len(dispatcher.scheduler) == 0


async def test_a_retry_waiting_in_one_pool_does_not_hold_back_another() -> None:
    """Fake clock: r0 serves a, r1 serves b, one seat each. A retry of pool a waits
    for a seat (r0's is held); a new b ticket of a tenant with no queue room starts at
    once on r1, while a new a ticket still queues behind the retry."""
    clock = FakeClock()
    dispatcher = two_pool_dispatcher(clock)
    dispatcher.set_limits({
        "t": TenantLimits(max_concurrency=None, queue_capacity=64),
        "z": TenantLimits(max_concurrency=None, queue_capacity=0),
    })  # fmt: skip
    deadline = Deadline.start(clock.now(), BUDGETS)
    held = dispatcher.enqueue_in("a", "t", "standard", 1.0, deadline)
    retry = asyncio.create_task(dispatcher.reseat(frozenset({ReplicaName("r0")}), 30.0, "a"))
    await wait_for(lambda: len(dispatcher._reseating) == 1)
    other = dispatcher.enqueue_in("b", "z", "standard", 1.0, deadline)
    assert other.seat is not None and other.seat.replica.name == "r1"
    queued = dispatcher.enqueue_in("a", "t", "standard", 1.0, deadline)
    assert queued.seat is None
    assert held.seat is not None and other.seat is not None
    dispatcher.finish(other, other.seat)
    dispatcher.finish(held, held.seat)  # r0's seat goes to the retry first
    seat = await retry
    assert seat.replica.name == "r0" and queued.seat is None
    dispatcher.release(seat)
    seat = await dispatcher.wait(queued)
    dispatcher.finish(queued, seat)
    assert dispatcher.pool.total_inflight() == 0 and len(dispatcher.scheduler) == 0


def warm_pools(dispatcher: Dispatcher, clock: FakeClock) -> Deadline:
    """Twenty 1 s requests in each of pools a and b (a pool predicts from its
    twentieth seat time on); the deadline of a request arriving now."""
    budgets = BudgetsConfig(queue_ms=60_000, first_byte_ms=1000, total_ms=120_000)
    for _ in range(20):
        for model in ("a", "b"):
            ticket = dispatcher.enqueue_in(
                model, "t", "standard", 1.0, Deadline.start(clock.now(), budgets)
            )
            clock.advance(1.0)
            dispatcher.finish(ticket, ticket.seat)
    return Deadline.start(clock.now(), budgets)


async def test_a_retry_waiting_in_another_pool_is_not_ahead_in_the_prediction() -> None:
    """Fake clock, seat time 1 s, each pool's one seat held: a retry of pool a waits
    for r0. A new a ticket expects two releases (the retry takes the first); a new b
    ticket one, as without the retry, since the retry can never take r1's seat."""
    clock = FakeClock()
    dispatcher = two_pool_dispatcher(clock)
    deadline = warm_pools(dispatcher, clock)
    held = [dispatcher.enqueue_in(m, "t", "standard", 1.0, deadline) for m in ("a", "b")]
    assert all(t.seat is not None for t in held)
    now = clock.now()
    assert dispatcher.predict_wait("t", "standard", now, "b") == pytest.approx(1.0)
    retry = asyncio.create_task(dispatcher.reseat(frozenset({ReplicaName("r0")}), 30.0, "a"))
    await wait_for(lambda: len(dispatcher._reseating) == 1)
    assert dispatcher.predict_wait("t", "standard", now, "a") == pytest.approx(2.0)
    assert dispatcher.predict_wait("t", "standard", now, "b") == pytest.approx(1.0)
    dispatcher.finish(held[0], held[0].seat)
    dispatcher.release(await retry)
    dispatcher.finish(held[1], held[1].seat)
    assert dispatcher.pool.total_inflight() == 0


async def test_predicted_waits_are_the_pools() -> None:
    """Fake clock, seat time 1 s: with pool a's seat held and six a tickets
    queued, a new a ticket expects about seven releases; a new b ticket, behind
    only b's one busy seat, about one, whatever a's backlog."""
    clock = FakeClock()
    dispatcher = two_pool_dispatcher(clock)
    deadline = warm_pools(dispatcher, clock)
    held = [dispatcher.enqueue_in("b", "t", "standard", 1.0, deadline)]
    held += [dispatcher.enqueue_in("a", "t", "standard", 1.0, deadline) for _ in range(7)]
    assert len(dispatcher.scheduler) == 6
    now = clock.now()
    wait_b = dispatcher.predict_wait("t", "standard", now, "b")
    wait_a = dispatcher.predict_wait("t", "standard", now, "a")
    assert wait_b is not None and wait_a is not None
    assert wait_b == pytest.approx(1.0)
    assert wait_a == pytest.approx(7.0)
    assert dispatcher.waits.retry_after_queue_timeout("t", "standard", now, "b") == wait_b
    dispatcher.close()
    for ticket in held:
        if ticket.seat is not None:
            dispatcher.finish(ticket, ticket.seat)


def _predicted_in_b_after(flood_a: bool, *, shared: bool = False) -> float:
    """Tenant t's predicted wait in pool b (seat held, two t tickets queued, seat
    time 1 s) after five seconds in which tenant u kept pool a's one seat busy, or
    did nothing. ``shared``: a and b are served by the same replica (a LoRA adapter
    and its base)."""
    clock = FakeClock()
    replicas = [
        Replica(ReplicaConfig(name=n, url="http://127.0.0.1:1", max_concurrency=1))
        for n in ("r0", "r1")
    ]
    limit = TenantLimits(max_concurrency=None, queue_capacity=64)
    dispatcher = Dispatcher(
        ReplicaPool(replicas), FairScheduler({"standard": 1.0}), clock, {"t": limit, "u": limit}
    )
    lists: dict[str, tuple[str, ...]] = (
        {"r0": ("a", "b"), "r1": ()} if shared else {"r0": ("a",), "r1": ("b",)}
    )
    dispatcher.seats.models = ModelTable(lists, {})
    warm_pools(dispatcher, clock)
    budgets = BudgetsConfig(queue_ms=60_000, first_byte_ms=1000, total_ms=120_000)
    for _ in range(5):
        flood = None
        if flood_a:
            flood = dispatcher.enqueue_in(
                "a", "u", "standard", 1.0, Deadline.start(clock.now(), budgets)
            )
        clock.advance(1.0)
        if flood is not None:
            dispatcher.finish(flood, flood.seat)
    deadline = Deadline.start(clock.now(), budgets)
    held = [dispatcher.enqueue_in("b", "t", "standard", 1.0, deadline) for _ in range(3)]
    assert held[0].seat is not None and len(dispatcher.scheduler) == 2
    wait = dispatcher.predict_wait("t", "standard", clock.now(), "b")
    assert wait is not None
    dispatcher.close()
    dispatcher.finish(held[0], held[0].seat)
    return wait


async def test_another_pools_flood_does_not_lengthen_a_pools_predicted_wait() -> None:
    """Fake clock: tenant u kept pool a's replica busy for the last five seconds.
    Tenant t's predicted wait in pool b, on another replica, is what it is without
    u (three releases of b's one seat: 3 s); counted fleet-wide, u's dispatches
    were taken for a tenant returning to b and halved t's rate (5 s). When a and b
    share the replica, u's work does take b's seat, and the wait grows."""
    alone = _predicted_in_b_after(flood_a=False)
    assert alone == pytest.approx(3.0)
    assert _predicted_in_b_after(flood_a=True) == pytest.approx(alone)
    shared_alone = _predicted_in_b_after(flood_a=False, shared=True)
    assert _predicted_in_b_after(flood_a=True, shared=True) > shared_alone


async def test_each_pools_waits_use_its_own_seat_time() -> None:
    """Fake clock, pool a's requests hold a seat 1 s and pool b's 0.1 s: with each
    pool's seat just taken, a new b ticket expects 0.1 s and a new a ticket 1 s,
    and the Retry-After of each is its own pool's (a fleet-wide mean, 0.55 s,
    made b's five times too long and a's half too short)."""
    clock = FakeClock()
    dispatcher = two_pool_dispatcher(clock)
    budgets = BudgetsConfig(queue_ms=60_000, first_byte_ms=1000, total_ms=120_000)
    for _ in range(25):
        for model, held_s in (("a", 1.0), ("b", 0.1)):
            ticket = dispatcher.enqueue_in(
                model, "t", "standard", 1.0, Deadline.start(clock.now(), budgets)
            )
            clock.advance(held_s)
            dispatcher.finish(ticket, ticket.seat)
    deadline = Deadline.start(clock.now(), budgets)
    held = [dispatcher.enqueue_in(m, "t", "standard", 1.0, deadline) for m in ("a", "b")]
    assert all(t.seat is not None for t in held)
    now = clock.now()
    waits = dispatcher.waits
    assert dispatcher.predict_wait("t", "standard", now, "b") == pytest.approx(0.1)
    assert dispatcher.predict_wait("t", "standard", now, "a") == pytest.approx(1.0)
    assert waits.retry_after_queue_timeout("t", "standard", now, "b") == pytest.approx(0.1)
    assert waits.time_to_free_place("t", "standard", now, "b") == pytest.approx(0.1)
    assert waits.time_to_free_place("t", "standard", now, "a") == pytest.approx(1.0)
    assert waits.seat_time_of("b").mean_s == pytest.approx(0.1)
    assert waits.seat_time_of(None).mean_s == pytest.approx(0.55)  # the fleet's, both pools
    for ticket in held:
        dispatcher.finish(ticket, ticket.seat)


def affinity_dispatcher(clock: FakeClock, replicas: int = 4, seats: int = 4) -> Dispatcher:
    pool = ReplicaPool(
        [
            Replica(ReplicaConfig(name=f"r{i}", url="http://127.0.0.1:1", max_concurrency=seats))
            for i in range(replicas)
        ],
        rng=random.Random(3),
    )
    limits = {"t": TenantLimits(max_concurrency=None, queue_capacity=64)}
    return Dispatcher(pool, FairScheduler({"standard": 1.0}), clock, limits)


def start(dispatcher: Dispatcher, clock: FakeClock, key: int | None, cost: float = 1.0) -> Ticket:
    deadline = Deadline.start(clock.now(), BUDGETS)
    return dispatcher.enqueue_in(None, "t", "standard", cost, deadline, affinity=key)


def replica_of(ticket: Ticket) -> str:
    assert ticket.seat is not None
    return ticket.seat.replica.name


async def test_prefix_affinity_sends_a_key_to_the_same_replica() -> None:
    """The same key lands on the same replica turn after turn; keys spread."""
    clock = FakeClock()
    dispatcher = affinity_dispatcher(clock)
    homes: dict[int, set[str]] = {}
    for _ in range(5):
        for key in range(40):
            ticket = start(dispatcher, clock, key * 0x9E3779B97F4A7C15 % 2**64)
            homes.setdefault(key, set()).add(replica_of(ticket))
            dispatcher.finish(ticket, ticket.seat)
    assert all(len(home) == 1 for home in homes.values())
    assert len(set().union(*homes.values())) == 4


async def test_a_hot_key_spills_within_the_load_bound() -> None:
    """Twelve concurrent requests of one key over four replicas: the preferred
    one takes what the bound allows, the rest spill; none exceeds the bound."""
    clock = FakeClock()
    dispatcher = affinity_dispatcher(clock)
    tickets = [start(dispatcher, clock, 12345) for _ in range(12)]
    loads = [r.inflight for r in dispatcher.pool.replicas]
    ring = list(HashRing(r.name for r in dispatcher.pool.replicas).walk(AffinityKey(12345)))
    # The bound, ceil(1.25 * (in flight + 1) / 4), is 1 for the first three: the
    # second and third spill clockwise; at 2 the fourth goes home, the fifth spills.
    assert [replica_of(t) for t in tickets[:5]] == [ring[0], ring[1], ring[2], ring[0], ring[1]]
    assert sum(loads) == 12
    assert max(loads) <= math.ceil(1.25 * 12 / 4)
    for ticket in tickets:
        dispatcher.finish(ticket, ticket.seat)


def test_every_pool_walks_the_fleets_one_ring_as_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """70 pools (every 4 of 8 replicas: LoRA adapters each on its own replicas), twice
    round: one ring is built for the fleet (a cache of 64 rings per membership was
    rebuilt on every request past 64 pools), and each pool's choice for each key is
    the one its own ring would make."""
    built: list[frozenset[str]] = []

    class Counted(HashRing):
        def __init__(self, names: frozenset[str]) -> None:
            built.append(frozenset(names))
            super().__init__(names)

    monkeypatch.setattr(pools_module, "HashRing", Counted)
    replicas = [
        Replica(ReplicaConfig(name=f"r{i}", url="http://127.0.0.1:1", max_concurrency=4))
        for i in range(8)
    ]
    memberships = [frozenset(c) for c in itertools.combinations([r.name for r in replicas], 4)]
    router = AffinityRouter()
    keys = [AffinityKey(random.Random(seed).getrandbits(64)) for seed in range(5)]
    for _ in range(2):
        for members in memberships:
            for key in keys:
                chosen = router.choose(replicas, members, key)
                own = HashRing(members).choose(key, dict.fromkeys(members, 0.0))
                assert chosen is not None and chosen.name == own
    assert built == [frozenset(r.name for r in replicas)]


async def test_an_unusable_preferred_replica_falls_back() -> None:
    """The key's replica drained: the next on the ring takes the key; with every
    replica full but one, the key goes to the one with a free seat."""
    clock = FakeClock()
    dispatcher = affinity_dispatcher(clock, replicas=3, seats=1)
    ring = list(HashRing(r.name for r in dispatcher.pool.replicas).walk(AffinityKey(777)))
    first = start(dispatcher, clock, 777)
    preferred = replica_of(first)
    assert preferred == ring[0]
    dispatcher.finish(first, first.seat)
    dispatcher.pool.retire(preferred)
    second = start(dispatcher, clock, 777)
    assert replica_of(second) == ring[1]
    third = start(dispatcher, clock, 777)
    assert {replica_of(second), replica_of(third)} == {r.name for r in dispatcher.pool.replicas}
    dispatcher.finish(second, second.seat)
    dispatcher.finish(third, third.seat)


def homed(dispatcher: Dispatcher, home: str, count: int = 1) -> list[int]:
    """``count`` keys whose preferred replica on the ring is ``home``."""
    ring = HashRing(r.name for r in dispatcher.pool.replicas)
    keys = (k * 0x9E3779B97F4A7C15 % 2**64 for k in range(1, 1000))
    return [k for k in keys if next(ring.walk(AffinityKey(k))) == home][:count]


async def test_a_hot_session_spills_once_and_keeps_its_second_replica() -> None:
    """Two replicas; a hot session H and a session S homed on r0, a session T homed on
    r1 (costs: prompt tokens, each turn 60 more). H's turn 2 arrives while turn 1's cold
    prefill runs on r0: it spills to r1 (counted in requests, 1 against 0, it stayed and
    the two prefills shared r0). Both end: H is cached on both. While S's cold first turn
    runs on r0, H's next turns go to r1, where they are cached, and T, cold, still goes
    home to r1 beside them; S stays on r0. Idle again, H keeps to r1, the replica
    whose cache holds the most of its conversation."""
    clock = FakeClock()
    dispatcher = affinity_dispatcher(clock, replicas=2, seats=6)
    hot, s = homed(dispatcher, "r0", 2)
    (t,) = homed(dispatcher, "r1")
    turn1 = start(dispatcher, clock, hot, 2000.0)
    turn2 = start(dispatcher, clock, hot, 2060.0)
    assert (replica_of(turn1), replica_of(turn2)) == ("r0", "r1")
    dispatcher.finish(turn1, turn1.seat)
    dispatcher.finish(turn2, turn2.seat)
    s1 = start(dispatcher, clock, s, 1900.0)
    assert replica_of(s1) == "r0"
    for i in range(3):
        turn = start(dispatcher, clock, hot, 2120.0 + 60.0 * i)
        assert replica_of(turn) == "r1"
        dispatcher.finish(turn, turn.seat)
    running = start(dispatcher, clock, hot, 2300.0)
    t1 = start(dispatcher, clock, t, 1950.0)
    assert (replica_of(running), replica_of(t1)) == ("r1", "r1")
    for ticket in (s1, running, t1):
        dispatcher.finish(ticket, ticket.seat)
    assert repr(dispatcher.seats.affinity.ledger) == (
        "<PrefillLedger 0 in flight, 0 tokens pending, 3 keys warm>"
    )
    # Everyone idle: S and T go home; H stays on r1, which holds more of its history
    # (100 tokens to compute there, 400 on r0, where turn 1 was the last to end).
    homes = [start(dispatcher, clock, key, 2400.0) for key in (hot, s, t)]
    assert [replica_of(ticket) for ticket in homes] == ["r1", "r0", "r1"]
    for ticket in homes:
        dispatcher.finish(ticket, ticket.seat)


async def test_a_turn_arriving_while_the_last_one_runs_counts_cold() -> None:
    """H is cached on r0, where S's cold prefill and H's turn 1 run: turn 2 counts its
    whole prompt on r0 (the slot with H's prompt is busy) and goes to r1. Counted as
    cached, it stayed on r0 and turns piled up cold there."""
    clock = FakeClock()
    dispatcher = affinity_dispatcher(clock, replicas=2, seats=6)
    hot, s = homed(dispatcher, "r0", 2)
    first = start(dispatcher, clock, hot, 2000.0)
    dispatcher.finish(first, first.seat)
    s1 = start(dispatcher, clock, s, 1900.0)
    turn1 = start(dispatcher, clock, hot, 2060.0)
    turn2 = start(dispatcher, clock, hot, 2120.0)
    assert [replica_of(x) for x in (s1, turn1, turn2)] == ["r0", "r0", "r1"]
    for ticket in (s1, turn1, turn2):
        dispatcher.finish(ticket, ticket.seat)


async def test_a_ticket_granted_from_the_queue_counts_its_prompt_work() -> None:
    """Every seat taken, a cold ticket queues; granted when r1 frees, its whole cost is
    pending work on r1 (its key never ran there), and nothing is left once all end."""
    clock = FakeClock()
    dispatcher = affinity_dispatcher(clock, replicas=2, seats=1)
    ledger = dispatcher.seats.affinity.ledger
    a, b = homed(dispatcher, "r0", 2)
    (c,) = homed(dispatcher, "r1")
    cold = start(dispatcher, clock, a, 2000.0)
    other = start(dispatcher, clock, c, 10.0)
    assert (replica_of(cold), replica_of(other)) == ("r0", "r1")
    queued = start(dispatcher, clock, b, 1900.0)
    assert queued.seat is None
    assert (ledger.pending("r0"), ledger.pending("r1")) == (2000.0, 10.0)
    dispatcher.finish(other, other.seat)
    assert replica_of(queued) == "r1"
    assert (ledger.pending("r0"), ledger.pending("r1")) == (2000.0, 1900.0)
    dispatcher.finish(cold, cold.seat)
    dispatcher.finish(queued, queued.seat)
    assert (ledger.pending("r0"), ledger.pending("r1")) == (0.0, 0.0)


async def test_prefix_affinity_end_to_end_by_header(
    aiohttp_server: ServerFactory, start_proxy: Start
) -> None:
    """routing.policy prefix_affinity: one X-Session-Id always reaches one replica."""
    servers = [await start_replica(aiohttp_server, ["m"]) for _ in range(3)]
    config = make_config(
        [url for url, _ in servers], seats=4, routing={"policy": "prefix_affinity"}
    )
    proxy = await start_proxy(config)
    await wait_for(lambda: all(r.serving for r in proxy.runtime.pool.replicas))
    for session in ("alpha", "beta", "gamma", "delta"):
        before = [len(state.bodies) for _, state in servers]
        for turn in range(4):
            resp = await proxy.client.post(
                COMPLETIONS,
                json={"model": "m", "prompt": f"turn {turn}"},
                headers={**AUTH_A, "X-Session-Id": session},
            )
            assert resp.status == 200
        grew = [len(state.bodies) - b for (_, state), b in zip(servers, before, strict=True)]
        assert sorted(grew) == [0, 0, 4], session
    proxy.assert_idle()


async def test_a_pool_with_no_usable_replica_is_named_in_the_refusal(
    aiohttp_server: ServerFactory, start_proxy: Start
) -> None:
    """qwen's only replica drained, llama's serving: a qwen request is 503
    no_healthy_replica whose message names the pool (not "every replica", which
    an operator looking at serving replicas cannot square with the answer)."""
    url0, _ = await start_replica(aiohttp_server, ["llama"])
    url1, _ = await start_replica(aiohttp_server, ["qwen"])
    proxy = await start_proxy(pooled_config([url0, url1], [["llama"], ["qwen"]]))
    await wait_for(lambda: all(r.serving for r in proxy.runtime.pool.replicas))
    assert (await proxy.client.post("/admin/replicas/r1/drain")).status == 200
    resp = await proxy.client.post(COMPLETIONS, json={"model": "qwen"}, headers=AUTH_A)
    assert resp.status == 503 and resp.headers["X-Admission-Reason"] == "no_healthy_replica"
    message = (await resp.json())["error"]["message"]
    assert message == "every replica serving model 'qwen' is ejected or drained"
    seatless = await proxy.client.post("/tokenize", json={"model": "qwen"}, headers=AUTH_A)
    assert seatless.status == 503
    assert (await seatless.json())["error"]["message"] == "no replica of model 'qwen' is serving"
    ok = await proxy.client.post(COMPLETIONS, json={"model": "llama"}, headers=AUTH_A)
    assert ok.status == 200
    proxy.assert_idle()


async def test_every_served_model_has_a_queue_depth_series_before_any_request(
    aiohttp_server: ServerFactory, start_proxy: Start
) -> None:
    """Two pools, nothing sent yet: /metrics has admission_model_queue_depth 0 for each
    (as /admin/state's pools do), so a dashboard, an autoscaler or the load test's
    pool check reads 0, not a missing series, for a pool that never queued."""
    url0, _ = await start_replica(aiohttp_server, ["llama"])
    url1, _ = await start_replica(aiohttp_server, ["qwen"])
    proxy = await start_proxy(pooled_config([url0, url1], [["llama"], ["qwen"]]))
    await wait_for(lambda: all(r.serving for r in proxy.runtime.pool.replicas))
    metrics = await (await proxy.client.get("/metrics")).text()
    assert 'admission_model_queue_depth{model="llama"} 0.0' in metrics
    assert 'admission_model_queue_depth{model="qwen"} 0.0' in metrics


async def test_model_metrics_state_log_and_span(
    aiohttp_server: ServerFactory, start_proxy: Start
) -> None:
    """Per-model request counter and queue depth, pools in /admin/state, the
    access log's model and the span's gen_ai.request.model."""
    url0, llama = await start_replica(aiohttp_server, ["llama"])
    url1, _ = await start_replica(aiohttp_server, ["qwen"])
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    log = io.StringIO()
    config = pooled_config([url0, url1], [["llama"], ["qwen"]], model_aliases={"mini": "llama"})
    proxy = await start_proxy(config, tracer_provider=provider, access_log=log)
    await wait_for(lambda: all(r.serving for r in proxy.runtime.pool.replicas))
    llama.gate.clear()
    held = [
        asyncio.create_task(
            proxy.client.post(COMPLETIONS, json={"model": "mini", "prompt": "x"}, headers=AUTH_A)
        )
        for _ in range(3)
    ]
    await wait_for(lambda: len(proxy.runtime.dispatcher.scheduler) == 2)
    metrics = await (await proxy.client.get("/metrics")).text()
    assert 'admission_model_queue_depth{model="llama"} 2.0' in metrics
    state = await (await proxy.client.get("/admin/state")).json()
    assert state["pools"]["llama"] == {"replicas": ["r0"], "aliases": ["mini"], "queued": 2}
    assert state["pools"]["qwen"]["replicas"] == ["r1"]
    assert state["replicas"]["r0"]["models"] == ["llama"]
    assert state["replicas"]["r1"]["pool"] == "qwen"
    assert "inflight" in state["replicas"]["r0"] and "queued" in state["tenants"]["a"]
    llama.gate.set()
    for task in held:
        assert (await task).status == 200
    resp = await proxy.client.post(COMPLETIONS, json={"model": "gpt-9"}, headers=AUTH_A)
    assert resp.status == 404
    await wait_for(lambda: not proxy.runtime.active)
    metrics = await (await proxy.client.get("/metrics")).text()
    assert 'admission_model_requests_total{model="llama",outcome="completed"} 3.0' in metrics
    assert 'admission_model_requests_total{model="unknown",outcome="rejected"} 1.0' in metrics
    lines = [json.loads(line) for line in log.getvalue().splitlines() if '"request"' in line]
    assert [line["model"] for line in lines if line["path"] == COMPLETIONS] == [
        "llama", "llama", "llama", "gpt-9"
    ]  # fmt: skip
    roots = [s for s in exporter.get_finished_spans() if s.name == "proxy.request"]
    assert len(roots) == 4
    assert sorted(str((s.attributes or {})["gen_ai.request.model"]) for s in roots) == [
        "gpt-9", "llama", "llama", "llama"
    ]  # fmt: skip
    proxy.assert_idle()


async def test_headroom_is_offered_within_the_tickets_pool() -> None:
    """Pool a (r0, one seat plus one headroom) is flooded; a light tenant below its
    fair share gets a's headroom seat on r0, never b's free seats on r1; once that
    is taken it queues in a's pool."""
    clock = FakeClock()
    replicas = [
        Replica(ReplicaConfig(name=n, url="http://127.0.0.1:1", max_concurrency=1, headroom=1))
        for n in ("r0", "r1")
    ]
    limits = {t: TenantLimits(max_concurrency=None, queue_capacity=64) for t in ("flood", "light")}
    dispatcher = Dispatcher(ReplicaPool(replicas), FairScheduler({"standard": 1.0}), clock, limits)
    dispatcher.seats.models = ModelTable({"r0": ("a",), "r1": ("b",)}, {})
    deadline = Deadline.start(clock.now(), BUDGETS)
    flood = [dispatcher.enqueue_in("a", "flood", "standard", 10.0, deadline) for _ in range(4)]
    clock.advance(0.5)
    assert replica_of(flood[0]) == "r0" and len(dispatcher.scheduler) == 3
    light = dispatcher.enqueue_in("a", "light", "standard", 10.0, deadline)
    assert replica_of(light) == "r0" and dispatcher.headroom_grants == 1
    late = dispatcher.enqueue_in("a", "light", "standard", 10.0, deadline)
    assert late.seat is None and dispatcher.pool.get("r1").inflight == 0  # type: ignore[union-attr]
    dispatcher.close()
    for ticket in (flood[0], light):
        dispatcher.finish(ticket, ticket.seat)


async def test_a_reload_changes_aliases_without_a_restart(
    aiohttp_server: ServerFactory, start_proxy: Start
) -> None:
    """model_aliases applied by a reload: the new alias reaches its target at once."""
    url0, llama = await start_replica(aiohttp_server, ["llama"])
    url1, qwen = await start_replica(aiohttp_server, ["qwen"])
    config = pooled_config([url0, url1], [["llama"], ["qwen"]])
    proxy = await start_proxy(config)
    await wait_for(lambda: all(r.serving for r in proxy.runtime.pool.replicas))
    body = {"model": "big", "prompt": "x"}
    resp = await proxy.client.post(COMPLETIONS, json=body, headers=AUTH_A)
    assert resp.status == 404
    reloaded = pooled_config([url0, url1], [["llama"], ["qwen"]], model_aliases={"big": "qwen"})
    proxy.runtime.apply(Rules.from_config(reloaded))
    resp = await proxy.client.post(COMPLETIONS, json=body, headers=AUTH_A)
    assert resp.status == 200 and qwen.named() == ["qwen"] and llama.bodies == []
    proxy.assert_idle()


async def test_prefix_affinity_by_prompt_prefix_end_to_end(
    aiohttp_server: ServerFactory, start_proxy: Start
) -> None:
    """Without the header, the prompt's first affinity_prefix_chars pick the replica:
    requests sharing that prefix (and differing after it) reach one replica."""
    servers = [await start_replica(aiohttp_server, ["m"]) for _ in range(3)]
    routing = {"policy": "prefix_affinity", "affinity_prefix_chars": 16}
    proxy = await start_proxy(make_config([u for u, _ in servers], seats=4, routing=routing))
    await wait_for(lambda: all(r.serving for r in proxy.runtime.pool.replicas))
    for system in ("You are terse.  ", "You are verbose.", "Answer in Dutch.", "Answer in Greek."):
        before = [len(state.bodies) for _, state in servers]
        for question in ("one", "two", "three"):
            resp = await proxy.client.post(
                COMPLETIONS, json={"model": "m", "prompt": system + question}, headers=AUTH_A
            )
            assert resp.status == 200
        grew = [len(state.bodies) - b for (_, state), b in zip(servers, before, strict=True)]
        assert sorted(grew) == [0, 0, 3], system
    proxy.assert_idle()


#: Every default forwarded route a client POSTs a body to (``GET /v1/models`` is the listing).
POST_ROUTES = [route for route in DEFAULT_ROUTES if route != "/v1/models"]


@dataclass
class RouteReplica:
    """A replica answering every default POST route; it keeps ``(path, body)`` of each."""

    models: list[str]
    seen: list[tuple[str, bytes]] = field(default_factory=list)
    listed: int = 0


ROUTE_REPLICA: web.AppKey[RouteReplica] = web.AppKey("route_replica", RouteReplica)


async def _any_route(request: web.Request) -> web.Response:
    body = await request.read()
    if request.headers.get("X-Request-Id") != "admission-warmup":
        request.app[ROUTE_REPLICA].seen.append((request.path, body))
    return web.json_response({"ok": True})


async def _route_list(request: web.Request) -> web.Response:
    state = request.app[ROUTE_REPLICA]
    state.listed += 1
    data = [{"id": m, "object": "model"} for m in state.models]
    return web.json_response({"object": "list", "data": data})


async def start_route_replica(
    aiohttp_server: ServerFactory, models: list[str]
) -> tuple[str, RouteReplica]:
    app = web.Application()
    app[ROUTE_REPLICA] = state = RouteReplica(list(models))
    app.router.add_get("/v1/models", _route_list)
    app.router.add_get("/health", _health)
    for route in POST_ROUTES:
        app.router.add_post(route, _any_route)
    server = await aiohttp_server(app)
    return str(server.make_url("")).rstrip("/"), state


async def route_pools(
    aiohttp_server: ServerFactory, start_proxy: Start
) -> tuple[ProxyUnderTest, RouteReplica, RouteReplica]:
    """``pooled_pair`` of replicas that answer every forwarded route."""
    return await pooled_pair(aiohttp_server, start_proxy, start_route_replica)


async def test_every_forwarded_route_is_routed_and_checked_by_model(
    aiohttp_server: ServerFactory, start_proxy: Start
) -> None:
    """Not only inference routes: on every default POST route (/v1/rerank, llama.cpp's
    /completion, /infill, seatless /tokenize...) the JSON body's model picks the pool,
    allowed_models holds (403, no seat), an unknown model is 404 and an alias is
    rewritten to its target."""
    proxy, llama, qwen = await route_pools(aiohttp_server, start_proxy)
    for route in POST_ROUTES:
        for headers, model, status, reason in (
            (AUTH_B, "llama", 403, "model_not_allowed"),
            (AUTH_B, "mini", 403, "model_not_allowed"),
            (AUTH_A, "gpt-9", 404, "model_not_found"),
        ):
            resp = await proxy.client.post(
                route,
                json={"model": model, "query": "q", "documents": ["d"]},
                headers={**headers, "X-Request-Id": "route-1"},
            )
            assert resp.status == status, (route, model)
            assert resp.headers["X-Admission-Reason"] == reason
            assert resp.headers["X-Request-Id"] == "route-1"
            error = (await resp.json())["error"]
            assert error["code"] == reason and error["type"] == "admission_error"
        assert llama.seen == [] and qwen.seen == [], route
        proxy.assert_idle()
    raw = b'{"model":  "qwen",  "content": "x"}'
    for route in POST_ROUTES:
        for _ in range(4):  # a replica picked at random would miss one in 2 per request
            resp = await proxy.client.post(
                route, data=raw, headers={**AUTH_B, "Content-Type": "application/json"}
            )
            assert resp.status == 200, route
            resp = await proxy.client.post(
                route, json={"model": "mini", "query": "q"}, headers=AUTH_A
            )
            assert resp.status == 200, route
    assert qwen.seen == [(route, raw) for route in POST_ROUTES for _ in range(4)]
    assert [(path, json.loads(body)) for path, body in llama.seen] == [
        (route, {"model": "llama", "query": "q"}) for route in POST_ROUTES for _ in range(4)
    ]
    proxy.assert_idle()


async def test_seatless_tokenize_goes_to_its_pools_replica(
    aiohttp_server: ServerFactory, start_proxy: Start
) -> None:
    """/tokenize and /detokenize take no seat, yet reach a replica serving the model named."""
    proxy, llama, qwen = await route_pools(aiohttp_server, start_proxy)
    for _ in range(8):
        for route in ("/tokenize", "/detokenize"):
            resp = await proxy.client.post(route, json={"model": "qwen"}, headers=AUTH_A)
            assert resp.status == 200
            resp = await proxy.client.post(route, json={"model": "llama"}, headers=AUTH_A)
            assert resp.status == 200
    assert [json.loads(body)["model"] for _, body in qwen.seen] == ["qwen"] * 16
    assert [json.loads(body)["model"] for _, body in llama.seen] == ["llama"] * 16
    assert proxy.runtime.dispatcher.scheduler.depth("a") == 0
    proxy.assert_idle()


FORM = b'--XyZ\r\nContent-Disposition: form-data; name="model"\r\n\r\nqwen\r\n--XyZ--\r\n'
FORM_TYPE = "multipart/form-data; boundary=XyZ"


async def test_a_body_naming_no_model_goes_to_the_only_pool_else_is_refused(
    aiohttp_server: ServerFactory, start_proxy: Start
) -> None:
    """A body without a JSON model (llama.cpp's /completion without model, form data,
    a JSON array, broken JSON) cannot be placed among several pools: 400 bad_request,
    nothing upstream. With one pool it goes there byte for byte, allowed_models still held."""
    proxy, llama, qwen = await route_pools(aiohttp_server, start_proxy)
    bodies = [
        (b'{"prompt": "x"}', "application/json"),
        (FORM, FORM_TYPE),
        (b'[{"model": "qwen"}]', "application/json"),
        (b'{"model": "qwen"', "application/json"),
        (b"", "application/json"),
    ]
    for route in ("/completion", "/v1/rerank", "/tokenize"):
        for body, content_type in bodies:
            resp = await proxy.client.post(
                route, data=body, headers={**AUTH_A, "Content-Type": content_type}
            )
            assert resp.status == 400, (route, body)
            assert resp.headers["X-Admission-Reason"] == "bad_request"
            assert (await resp.json())["error"]["code"] == "bad_request"
    assert llama.seen == [] and qwen.seen == []
    proxy.assert_idle()

    url, only = await start_route_replica(aiohttp_server, ["qwen"])
    tenants = {**TENANTS, "c": {"api_keys": ["sk-c-000000000000"], "allowed_models": ["x"]}}
    one = await start_proxy(pooled_config([url], [None], tenants=tenants))  # c: any name
    await wait_for(lambda: one.runtime.models.served_models() == {"qwen"})
    await wait_for(lambda: all(r.serving for r in one.runtime.pool.replicas))
    for body, content_type in bodies:
        resp = await one.client.post(
            "/v1/rerank", data=body, headers={**AUTH_B, "Content-Type": content_type}
        )
        assert resp.status == 200, body
        resp = await one.client.post(
            "/v1/rerank",
            data=body,
            headers={"Authorization": "Bearer sk-c-000000000000", "Content-Type": content_type},
        )
        assert resp.status == 403, body
        assert resp.headers["X-Admission-Reason"] == "model_not_allowed"
    assert only.seen == [("/v1/rerank", body) for body, _ in bodies]
    one.assert_idle()


async def test_without_pools_any_route_is_forwarded_byte_for_byte(
    aiohttp_server: ServerFactory, start_proxy: Start
) -> None:
    """The single-model deployment parses nothing on other routes: any model name,
    broken JSON and form data reach the replica unchanged (a guard: unchanged behaviour)."""
    url, replica = await start_route_replica(aiohttp_server, ["m"])
    proxy = await start_proxy(make_config([url], seats=1))
    await wait_for(lambda: replica.listed > 0)
    assert not proxy.runtime.models.pooled
    bodies = [
        (b'{"model":  "anything", "query": "q"}', "application/json"),
        (b'{"model": 7', "application/json"),
        (FORM, FORM_TYPE),
    ]
    for route in ("/v1/rerank", "/completion", "/tokenize"):
        for body, content_type in bodies:
            resp = await proxy.client.post(
                route, data=body, headers={**AUTH_A, "Content-Type": content_type}
            )
            assert resp.status == 200, (route, body)
    assert replica.seen == [
        (route, body) for route in ("/v1/rerank", "/completion", "/tokenize") for body, _ in bodies
    ]
    proxy.assert_idle()


def test_a_replica_that_refused_the_turn_sends_the_key_next_on_the_ring() -> None:
    """A key's home refused its tenant the fair turn (shared state): the key goes where
    the ring sends it when its home has no seat, the next replica within the bound, where
    its spills went and its prefix may be cached, not to whichever is least loaded."""
    pool = ReplicaPool(
        [
            Replica(ReplicaConfig(name=f"r{i}", url="http://127.0.0.1:1", max_concurrency=4))
            for i in range(4)
        ],
        rng=random.Random(3),
    )
    seats = PoolSeats(pool)
    key = 0x5EED
    walk = list(HashRing(r.name for r in pool.replicas).walk(AffinityKey(key)))
    by_name = {r.name: r for r in pool.replicas}
    home, second, third, _last = (by_name[ReplicaName(name)] for name in walk)
    second.inflight = third.inflight = 1  # the last is the least loaded
    home.inflight = home.limit
    spilled = seats.choose(None, key)
    assert spilled is second  # the ring's choice with the home full
    home.inflight = 0
    chosen = seats.choose(None, key, avoid=frozenset({home.name}))
    assert chosen is second, f"{chosen} instead of the ring's next, {second}"
    assert seats.choose(None, key) is home  # nothing avoided: home
