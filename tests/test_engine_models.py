"""Model discovery against real engines: two llama-servers serving different model names.

What discovery reads from a real engine, that ``proxy/models.py`` turns it
into the right pools, and the proxy routing by ``model`` (aliases included)
and answering ``GET /v1/models`` over two real servers.
"""

from __future__ import annotations

import contextlib
import io
import json
import urllib.request
from collections.abc import Awaitable, Callable, Iterator

import pytest
import yaml

from bench.real_engine import Engine
from proxy.models import ModelTable, PoolChoice, parse_model_list
from proxy.settings import parse_config
from tests.conftest import ProxyUnderTest
from tests.engine import LlamaServer
from tests.helpers import KEY_A, wait_for

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
    table = proxy.runtime.models
    await wait_for(lambda: len(table.served_models()) == 2, timeout_s=30.0)
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
