"""Model pools as data: parsing engines' model lists, aliases, pools and tenant access."""

from __future__ import annotations

import json
from typing import Any

import pytest

from proxy.errors import BadRequest, ModelNotAllowed, ModelNotFound
from proxy.models import (
    ModelRefusal,
    ModelTable,
    PoolChoice,
    alias_problems,
    parse_model_list,
    parse_tgi_info,
)
from proxy.settings import config_from_mapping

#: vLLM with ``--enable-lora --lora-modules sql-lora=...``: the adapter is listed with its parent.
VLLM_WITH_LORA = {
    "object": "list",
    "data": [
        {
            "id": "meta-llama/Llama-3.1-8B-Instruct",
            "object": "model",
            "created": 1733000000,
            "owned_by": "vllm",
            "root": "meta-llama/Llama-3.1-8B-Instruct",
            "parent": None,
            "max_model_len": 8192,
            "permission": [],
        },
        {
            "id": "sql-lora",
            "object": "model",
            "created": 1733000000,
            "owned_by": "vllm",
            "root": "/adapters/sql-lora",
            "parent": "meta-llama/Llama-3.1-8B-Instruct",
            "permission": [],
        },
    ],
}
#: llama-server started with ``--alias tiny`` (newer builds add an Ollama-style ``models`` key).
LLAMA_CPP = {
    "models": [{"name": "tiny", "model": "tiny", "type": "model"}],
    "object": "list",
    "data": [{"id": "tiny", "object": "model", "created": 0, "owned_by": "llamacpp", "meta": {}}],
}
SGLANG = {
    "object": "list",
    "data": [{"id": "Qwen/Qwen2.5-7B", "object": "model", "owned_by": "sglang", "root": "x"}],
}


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (VLLM_WITH_LORA, {"meta-llama/Llama-3.1-8B-Instruct", "sql-lora"}),
        (LLAMA_CPP, {"tiny"}),
        (SGLANG, {"Qwen/Qwen2.5-7B"}),
        ({"object": "list", "data": []}, set()),
        ({"object": "list", "data": [{"id": "a"}, {"id": "a"}]}, {"a"}),
    ],
    ids=["vllm-lora", "llama.cpp", "sglang", "empty", "repeated"],
)
def test_model_list_parses_each_engine(body: dict[str, Any], expected: set[str]) -> None:
    """An engine's /v1/models answer: every id, LoRA adapters included, as one set."""
    assert parse_model_list(json.dumps(body).encode()) == frozenset(expected)


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"not json",
        b"\xff\xfe",
        b"[1, 2]",
        b'{"object": "list"}',
        b'{"data": {"id": "a"}}',
        b'{"data": ["a"]}',
        b'{"data": [{"id": "a"}, {"name": "b"}]}',
        b'{"data": [{"id": ""}]}',
        b'{"data": [{"id": 7}]}',
        b"[" * 100_000,
    ],
    ids=[
        "empty",
        "text",
        "bad-utf8",
        "array",
        "no-data",
        "data-object",
        "string-entries",
        "entry-without-id",
        "blank-id",
        "numeric-id",
        "deep-nesting",
    ],
)
def test_model_list_garbage_is_unparsable(body: bytes) -> None:
    """Garbage, or one malformed entry: None (the caller keeps the last known set), no error."""
    assert parse_model_list(body) is None


def test_tgi_info_names_its_one_model() -> None:
    """TGI's /info: its model_id is the model; without one, unparsable."""
    info = {"model_id": "bigscience/bloom-560m", "model_dtype": "torch.float16"}
    assert parse_tgi_info(json.dumps(info)) == frozenset({"bigscience/bloom-560m"})
    assert parse_tgi_info(b'{"model_dtype": "x"}') is None
    assert parse_tgi_info(b"<html>") is None


@pytest.mark.parametrize(
    ("aliases", "static", "expected"),
    [
        ({"mini": "llama-8b"}, {"llama-8b"}, []),
        ({"mini": "qwen"}, None, []),
        ({"mini": "small", "small": "llama-8b"}, None, [("mini",)]),
        ({"m": "m"}, None, [("m",)]),
        ({"mini": "llama-70b"}, {"llama-8b"}, [("mini",)]),
        ({"llama-8b": "qwen"}, {"llama-8b", "qwen"}, [("llama-8b",)]),
        ({"llama-8b": "qwen"}, None, []),
    ],
    ids=[
        "served-target",
        "discovered-later",
        "chain",
        "self",
        "unserved-target",
        "shadows-static",
        "shadow-allowed-with-discovery",
    ],
)
def test_alias_problems(
    aliases: dict[str, str], static: set[str] | None, expected: list[tuple[str, ...]]
) -> None:
    """Aliases in, the alias keys with a problem out."""
    assert [loc for loc, _ in alias_problems(aliases, static)] == expected


def _table() -> ModelTable:
    """gpu-0 and gpu-1 serve llama-8b statically; gpu-2 discovers (a base and a LoRA)."""
    table = ModelTable(
        {"gpu-0": ("llama-8b",), "gpu-1": ("llama-8b",), "gpu-2": None},
        {"gpt-4o-mini": "llama-8b", "coder": "qwen-7b"},
    )
    table.update("gpu-2", frozenset({"qwen-7b", "sql-lora"}))
    return table


@pytest.mark.parametrize(
    ("model", "allowed", "expected"),
    [
        ("llama-8b", None, PoolChoice("llama-8b", frozenset({"gpu-0", "gpu-1"}))),
        ("gpt-4o-mini", None, PoolChoice("llama-8b", frozenset({"gpu-0", "gpu-1"}))),
        ("sql-lora", None, PoolChoice("sql-lora", frozenset({"gpu-2"}))),
        ("coder", ["qwen-7b"], PoolChoice("qwen-7b", frozenset({"gpu-2"}))),
        ("llama-8b", ["gpt-4o-mini"], PoolChoice("llama-8b", frozenset({"gpu-0", "gpu-1"}))),
        ("llama-70b", None, "model_not_found"),
        ("llama-70b", [], "model_not_found"),
        ("qwen-7b", ["llama-8b"], "model_not_allowed"),
        ("coder", ["gpt-4o-mini"], "model_not_allowed"),
        ("sql-lora", ["qwen-7b"], "model_not_allowed"),
        (None, None, "bad_request"),
        (7, None, "bad_request"),
        (["llama-8b"], None, "bad_request"),
    ],
    ids=[
        "model",
        "alias",
        "lora-adapter",
        "alias-allowed-by-target",
        "target-allowed-by-alias",
        "unknown",
        "unknown-before-not-allowed",
        "not-allowed",
        "alias-of-other-model",
        "adapter-is-its-own-model",
        "missing-with-three-pools",
        "number",
        "list",
    ],
)
def test_select_pool_or_refusal(
    model: object, allowed: list[str] | None, expected: PoolChoice | str
) -> None:
    """A body's model and the tenant's allowed_models in; the pool, or the refusal reason, out."""
    result = _table().select(model, allowed=allowed)
    if isinstance(expected, PoolChoice):
        assert result == expected
    else:
        assert isinstance(result, ModelRefusal)
        assert result.reason == expected


def test_missing_model_picks_the_only_pool() -> None:
    """One model served by every replica: a body without model goes to that pool; the tenant's
    allow-list still applies."""
    table = ModelTable({"a": ("tiny",), "b": None}, {})
    table.update("b", frozenset({"tiny"}))
    assert table.select(None, allowed=None) == PoolChoice("tiny", frozenset({"a", "b"}))
    refusal = table.select(None, allowed=["other"])
    assert isinstance(refusal, ModelRefusal) and refusal.reason == "model_not_allowed"


def test_refusals_map_to_the_error_tree() -> None:
    """Each refusal reason becomes its errors.py class, with status and reason code."""
    table = _table()
    cases = [
        (table.select("nope", allowed=None), ModelNotFound, 404),
        (table.select("qwen-7b", allowed=["llama-8b"]), ModelNotAllowed, 403),
        (table.select(None, allowed=None), BadRequest, 400),
    ]
    for refusal, cls, status in cases:
        assert isinstance(refusal, ModelRefusal)
        error = refusal.error()
        assert type(error) is cls
        assert (error.status, error.reason) == (status, refusal.reason)


def test_discovery_changes_membership_without_reload() -> None:
    """A discovering replica's set replaces the last one: an adapter appearing or disappearing
    reports a change and moves pools; the same set again, or garbage, changes nothing."""
    table = ModelTable({"gpu-0": None}, {})
    assert table.pool("base") == frozenset()
    assert table.update("gpu-0", frozenset({"base"})) is True
    assert table.update("gpu-0", frozenset({"base", "lora-a"})) is True
    assert table.pool("lora-a") == frozenset({"gpu-0"})
    assert table.update("gpu-0", frozenset({"base", "lora-a"})) is False
    assert table.update("gpu-0", None) is False
    assert table.pool("lora-a") == frozenset({"gpu-0"})
    assert table.update("gpu-0", frozenset({"base"})) is True
    assert table.pool("lora-a") == frozenset()
    assert repr(table) == "<ModelTable 1 replicas, 0 aliases; base: 1>"


def test_static_models_win_over_discovery() -> None:
    """A replica with configured models ignores what its /v1/models says."""
    table = ModelTable({"gpu-0": ("llama-8b",)}, {})
    assert table.update("gpu-0", frozenset({"something-else"})) is False
    assert table.models_of("gpu-0") == frozenset({"llama-8b"})


def test_forget_removes_a_replica_from_its_pools() -> None:
    """A replica removed by a reload leaves every pool it was in."""
    table = _table()
    assert table.forget("gpu-2") is True
    assert table.pool("qwen-7b") == frozenset()
    assert table.forget("gpu-2") is False


def test_discovered_model_shadows_an_alias() -> None:
    """A replica starts serving a model named like an alias: the name reaches the real model,
    and the alias is reported as shadowed."""
    table = _table()
    assert table.pool("coder") == frozenset({"gpu-2"})
    table.update("gpu-1", frozenset({"coder"}))  # static: ignored
    assert table.shadowed_aliases() == frozenset()
    table.update("gpu-2", frozenset({"qwen-7b", "coder"}))
    assert table.shadowed_aliases() == frozenset({"coder"})
    assert table.select("coder", allowed=None) == PoolChoice("coder", frozenset({"gpu-2"}))


@pytest.mark.parametrize(
    ("allowed", "healthy", "expected"),
    [
        (None, None, ["coder", "gpt-4o-mini", "llama-8b", "qwen-7b", "sql-lora"]),
        (["gpt-4o-mini"], None, ["gpt-4o-mini", "llama-8b"]),
        (["qwen-7b", "sql-lora"], None, ["coder", "qwen-7b", "sql-lora"]),
        ([], None, []),
        (None, {"gpu-0"}, ["gpt-4o-mini", "llama-8b"]),
        (None, {"gpu-2"}, ["coder", "qwen-7b", "sql-lora"]),
        (["llama-8b"], {"gpu-2"}, []),
    ],
    ids=[
        "everything",
        "alias-allows-target",
        "models-bring-aliases",
        "nothing",
        "healthy-only",
        "aliases-follow-health",
        "allowed-but-down",
    ],
)
def test_models_for_tenant(
    allowed: list[str] | None, healthy: set[str] | None, expected: list[str]
) -> None:
    """The names /v1/models lists: served models of healthy replicas plus aliases to them,
    filtered by the tenant's allow-list."""
    assert _table().models_for_tenant(allowed, healthy) == expected


def test_list_response_is_openai_format() -> None:
    """/v1/models for a tenant: an OpenAI list object, one model entry per name."""
    body = _table().list_response(["gpt-4o-mini"], None)
    assert body == {
        "object": "list",
        "data": [
            {"id": "gpt-4o-mini", "object": "model", "created": 0, "owned_by": "admission-proxy"},
            {"id": "llama-8b", "object": "model", "created": 0, "owned_by": "admission-proxy"},
        ],
    }
    assert parse_model_list(json.dumps(body)) == frozenset({"gpt-4o-mini", "llama-8b"})


def test_table_from_config() -> None:
    """A config with one static and one discovering replica and an alias: the static replica
    is in its pool at once, the other in none until discovered."""
    config = config_from_mapping(
        {
            "replicas": [
                {"name": "a", "url": "http://h:1", "max_concurrency": 1, "models": ["llama-8b"]},
                {"name": "b", "url": "http://h:2", "max_concurrency": 1},
            ],
            "model_aliases": {"mini": "llama-8b"},
            "tenants": {"acme": {"api_keys": ["k"]}},
        }
    )
    table = ModelTable.from_config(config.replicas, config.model_aliases)
    assert table.select("mini", allowed=None) == PoolChoice("llama-8b", frozenset({"a"}))
    assert table.models_of("b") == frozenset()
    assert table.update("b", frozenset({"llama-8b"})) is True
    assert table.pool("llama-8b") == frozenset({"a", "b"})
