"""Model discovery against real engines: two llama-servers serving different model names.

The proxy-level tests (routing by ``model``, ``GET /v1/models`` through the
proxy) come with the request-path wiring; this shows what discovery will read
from a real engine and that ``proxy/models.py`` turns it into the right pools.
"""

from __future__ import annotations

import contextlib
import urllib.request
from collections.abc import Iterator

import pytest

from bench.real_engine import Engine
from proxy.models import ModelTable, PoolChoice, parse_model_list
from tests.engine import LlamaServer

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
