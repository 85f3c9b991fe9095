"""The config model: defaults, every validation rule with its YAML path, sources, dumps."""

from __future__ import annotations

import copy
import hashlib
import io
import os
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from proxy.cli import EXIT_INVALID, EXIT_OK, check_config
from proxy.config_errors import _PATTERNS
from proxy.settings import (
    DEFAULT_RETRY_ON,
    BudgetsConfig,
    Config,
    ConfigError,
    ConfigIssue,
    TenantConfig,
    dump_effective_config,
    hash_api_key,
    load_config,
    parse_config,
)

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "config" / "example.yaml"
DEMO = REPO / "config" / "demo.yaml"

SHA_OF_SK_1 = hashlib.sha256(b"sk-1").hexdigest()
DELETE = object()

#: The smallest valid config: one replica, one tenant.
BASE: dict[str, Any] = {
    "replicas": [{"name": "gpu-0", "url": "http://127.0.0.1:9001", "max_concurrency": 8}],
    "tenants": {"acme": {"api_keys": ["sk-acme-1"]}},
}

#: The top-level keys in the order of docs/REFERENCE.md.
REFERENCE_KEY_ORDER = [
    "server",
    "admin",
    "replicas",
    "model_aliases",
    "routing",
    "health",
    "warmup",
    "saturation",
    "gpu",
    "budgets",
    "timeouts",
    "retry",
    "priorities",
    "telemetry",
    "state",
    "mode",
    "overload",
    "config_history",
    "routes",
    "anonymous",
    "tenants",
]


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """No ADMISSION_* variable of the developer's shell leaks into a test."""
    for name in list(os.environ):
        if name.upper().startswith("ADMISSION_"):
            monkeypatch.delenv(name)


def _merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    """``base`` updated in depth; an empty dict replaces, ``DELETE`` removes the key."""
    merged = copy.deepcopy(base)
    for key, value in update.items():
        if value is DELETE:
            merged.pop(key, None)
        elif value and isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def _text(update: dict[str, Any] | None = None) -> str:
    return yaml.safe_dump(_merge(BASE, update or {}), sort_keys=False)


def _parse(update: dict[str, Any] | None = None) -> Config:
    return parse_config(_text(update))


def _issues(text: str) -> dict[str, str]:
    with pytest.raises(ConfigError) as caught:
        parse_config(text)
    return {issue.path: issue.message for issue in caught.value.issues}


def _lookup(node: Any, path: str) -> Any:
    for part in path.split("."):
        node = node[part] if isinstance(node, dict) else getattr(node, part)
    return node


# --- defaults --------------------------------------------------------------

#: The default allow-list, as docs/DEPLOYMENT.md lists it.
DEFAULT_ROUTES_AS_DOCUMENTED = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/embeddings",
    "/v1/models",
    "/v1/rerank",
    "/generate",
    "/generate_stream",
    "/tokenize",
    "/detokenize",
    "/completion",
    "/completions",
    "/embedding",
    "/embeddings",
    "/infill",
    "/rerank",
)


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("server.host", "0.0.0.0"),
        ("server.port", 8080),
        ("server.max_body_bytes", 1_048_576),
        ("server.entrance_ms", 5000),
        ("server.shutdown_grace_ms", 25000),
        ("admin.token_env", "ADMISSION_ADMIN_TOKEN"),
        ("health.path", "/health"),
        ("health.interval_ms", 2000),
        ("health.eject_after_failures", 3),
        ("health.eject_ms", 5000),
        ("warmup.requests", 1),
        ("saturation.max_waiting", None),
        ("saturation.max_kv_cache", None),
        ("saturation.stale_ms", 2000),
        ("gpu.memory_guard", None),
        ("gpu.sample_ms", 1000),
        ("budgets.queue_ms", 2000),
        ("budgets.first_byte_ms", 10000),
        ("budgets.total_ms", 60000),
        ("timeouts.connect_ms", 1000),
        ("timeouts.idle_ms", 15000),
        ("timeouts.cancel_grace_ms", 1000),
        ("retry.max_attempts", 2),
        ("retry.base_backoff_ms", 200),
        ("retry.max_backoff_ms", 2000),
        ("retry.jitter", "full"),
        ("retry.retry_on", ("connect_error", "connect_timeout", "http_429", "http_503")),
        ("retry.budget_ratio", 0.2),
        ("retry.min_retries_per_s", 3),
        ("priorities.interactive.weight", 8),
        ("priorities.standard.weight", 3),
        ("priorities.batch.weight", 1),
        ("telemetry.max_tenant_labels", 100),
        ("routes", DEFAULT_ROUTES_AS_DOCUMENTED),
        ("anonymous", "reject"),
        ("tenants.acme.priority", "standard"),
        ("tenants.acme.allowed_priorities", None),
        ("tenants.acme.weight", 1),
        ("tenants.acme.max_concurrency", None),
        ("tenants.acme.queue_capacity", 64),
        ("tenants.acme.rate_per_s", None),
        ("tenants.acme.burst", None),
        ("tenants.acme.budgets.queue_ms", None),
        ("tenants.acme.budgets.first_byte_ms", None),
        ("tenants.acme.budgets.total_ms", None),
    ],
)
def test_defaults_match_design(path: str, expected: object) -> None:
    """Minimal config (one replica, one tenant): every omitted key has the documented default."""
    assert _lookup(_parse(), path) == expected


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("metrics_url", None),
        ("api_key_env", None),
        ("ca_file", None),
        ("gpu_index", None),
    ],
)
def test_replica_defaults(path: str, expected: object) -> None:
    """A replica given name, url and seats only: its optional keys default to null."""
    assert getattr(_parse().replicas[0], path) == expected


def test_replica_url_is_stored_without_trailing_slash() -> None:
    """A URL with a trailing slash and a path prefix: kept without the slash."""
    replicas = [{"name": "a", "url": "https://gpu.internal:8443/v/", "max_concurrency": 1}]
    assert _parse({"replicas": replicas}).replicas[0].url == "https://gpu.internal:8443/v"


def test_routes_open_more_paths_or_every_path() -> None:
    """routes given: kept as written; "/" (everything) and a new prefix are valid entries."""
    assert _parse({"routes": ["/", "/v1/audio"]}).routes == ("/", "/v1/audio")


def test_config_is_frozen() -> None:
    """Assigning to a loaded config or section fails: config is immutable at runtime."""
    config = _parse()
    with pytest.raises(ValidationError):
        config.server.port = 1  # type: ignore[misc]
    with pytest.raises(ValidationError):
        config.anonymous = "acme"  # type: ignore[misc]


# --- validation: every rule, at its YAML path --------------------------------

INVALID_CASES: list[tuple[str, dict[str, Any], dict[str, str]]] = [
    ("unknown top-level key", {"bogus": 1}, {"bogus": "unknown key"}),
    ("unknown nested key", {"server": {"prot": 1}}, {"server.prot": "unknown key"}),
    (
        "unknown replica key",
        {"replicas": [{**BASE["replicas"][0], "seats": 2}]},
        {"replicas[0].seats": "unknown key"},
    ),
    ("wrong type", {"server": {"port": "http"}}, {"server.port": "valid integer"}),
    ("wrong type for section", {"server": 5}, {"server": "valid dictionary"}),
    (
        "replica name with a space (the rule in words, not a regular expression)",
        {"replicas": [{**BASE["replicas"][0], "name": "gpu 0"}]},
        {"replicas[0].name": "1 to 64 letters, digits, '_', '.' or '-', starting with a"},
    ),
    (
        "tenant name with a space: the key is named as a key",
        {"tenants": {"be ta": {"api_keys": ["k-9"]}}},
        {"tenants['be ta'] (key)": "1 to 64 letters, digits"},
    ),
    (
        "alias name empty",
        {"model_aliases": {"": "llama-8b"}},
        {"model_aliases[''] (key)": "at least 1 character"},
    ),
    (
        "one name where a list is wanted",
        {"replicas": [{**BASE["replicas"][0], "models": "llama-8b"}]},
        {"replicas[0].models": "input should be a list, such as [llama-8b]"},
    ),
    ("port out of range", {"server": {"port": 70000}}, {"server.port": "less than or equal"}),
    ("zero body limit", {"server": {"max_body_bytes": 0}}, {"server.max_body_bytes": "greater"}),
    ("replicas missing", {"replicas": DELETE}, {"replicas": "required"}),
    ("replicas empty", {"replicas": []}, {"replicas": "at least one replica"}),
    ("tenants missing", {"tenants": DELETE}, {"tenants": "required"}),
    ("tenants empty", {"tenants": {}}, {"tenants": "at least one tenant"}),
    (
        "duplicate replica name",
        {"replicas": [BASE["replicas"][0], {**BASE["replicas"][0], "url": "http://h:2"}]},
        {"replicas[1].name": "duplicate replica name"},
    ),
    (
        "replica url not http",
        {"replicas": [{**BASE["replicas"][0], "url": "ftp://h"}]},
        {"replicas[0].url": "http:// or https://"},
    ),
    (
        "replica url without host",
        {"replicas": [{**BASE["replicas"][0], "url": "http://"}]},
        {"replicas[0].url": "with a host"},
    ),
    (
        "replica without seats",
        {"replicas": [{**BASE["replicas"][0], "max_concurrency": 0}]},
        {"replicas[0].max_concurrency": "greater than or equal to 1"},
    ),
    (
        "negative gpu index",
        {"replicas": [{**BASE["replicas"][0], "gpu_index": -1}]},
        {"replicas[0].gpu_index": "greater than or equal to 0"},
    ),
    ("health path", {"health": {"path": "health"}}, {"health.path": 'start with "/"'}),
    (
        "ejection",
        {"health": {"eject_after_failures": 0}},
        {"health.eject_after_failures": "greater"},
    ),
    ("kv ratio", {"saturation": {"max_kv_cache": 1.5}}, {"saturation.max_kv_cache": "less"}),
    ("memory guard", {"gpu": {"memory_guard": -0.1}}, {"gpu.memory_guard": "greater"}),
    (
        "global queue above total",
        {"budgets": {"queue_ms": 70000}},
        {"budgets.queue_ms": "queue_ms (70000) is above total_ms (60000)"},
    ),
    (
        "global first byte above total",
        {"budgets": {"first_byte_ms": 1000, "total_ms": 500, "queue_ms": 100}},
        {"budgets.first_byte_ms": "above total_ms (500)"},
    ),
    (
        "tenant queue above merged total",
        {"tenants": {"acme": {"budgets": {"queue_ms": 61000}}}},
        {"tenants.acme.budgets.queue_ms": "merged queue_ms (61000) is above total_ms (60000)"},
    ),
    (
        "tenant total below merged first byte",
        {"tenants": {"acme": {"budgets": {"total_ms": 5000}}}},
        {"tenants.acme.budgets.total_ms": "merged first_byte_ms (10000) is above total_ms"},
    ),
    (
        "global queue plus first byte above total",
        {"budgets": {"queue_ms": 3000, "first_byte_ms": 8000, "total_ms": 10000}},
        {"budgets.total_ms": "queue_ms + first_byte_ms (3000 + 8000 = 11000) is above total_ms"},
    ),
    (
        "tenant total below merged queue plus first byte",
        {"tenants": {"acme": {"budgets": {"total_ms": 11000}}}},
        {"tenants.acme.budgets.total_ms": "merged queue_ms + first_byte_ms (2000 + 10000"},
    ),
    (
        "tenant first byte fills its merged total",
        {"tenants": {"acme": {"budgets": {"first_byte_ms": 59000}}}},
        {"tenants.acme.budgets.first_byte_ms": "(2000 + 59000 = 61000) is above total_ms (60000)"},
    ),
    (
        "tenant queue fills its merged total",
        {"tenants": {"acme": {"budgets": {"queue_ms": 55000}}}},
        {"tenants.acme.budgets.queue_ms": "merged queue_ms + first_byte_ms"},
    ),
    ("route without slash", {"routes": ["v1/audio"]}, {"routes[0]": 'start with "/"'}),
    ("route with dots", {"routes": ["/v1", "/v1/../admin"]}, {"routes[1]": "normalised"}),
    ("route with //", {"routes": ["/v1//models"]}, {"routes[0]": "normalised"}),
    ("route trailing slash", {"routes": ["/v1/"]}, {"routes[0]": 'must not end with "/"'}),
    ("route escape", {"routes": ["/v1%2Fx"]}, {"routes[0]": "no %, ? or #"}),
    ("route query", {"routes": ["/v1?x=1"]}, {"routes[0]": "no %, ? or #"}),
    ("route reserved", {"routes": ["/admin/config"]}, {"routes[0]": "never forwarded"}),
    ("route reserved metrics", {"routes": ["/metrics"]}, {"routes[0]": "never forwarded"}),
    ("no routes", {"routes": []}, {"routes": "at least one route"}),
    ("jitter", {"retry": {"jitter": "some"}}, {"retry.jitter": "'full', 'equal' or 'none'"}),
    ("retry class", {"retry": {"retry_on": ["http_418"]}}, {"retry.retry_on[0]": "http_429"}),
    ("attempts", {"retry": {"max_attempts": 0}}, {"retry.max_attempts": "greater"}),
    ("retry ratio", {"retry": {"budget_ratio": -1}}, {"retry.budget_ratio": "greater"}),
    (
        "backoff order",
        {"retry": {"base_backoff_ms": 500, "max_backoff_ms": 100}},
        {"retry.max_backoff_ms": "below base_backoff_ms"},
    ),
    ("state backend", {"state": {"backend": "etcd"}}, {"state.backend": "'local' or 'redis'"}),
    (
        "replica models empty",
        {"replicas": [{**BASE["replicas"][0], "models": []}]},
        {"replicas[0].models": "at least one model, or null"},
    ),
    (
        "replica model listed twice",
        {"replicas": [{**BASE["replicas"][0], "models": ["a", "b", "a"]}]},
        {"replicas[0].models": "model listed twice: a"},
    ),
    (
        "replica model name with spaces around",
        {"replicas": [{**BASE["replicas"][0], "models": [" a"]}]},
        {"replicas[0].models[0]": "a model name may not start or end with whitespace"},
    ),
    ("routing policy", {"routing": {"policy": "random"}}, {"routing.policy": "'least_loaded' or"}),
    (
        "routing prefix chars",
        {"routing": {"affinity_prefix_chars": 0}},
        {"routing.affinity_prefix_chars": "greater than 0"},
    ),
    (
        "routing load factor below one",
        {"routing": {"max_load_factor": 0.9}},
        {"routing.max_load_factor": "greater than or equal to 1"},
    ),
    (
        "routing header not a header name",
        {"routing": {"affinity_header": "X Session"}},
        {"routing.affinity_header": "a header name: letters, digits and !#$%&'*+.^_`|~-"},
    ),
    ("routing unknown key", {"routing": {"policy_x": 1}}, {"routing.policy_x": "unknown key"}),
    (
        "alias chain",
        {"model_aliases": {"mini": "small", "small": "llama-8b"}},
        {"model_aliases.mini": "'small' is itself an alias"},
    ),
    ("alias to itself", {"model_aliases": {"m": "m"}}, {"model_aliases.m": "may not name itself"}),
    (
        "alias target not served by static replicas",
        {
            "replicas": [{**BASE["replicas"][0], "models": ["llama-8b"]}],
            "model_aliases": {"mini": "llama-70b"},
        },
        {"model_aliases.mini": "'llama-70b' is not served by any replica (models listed"},
    ),
    (
        "alias shadows a static model",
        {
            "replicas": [{**BASE["replicas"][0], "models": ["llama-8b", "qwen"]}],
            "model_aliases": {"qwen": "llama-8b"},
        },
        {"model_aliases.qwen": "shadows a model a replica lists"},
    ),
    ("alias empty target", {"model_aliases": {"m": ""}}, {"model_aliases.m": "at least 1"}),
    (
        "allowed model empty",
        {"tenants": {"acme": {"allowed_models": ["llama-8b", ""]}}},
        {"tenants.acme.allowed_models[1]": "at least 1 character"},
    ),
    (
        "allowed models not a list",
        {"tenants": {"acme": {"allowed_models": "llama-8b"}}},
        {"tenants.acme.allowed_models": "input should be a list, such as [llama-8b]"},
    ),
    (
        "allowed model served by no static replica and no alias",
        {
            "replicas": [{**BASE["replicas"][0], "models": ["llama-8b"]}],
            "model_aliases": {"mini": "llama-8b"},
            "tenants": {"acme": {"allowed_models": ["mini", "llama-70b"]}},
        },
        {
            "tenants.acme.allowed_models[1]": (
                "'llama-70b' is neither a model a replica lists nor an alias (models listed"
            )
        },
    ),
    (
        "state failure mode",
        {"state": {"on_failure": "allow"}},
        {"state.on_failure": "'local_share' or 'reject'"},
    ),
    ("state lease", {"state": {"lease_ms": 0}}, {"state.lease_ms": "greater than 0"}),
    ("state timeout", {"state": {"timeout_ms": -5}}, {"state.timeout_ms": "greater than 0"}),
    (
        "state url scheme",
        {"state": {"redis_url": "http://r:6379"}},
        {"state.redis_url": "redis://"},
    ),
    ("state url port", {"state": {"redis_url": "redis://r:99999/0"}}, {"state.redis_url": "port"}),
    ("state hash tag", {"state": {"key_prefix": "a{b}:"}}, {"state.key_prefix": "no '{' or '}'"}),
    ("no classes", {"priorities": {}}, {"priorities": "at least one priority class"}),
    (
        "class weight",
        {"priorities": {"standard": {"weight": 0}}},
        {"priorities.standard.weight": "greater than 0"},
    ),
    ("tenant labels", {"telemetry": {"max_tenant_labels": 0}}, {"telemetry.max_tenant_labels": ""}),
    (
        "duplicate key across tenants",
        {"tenants": {"beta": {"api_keys": ["sk-acme-1"]}}},
        {"tenants.beta.api_keys[0]": "duplicate API key (see tenants.acme.api_keys[0])"},
    ),
    (
        "duplicate key within a tenant",
        {"tenants": {"acme": {"api_keys": ["sk-1", "sk-1"]}}},
        {"tenants.acme.api_keys[1]": "duplicate API key"},
    ),
    (
        "plain key and its sha256 entry",
        {"tenants": {"acme": {"api_keys": ["sk-1"]}, "b": {"api_keys": [f"sha256:{SHA_OF_SK_1}"]}}},
        {"tenants.b.api_keys[0]": "duplicate API key (see tenants.acme.api_keys[0])"},
    ),
    (
        "sha256 entry not 64 hex",
        {"tenants": {"acme": {"api_keys": ["sha256:abc"]}}},
        {"tenants.acme.api_keys[0]": "64 hexadecimal"},
    ),
    (
        "empty key",
        {"tenants": {"acme": {"api_keys": ["ok", ""]}}},
        {"tenants.acme.api_keys[1]": "non-empty"},
    ),
    (
        "unknown default class",
        {"tenants": {"acme": {"priority": "gold"}}},
        {"tenants.acme.priority": "'gold': unknown priority class"},
    ),
    (
        "unknown allowed class",
        {"tenants": {"acme": {"allowed_priorities": ["standard", "gold"]}}},
        {"tenants.acme.allowed_priorities[1]": "unknown priority class"},
    ),
    (
        "default class removed with priorities",
        {"priorities": {"gold": {"weight": 1}}},
        {
            "tenants.acme.priority": "'standard' (the default, as the tenant names none): "
            "unknown priority class (configured: gold)"
        },
    ),
    ("anonymous unknown", {"anonymous": "ghost"}, {"anonymous": '"reject" or the name'}),
    (
        "tenant without keys",
        {"tenants": {"beta": {"priority": "batch"}}},
        {"tenants.beta.api_keys": "only the anonymous tenant"},
    ),
    ("tenant weight", {"tenants": {"acme": {"weight": 0}}}, {"tenants.acme.weight": "greater"}),
    (
        "queue capacity",
        {"tenants": {"acme": {"queue_capacity": -1}}},
        {"tenants.acme.queue_capacity": "greater than or equal to 0"},
    ),
    ("rate", {"tenants": {"acme": {"rate_per_s": 0}}}, {"tenants.acme.rate_per_s": "greater"}),
    (
        "burst below one",
        {"tenants": {"acme": {"rate_per_s": 5, "burst": 0.5}}},
        {"tenants.acme.burst": "greater than or equal to 1"},
    ),
    (
        "burst without rate",
        {"tenants": {"acme": {"burst": 5}}},
        {"tenants.acme.burst": "no effect without rate_per_s"},
    ),
    (
        "unknown tenant key",
        {"tenants": {"acme": {"max_inflight": 5}}},
        {"tenants.acme.max_inflight": "unknown key"},
    ),
    (
        "unknown budget key",
        {"tenants": {"acme": {"budgets": {"idle_ms": 5}}}},
        {"tenants.acme.budgets.idle_ms": "unknown key"},
    ),
]


@pytest.mark.parametrize(
    ("update", "expected"),
    [pytest.param(update, expected, id=name) for name, update, expected in INVALID_CASES],
)
def test_invalid_config_reports_exact_paths(
    update: dict[str, Any], expected: dict[str, str]
) -> None:
    """Minimal config with one mistake: ConfigError naming exactly that YAML path."""
    issues = _issues(_text(update))
    assert set(issues) == set(expected), issues
    for path, fragment in expected.items():
        assert fragment in issues[path], (path, issues[path])


def test_every_error_is_reported_at_once() -> None:
    """Field errors and cross-field rules in several sections: all reported in one pass."""
    update = {
        "bogus": True,
        "server": {"port": 0},
        "replicas": [
            BASE["replicas"][0],
            {**BASE["replicas"][0], "url": "http://h:2"},
            {"name": "gpu-2", "url": "ftp://h", "max_concurrency": 1},
        ],
        "anonymous": "ghost",
        "tenants": {
            "acme": {"priority": "gold"},
            "beta": {"api_keys": ["sk-acme-1"], "weight": -1},
            "gamma": {"api_keys": ["sk-acme-1"]},
        },
    }
    issues = _issues(_text(update))
    assert set(issues) == {
        "bogus",
        "server.port",
        "replicas[1].name",
        "replicas[2].url",
        "anonymous",
        "tenants.acme.priority",
        "tenants.beta.weight",
        "tenants.gamma.api_keys[0]",
    }


def test_api_keys_never_appear_in_errors() -> None:
    """A wrongly typed api_keys value: the error names the path but never echoes the key."""
    text = _text({"tenants": {"acme": {"api_keys": "sk-secret-value"}}})
    with pytest.raises(ConfigError) as caught:
        parse_config(text)
    assert "sk-secret-value" not in str(caught.value)
    assert caught.value.issues[0].path == "tenants.acme.api_keys"


def test_config_error_lists_one_issue_per_line() -> None:
    """ConfigError built from two issues: str() is one 'path: message' line per issue."""
    error = ConfigError([ConfigIssue("server.port", "bad"), ConfigIssue("replicas", "empty")])
    assert str(error) == "server.port: bad\nreplicas: empty"


@pytest.mark.parametrize(
    ("text", "path", "fragment"),
    [
        ("server:\n  port: [1, 2\ntenants: {}\n", "<yaml>", "line 3, column 8"),
        ("server:\n  port: 1\n   host: x\n", "<yaml>", "line 3, column 8"),
        ("server: {port: 1}\nserver: {port: 2}\n", "<yaml>", "line 2, column 1: duplicate key"),
        ("tenants:\n  a: {}\n  a: {}\n", "<yaml>", "line 3, column 3: duplicate key 'a'"),
        ("- server\n- tenants\n", "<root>", "must be a mapping"),
        ("just text\n", "<root>", "not a str"),
    ],
)
def test_unreadable_yaml_is_one_issue_with_position(text: str, path: str, fragment: str) -> None:
    """YAML that is broken, repeats a key or is not a mapping: one issue, with line and column."""
    issues = _issues(text)
    assert list(issues) == [path]
    assert fragment in issues[path]


def test_empty_document_reports_required_sections() -> None:
    """An empty file: replicas and tenants are both reported missing."""
    assert _issues("") == {
        "replicas": "required key is missing",
        "tenants": "required key is missing",
    }


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    """A path that does not exist: ConfigError at <file> naming the path."""
    with pytest.raises(ConfigError) as caught:
        load_config(tmp_path / "absent.yaml")
    [issue] = caught.value.issues
    assert issue.path == "<file>"
    assert "absent.yaml" in issue.message


# --- tenants --------------------------------------------------------------


def test_allowed_models_are_checked_only_against_a_fully_static_model_list() -> None:
    """A listed model and an alias pass with static lists; with one replica discovering
    its models (``models: null``) any name passes: an adapter may appear at run time."""
    static = {**BASE["replicas"][0], "models": ["llama-8b"]}
    config = _parse({
        "replicas": [static],
        "model_aliases": {"mini": "llama-8b"},
        "tenants": {"acme": {"allowed_models": ["mini", "llama-8b"]}},
    })  # fmt: skip
    assert config.tenants["acme"].allowed_models == ("mini", "llama-8b")
    discovering = {**BASE["replicas"][0], "name": "gpu-1", "url": "http://127.0.0.1:9002"}
    config = _parse({
        "replicas": [static, discovering],
        "tenants": {"acme": {"allowed_models": ["lora-sql"]}},
    })  # fmt: skip
    assert config.tenants["acme"].allowed_models == ("lora-sql",)


def test_anonymous_tenant_needs_no_keys() -> None:
    """anonymous names a tenant without api_keys: valid, and that tenant has no index entry."""
    config = _parse({"anonymous": "public", "tenants": {"public": {"priority": "batch"}}})
    assert config.anonymous == "public"
    assert "public" not in config.key_index().values()


@pytest.mark.parametrize(
    ("tenant", "expected"),
    [
        ({}, {"standard"}),
        ({"priority": "batch"}, {"batch"}),
        ({"allowed_priorities": ["interactive"]}, {"interactive", "standard"}),
        ({"priority": "batch", "allowed_priorities": ["batch", "standard"]}, {"batch", "standard"}),
    ],
)
def test_tenant_classes_always_include_the_default(
    tenant: dict[str, Any], expected: set[str]
) -> None:
    """allowed_priorities given or not: classes() adds the tenant's default class."""
    assert TenantConfig(api_keys=("k",), **tenant).classes() == expected


@pytest.mark.parametrize(
    ("rate", "burst", "expected"),
    [(None, None, None), (0.5, None, 1.0), (20.0, None, 20.0), (20.0, 10.0, 10.0)],
)
def test_effective_burst(rate: float | None, burst: float | None, expected: float | None) -> None:
    """Rate and burst in: bucket size out, max(1, rate) when burst is unset, None if unlimited."""
    assert TenantConfig(rate_per_s=rate, burst=burst).effective_burst == expected


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({}, (2000, 10000, 60000)),
        ({"queue_ms": 500}, (500, 10000, 60000)),
        ({"first_byte_ms": 3000, "total_ms": 30000}, (2000, 3000, 30000)),
        ({"queue_ms": 0, "first_byte_ms": 1, "total_ms": 1}, (0, 1, 1)),
    ],
)
def test_budgets_for_merges_key_by_key(
    overrides: dict[str, int], expected: tuple[int, int, int]
) -> None:
    """Tenant budget overrides over the global budgets: each key taken from the tenant if set."""
    config = _parse({"tenants": {"acme": {"budgets": overrides}}})
    budgets = config.budgets_for("acme")
    assert isinstance(budgets, BudgetsConfig)
    assert (budgets.queue_ms, budgets.first_byte_ms, budgets.total_ms) == expected


def test_key_index_hashes_plain_keys_and_keeps_sha256_entries() -> None:
    """A plain key and an upper-case sha256 entry: both indexed by lower-case hex digest."""
    config = _parse(
        {
            "tenants": {
                "acme": {"api_keys": ["sk-acme-1", "sk-acme-2"]},
                "beta": {"api_keys": [f"sha256:{SHA_OF_SK_1.upper()}"]},
            }
        }
    )
    assert config.key_index() == {
        hash_api_key("sk-acme-1"): "acme",
        hash_api_key("sk-acme-2"): "acme",
        SHA_OF_SK_1: "beta",
    }
    assert config.tenants["beta"].api_keys == (f"sha256:{SHA_OF_SK_1}",)


def test_hash_api_key_is_sha256_hex() -> None:
    """The FIPS 180 test vector 'abc': the well-known SHA-256 hex digest."""
    expected = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    assert hash_api_key("abc") == expected


# --- environment overrides --------------------------------------------------


@pytest.mark.parametrize(
    ("variable", "value", "path", "expected"),
    [
        ("ADMISSION_SERVER__PORT", "9000", "server.port", 9000),
        ("admission_server__host", "127.0.0.2", "server.host", "127.0.0.2"),
        ("ADMISSION_BUDGETS__QUEUE_MS", "750", "budgets.queue_ms", 750),
        ("ADMISSION_RETRY__JITTER", "none", "retry.jitter", "none"),
        ("ADMISSION_RETRY__RETRY_ON", '["http_502"]', "retry.retry_on", ("http_502",)),
        ("ADMISSION_SATURATION__MAX_WAITING", "null", "saturation.max_waiting", None),
        ("ADMISSION_TENANTS__ACME__WEIGHT", "4", "tenants.acme.weight", 4),
        ("ADMISSION_PRIORITIES__BATCH__WEIGHT", "2", "priorities.batch.weight", 2),
        ("ADMISSION_PRIORITIES__BATCH__WEIGHT", "2", "priorities.interactive.weight", 8),
    ],
)
def test_environment_wins_over_the_file(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str, path: str, expected: object
) -> None:
    """The file sets a value and ADMISSION_<SECTION>__<KEY> another: the environment wins."""
    monkeypatch.setenv(variable, value)
    config = _parse(
        {
            "server": {"port": 8081, "host": "127.0.0.1"},
            "budgets": {"queue_ms": 100},
            "retry": {"jitter": "equal", "retry_on": ["http_503"]},
            "saturation": {"max_waiting": 10},
            "tenants": {"acme": {"weight": 2}},
        }
    )
    assert _lookup(config, path) == expected


@pytest.mark.parametrize(
    ("variable", "value", "path", "fragment"),
    [
        ("ADMISSION_SERVER__PORT", "abc", "server.port", "environment variable ADMISSION_SERVER"),
        ("ADMISSION_SERVER__PORT", "0", "server.port", "greater than or equal to 1"),
        ("ADMISSION_SERVER__PROT", "1", "server.prot", "unknown key"),
        ("ADMISSION_BUDGETS__QUEUE_MS", "99999", "budgets.queue_ms", "above total_ms"),
        ("ADMISSION_RETRY__RETRY_ON", "[broken", "retry", "cannot decode environment variable"),
        ("ADMISSION_ANONYMOUS", "ghost", "anonymous", "ADMISSION_ANONYMOUS"),
    ],
)
def test_bad_environment_value_is_reported_at_its_path(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str, path: str, fragment: str
) -> None:
    """A bad ADMISSION_* override over a valid file: ConfigError at the overridden key's path."""
    monkeypatch.setenv(variable, value)
    issues = _issues(_text())
    assert list(issues) == [path]
    assert fragment in issues[path]


def test_unrelated_admission_variables_are_ignored(monkeypatch: pytest.MonkeyPatch) -> None:
    """ADMISSION_ADMIN_TOKEN (the admin token itself) and other names: not config keys."""
    monkeypatch.setenv("ADMISSION_ADMIN_TOKEN", "secret-token")
    monkeypatch.setenv("ADMISSION_LOG_LEVEL", "debug")
    assert _parse().admin.token_env == "ADMISSION_ADMIN_TOKEN"


def test_dotenv_file_is_never_read(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A .env file with ADMISSION_SERVER__PORT in the working directory: ignored."""
    (tmp_path / ".env").write_text("ADMISSION_SERVER__PORT=1234\n")
    monkeypatch.chdir(tmp_path)
    assert _parse().server.port == 8080


# --- dumps and the check-config command ------------------------------------


@pytest.mark.parametrize("path", [EXAMPLE, DEMO], ids=["example", "demo"])
def test_shipped_configs_load(path: Path) -> None:
    """config/example.yaml and config/demo.yaml: both valid under the model."""
    config = load_config(path)
    assert len(config.replicas) == 2
    assert len(config.tenants) >= 2


def test_demo_config_is_shaped_for_the_demo() -> None:
    """config/demo.yaml: replicas sim-0 and sim-1 with 4 seats, tenants of three classes."""
    config = load_config(DEMO)
    assert [(r.name, r.max_concurrency) for r in config.replicas] == [("sim-0", 4), ("sim-1", 4)]
    assert {t.priority for t in config.tenants.values()} == {"interactive", "standard", "batch"}
    assert config.budgets_for("webapp").queue_ms == 1000


def test_example_config_writes_every_key() -> None:
    """config/example.yaml: the file spells out every key that the effective dump holds."""
    written = yaml.safe_load(EXAMPLE.read_text())
    dumped = yaml.safe_load(dump_effective_config(load_config(EXAMPLE)))
    for section in ("server", "admin", "health", "warmup", "saturation", "gpu", "budgets"):
        assert list(written[section]) == list(dumped[section]), section
    for section in ("timeouts", "retry", "telemetry"):
        assert list(written[section]) == list(dumped[section]), section
    assert list(written["replicas"][0]) == list(dumped["replicas"][0])
    assert list(written["tenants"]["acme"]) == list(dumped["tenants"]["acme"])


@pytest.mark.parametrize("path", [EXAMPLE, DEMO], ids=["example", "demo"])
def test_dump_round_trips(path: Path) -> None:
    """A loaded config dumped to YAML and parsed again: an equal Config."""
    config = load_config(path)
    assert parse_config(dump_effective_config(config)) == config


def test_dump_follows_design_key_order() -> None:
    """Minimal config dumped: every top-level key present, in docs/REFERENCE.md order."""
    dumped = yaml.safe_load(dump_effective_config(_parse()))
    assert list(dumped) == REFERENCE_KEY_ORDER
    assert dumped["retry"]["retry_on"] == list(DEFAULT_RETRY_ON)


def test_dump_masks_every_api_key() -> None:
    """mask_secrets with a plain and a sha256 key: every entry is '***', no key text remains."""
    config = _parse({"tenants": {"beta": {"api_keys": [f"sha256:{SHA_OF_SK_1}"]}}})
    text = dump_effective_config(config, mask_secrets=True)
    dumped = yaml.safe_load(text)
    assert dumped["tenants"]["acme"]["api_keys"] == ["***"]
    assert dumped["tenants"]["beta"]["api_keys"] == ["***"]
    assert "sk-acme-1" not in text
    assert SHA_OF_SK_1 not in text


def test_check_config_valid_file_prints_effective_config() -> None:
    """check-config on config/example.yaml: exit 0, effective YAML on out, keys masked."""
    out, err = io.StringIO(), io.StringIO()
    assert check_config(str(EXAMPLE), out, err) == EXIT_OK == 0
    assert err.getvalue() == ""
    dumped = yaml.safe_load(out.getvalue())
    assert list(dumped) == REFERENCE_KEY_ORDER
    assert "sk-acme-1" not in out.getvalue()


def test_check_config_invalid_file_lists_every_problem(tmp_path: Path) -> None:
    """check-config on a file with two mistakes: exit 2, a header, then one line per path."""
    path = tmp_path / "bad.yaml"
    path.write_text(_text({"server": {"port": "x"}, "tenants": {"acme": {"weight": 0}}}))
    out, err = io.StringIO(), io.StringIO()
    assert check_config(str(path), out, err) == EXIT_INVALID == 2
    assert out.getvalue() == ""
    header, *lines = err.getvalue().splitlines()
    assert header == f"invalid config {path}: 2 problems"
    assert [line.split(": ", 1)[0] for line in lines] == ["server.port", "tenants.acme.weight"]


def test_check_config_missing_file(tmp_path: Path) -> None:
    """check-config on a path that does not exist: exit 2 and a <file> line."""
    err = io.StringIO()
    assert check_config(str(tmp_path / "nope.yaml"), io.StringIO(), err) == EXIT_INVALID
    assert err.getvalue().splitlines()[1].startswith("<file>: cannot read")


@pytest.mark.parametrize(
    "url",
    ["redis://127.0.0.1:6379/0", "rediss://user:pw@cache.internal:6380/2", "unix:///run/r.sock"],
)
def test_state_section_takes_redis_urls(url: str) -> None:
    """The shared-state section accepts the URL forms redis-py opens, keeping them verbatim."""
    config = _parse({"state": {"backend": "redis", "redis_url": url, "on_failure": "reject"}})
    assert (config.state.backend, config.state.redis_url, config.state.on_failure) == (
        "redis",
        url,
        "reject",
    )
    assert _parse().state.backend == "local"


# --- model pools and routing ---------------------------------------------------


def test_model_pool_keys_default_to_discovery_and_least_loaded() -> None:
    """A minimal config: replicas discover their models, no aliases, least-loaded routing with
    the documented affinity defaults, and every tenant may use every model."""
    config = _parse()
    assert config.replicas[0].models is None
    assert config.model_aliases == {}
    assert (
        config.routing.policy,
        config.routing.affinity_prefix_chars,
        config.routing.affinity_header,
        config.routing.max_load_factor,
    ) == ("least_loaded", 2048, "X-Session-Id", 1.25)
    assert config.tenants["acme"].allowed_models is None


def test_model_pool_keys_are_kept_as_written() -> None:
    """Static models (an HF id and a LoRA adapter), an alias, affinity routing and a tenant's
    allow-list that names the alias: all kept verbatim."""
    replicas = [{**BASE["replicas"][0], "models": ["meta-llama/Llama-3.1-8B", "sql-lora"]}]
    config = _parse(
        {
            "replicas": replicas,
            "model_aliases": {"gpt-4o-mini": "meta-llama/Llama-3.1-8B"},
            "routing": {"policy": "prefix_affinity", "affinity_header": "X-Conversation"},
            "tenants": {"acme": {"allowed_models": ["gpt-4o-mini", "sql-lora"]}},
        }
    )
    assert config.replicas[0].models == ("meta-llama/Llama-3.1-8B", "sql-lora")
    assert config.model_aliases == {"gpt-4o-mini": "meta-llama/Llama-3.1-8B"}
    assert config.routing.policy == "prefix_affinity"
    assert config.routing.affinity_header == "X-Conversation"
    assert config.tenants["acme"].allowed_models == ("gpt-4o-mini", "sql-lora")


def test_alias_target_may_be_discovered_later() -> None:
    """One replica discovers its models: an alias to a name no replica lists is accepted,
    since the discovering replica may serve it."""
    replicas = [
        {**BASE["replicas"][0], "models": ["llama-8b"]},
        {"name": "gpu-1", "url": "http://127.0.0.1:9002", "max_concurrency": 4},
    ]
    config = _parse({"replicas": replicas, "model_aliases": {"mini": "qwen-7b"}})
    assert config.model_aliases == {"mini": "qwen-7b"}


def test_alias_chain_reported_even_when_replicas_are_invalid() -> None:
    """A bad replica and an alias chain in one file: both problems reported at their paths."""
    issues = _issues(
        _text(
            {
                "replicas": [{**BASE["replicas"][0], "url": "ftp://h"}],
                "model_aliases": {"a": "b", "b": "c"},
            }
        )
    )
    assert set(issues) == {"replicas[0].url", "model_aliases.a"}


def test_every_name_pattern_of_the_config_is_said_in_words() -> None:
    """Each regular expression the config model checks has a plain sentence in its
    errors (check-config quoted the expression), so a new pattern cannot go without."""
    found: set[str] = set()

    def walk(node: object) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("pattern"), str):
                found.add(node["pattern"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(Config.model_json_schema())
    assert found and found <= set(_PATTERNS), found - set(_PATTERNS)
