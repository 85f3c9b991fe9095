"""The deployment files, checked by parsing them (no container engine needed).

Dockerfile, docker-compose.yml, deploy/ (Kubernetes, Prometheus, Grafana, the
OpenTelemetry Collector) and config/schema.json must agree with the proxy as
it is: its CLI, its config model, the metrics a live ``/metrics`` exports and
the paths it serves. Each test names one promise a deployer relies on.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import io
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tomllib
from collections.abc import Awaitable, Callable, Iterator
from contextlib import redirect_stderr
from pathlib import Path, PurePosixPath
from types import UnionType
from typing import Annotated, Any, Union, get_args, get_origin
from urllib.parse import urlsplit

import aiohttp
import jsonschema  # type: ignore[import-untyped]
import pytest
import yaml
from opentelemetry.sdk import environment_variables as otel_environment
from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel

from proxy import schema
from proxy.cli import _parser
from proxy.errors import Outcome, ProxyError
from proxy.settings import (
    DEFAULT_PORT,
    DEFAULT_ROUTES,
    ENV_NESTED_DELIMITER,
    ENV_PREFIX,
    Config,
    ConfigError,
    dump_effective_config,
    hash_api_key,
    parse_config,
)
from proxy.sim import SimConfig, start_sim
from proxy.workers import WORKER_COUNT_ENV, WORKER_GROUP_ENV, workers_refusal
from tests.conftest import ProxyUnderTest
from tests.helpers import KEY_A, make_config

Start = Callable[..., Awaitable[ProxyUnderTest]]

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
REFERENCE = ROOT / "docs" / "REFERENCE.md"
CONFIG_DIR = "/etc/admission-proxy"
IMAGE_CONFIG = f"{CONFIG_DIR}/config.yaml"
SERVE = ["admission-proxy", "serve", "--config", IMAGE_CONFIG]

#: The metric table of docs/REFERENCE.md (a contract): every name, its type and its labels.
CONTRACT_METRICS: dict[str, tuple[str, frozenset[str]]] = {
    "admission_requests_total": ("counter", frozenset({"tenant", "priority", "outcome", "reason"})),
    "admission_queue_depth": ("gauge", frozenset({"tenant", "priority"})),
    "admission_queue_depth_max": ("gauge", frozenset({"tenant"})),
    "admission_wait_seconds": ("histogram", frozenset({"layer", "tenant"})),
    "admission_ttft_seconds": ("histogram", frozenset({"tenant"})),
    "admission_request_duration_seconds": ("histogram", frozenset({"tenant", "outcome"})),
    "admission_timeouts_total": ("counter", frozenset({"layer"})),
    "admission_retries_total": ("counter", frozenset({"reason"})),
    "admission_retry_budget_exhausted_total": ("counter", frozenset()),
    "admission_goodput_total": ("counter", frozenset({"tenant"})),
    "admission_tokens_total": ("counter", frozenset({"tenant", "direction"})),
    "admission_replica_inflight": ("gauge", frozenset({"replica"})),
    "admission_replica_limit": ("gauge", frozenset({"replica"})),
    "admission_replica_healthy": ("gauge", frozenset({"replica"})),
    "admission_headroom_dispatches_total": ("counter", frozenset({"tenant"})),
    "admission_gpu_utilization_ratio": ("gauge", frozenset({"gpu"})),
    "admission_gpu_memory_used_ratio": ("gauge", frozenset({"gpu"})),
    "admission_config_reloads_total": ("counter", frozenset({"result"})),
    "admission_model_requests_total": ("counter", frozenset({"model", "outcome"})),
    "admission_model_queue_depth": ("gauge", frozenset({"model"})),
    "admission_budget_pressure": ("gauge", frozenset({"priority"})),
    "admission_observed_refusals_total": (
        "counter",
        frozenset({"tenant", "priority", "reason"}),
    ),
    "admission_degraded_requests_total": (
        "counter",
        frozenset({"tenant", "priority", "degradation"}),
    ),
    "admission_quota_remaining_tokens": ("gauge", frozenset({"tenant", "window"})),
    "admission_state_up": ("gauge", frozenset()),
    "admission_state_errors_total": ("counter", frozenset()),
    "admission_instances": ("gauge", frozenset()),
}
#: Labels Prometheus adds to every scraped series, and the histogram bucket label.
TARGET_LABELS = frozenset({"instance", "job"})
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
#: Label values a query may match on, beyond the reason codes of ``proxy.errors``.
EXTRA_REASONS = frozenset({"none", "upstream_status", "client_disconnected"})
LAYERS = frozenset({"entrance", "queue", "connect", "first_byte", "idle", "total"})
#: docs/REFERENCE.md, Lifecycle: after SIGTERM the process exits within
#: ``shutdown_grace_ms`` plus this (the cut streams unwinding, exporters flushed).
EXIT_MARGIN_S = 1.0


# --------------------------------------------------------------------------- helpers


def _yaml_files() -> list[Path]:
    found = [*DEPLOY.rglob("*.yaml"), *DEPLOY.rglob("*.yml"), *(ROOT / "config").glob("*.yaml")]
    return sorted([*found, ROOT / "docker-compose.yml"])


def _json_files() -> list[Path]:
    return sorted([*DEPLOY.rglob("*.json"), *(ROOT / "config").glob("*.json")])


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _load(path: Path) -> Any:
    return yaml.safe_load(path.read_text(encoding="utf-8"))


def _compose() -> dict[str, Any]:
    compose: dict[str, Any] = _load(ROOT / "docker-compose.yml")
    return compose


def _cli(argv: list[str]) -> argparse.Namespace:
    """Parse ``argv`` (without the program name) with the real CLI parser."""
    err = io.StringIO()
    try:
        with redirect_stderr(err):
            return _parser().parse_args(argv)
    except SystemExit:
        pytest.fail(f"admission-proxy rejects {argv}: {err.getvalue()}")


def _config_from(path: Path, env: dict[str, str] | None = None) -> Config:
    """The config ``serve`` would build from ``path`` under exactly ``env``'s overrides."""
    with pytest.MonkeyPatch.context() as mp:
        for name in list(os.environ):
            if name.upper().startswith("ADMISSION_"):
                mp.delenv(name)
        for name, value in (env or {}).items():
            mp.setenv(name, value)
        return parse_config(path.read_text(encoding="utf-8"), str(path))


# --------------------------------------------------------------------------- every file parses


@pytest.mark.parametrize("path", _yaml_files(), ids=_rel)
def test_every_yaml_file_parses(path: Path) -> None:
    """Every YAML under deploy/ and config/ (and the compose file) parses, each document."""
    documents = list(yaml.safe_load_all(path.read_text(encoding="utf-8")))
    assert documents and all(isinstance(d, dict) for d in documents), path


@pytest.mark.parametrize("path", _json_files(), ids=_rel)
def test_every_json_file_parses(path: Path) -> None:
    """Every JSON under deploy/ and config/ parses to an object."""
    assert isinstance(json.loads(path.read_text(encoding="utf-8")), dict)


# --------------------------------------------------------------------------- config schema

#: Config files carrying the editor modeline; each must be a valid config.
CONFIG_FILES = [
    ROOT / "config" / "example.yaml",
    ROOT / "config" / "demo.yaml",
    DEPLOY / "kubernetes" / "gateway" / "config.yaml",
    DEPLOY / "kubernetes" / "sidecar" / "config.yaml",
]
MODELINE = re.compile(r"^# yaml-language-server: \$schema=(\S+)$", re.MULTILINE)


def test_committed_schema_is_the_generated_one() -> None:
    """config/schema.json is exactly what ``python -m proxy.schema`` prints now."""
    committed = (ROOT / "config" / "schema.json").read_text(encoding="utf-8")
    assert committed == schema.render(), "stale schema: run python -m proxy.schema --write"
    assert schema.SCHEMA_PATH == ROOT / "config" / "schema.json"


def test_schema_command_prints_writes_and_checks(tmp_path: Path) -> None:
    """No flag prints the schema, --write rewrites the file, --check exits 1 on a stale one."""
    out = io.StringIO()
    assert schema.main([], out=out) == 0
    assert out.getvalue() == schema.render() and out.getvalue().endswith("}\n")
    assert schema.main(["--check"]) == 0
    target = tmp_path / "schema.json"
    target.write_text("{}\n", encoding="utf-8")
    assert schema.main(["--check", "--path", str(target)]) == 1
    assert schema.main(["--write", "--path", str(target)]) == 0
    assert target.read_text(encoding="utf-8") == schema.render()
    assert schema.main(["--check", "--path", str(target)]) == 0
    assert schema.main(["--check", "--path", str(tmp_path / "missing.json")]) == 1


def test_schema_is_deterministic_and_valid() -> None:
    """Two generations are identical, and the result is a valid draft 2020-12 schema."""
    assert schema.render() == schema.render()
    document = json.loads(schema.render())
    assert document["$schema"] == schema.DIALECT
    jsonschema.Draft202012Validator.check_schema(document)


def test_example_configs_reference_the_schema() -> None:
    """Every config file under config/ and deploy/ points editors at config/schema.json."""
    with_modeline = {
        path
        for path in _yaml_files()
        if MODELINE.search(path.read_text(encoding="utf-8")) is not None
    }
    assert with_modeline == set(CONFIG_FILES)
    for path in CONFIG_FILES:
        text = path.read_text(encoding="utf-8")
        assert text.startswith("# yaml-language-server: $schema="), path
        match = MODELINE.search(text)
        assert match is not None
        assert (path.parent / match[1]).resolve() == ROOT / "config" / "schema.json", path


@pytest.mark.parametrize("path", CONFIG_FILES, ids=_rel)
def test_config_file_validates_against_schema_and_model(path: Path) -> None:
    """The file passes the JSON Schema (what editors check) and the model (what serve checks)."""
    validator = jsonschema.Draft202012Validator(json.loads(schema.render()))
    errors = [f"{list(e.absolute_path)}: {e.message}" for e in validator.iter_errors(_load(path))]
    assert errors == []
    _config_from(path)


@pytest.mark.parametrize(
    ("change", "where"),
    [
        ({"servr": {"port": 8080}}, []),
        ({"retry": {"jitter": "sometimes"}}, ["retry", "jitter"]),
        ({"budgets": {"queue_ms": -1}}, ["budgets", "queue_ms"]),
    ],
)
def test_schema_catches_what_the_model_refuses(change: dict[str, Any], where: list[str]) -> None:
    """A misspelt key, an unknown enum value, a negative budget: both schema and model refuse."""
    document = {**_load(ROOT / "config" / "demo.yaml"), **change}
    validator = jsonschema.Draft202012Validator(json.loads(schema.render()))
    assert [list(e.absolute_path) for e in validator.iter_errors(document)] == [where]
    with pytest.raises(ConfigError):
        parse_config(yaml.safe_dump(document))


# --------------------------------------------------------------------------- Dockerfile


def _dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    lines: list[str] = []
    pending = ""
    for raw in (ROOT / "Dockerfile").read_text(encoding="utf-8").splitlines():
        stripped = raw.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        lines.append(pending + stripped)
        pending = ""
    result = []
    for line in lines:
        instruction, _, arguments = line.partition(" ")
        result.append((instruction.upper(), arguments.strip()))
    return result


def _stages() -> list[list[tuple[str, str]]]:
    stages: list[list[tuple[str, str]]] = []
    for instruction, arguments in _dockerfile():
        if instruction == "FROM":
            stages.append([])
        if stages:
            stages[-1].append((instruction, arguments))
    return stages


def _exec_form(arguments: str) -> list[str]:
    value = json.loads(arguments)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), arguments
    return value


def _final(instruction: str) -> list[str]:
    found = [a for i, a in _stages()[-1] if i == instruction]
    assert found, f"no {instruction} in the final stage"
    return found


def test_dockerfile_is_multi_stage_on_slim_python_311() -> None:
    """Two or more stages, all on a slim Python 3.11 image (ARG defaults resolved)."""
    args = dict(
        a.split("=", 1) for i, a in _dockerfile() if i == "ARG" and "=" in a
    )  # fmt: skip
    bases = []
    for stage in _stages():
        image = stage[0][1].split()[0]
        bases.append(re.sub(r"\$\{?(\w+)\}?", lambda m: args[m[1]], image))
    assert len(bases) >= 2
    assert all(re.fullmatch(r"python:3\.11-slim(-\w+)?", base) for base in bases), bases


def test_dockerfile_final_stage_has_only_the_runtime() -> None:
    """The final stage installs nothing: it copies the built venv; no dev extra anywhere."""
    final = _stages()[-1]
    assert not [a for i, a in final if i == "RUN" and "pip" in a]
    assert any(i == "COPY" and a.startswith("--from=build ") for i, a in final)
    everything = " ".join(a for _, a in _dockerfile())
    assert "[dev]" not in everything and "-e " not in everything


def test_dockerfile_runs_as_non_root() -> None:
    """USER in the final stage is a numeric, non-zero uid (Kubernetes can verify it)."""
    user = _final("USER")[-1].split(":")[0]
    assert user.isdigit() and int(user) != 0


def test_dockerfile_command_is_the_readme_run_command() -> None:
    """ENTRYPOINT + CMD is `admission-proxy serve --config /etc/admission-proxy/config.yaml`."""
    command = _exec_form(_final("ENTRYPOINT")[-1]) + _exec_form(_final("CMD")[-1])
    assert command == SERVE
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "admission-proxy serve --config PATH" in readme
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    assert command[0] in scripts["project"]["scripts"]
    args = _cli(command[1:])
    assert args.command == "serve" and args.config == IMAGE_CONFIG


def test_dockerfile_healthcheck_exposes_and_default_config() -> None:
    """HEALTHCHECK probes /healthz on the default port, which is EXPOSEd; a config is baked in."""
    healthcheck = _final("HEALTHCHECK")[-1]
    assert "/healthz" in healthcheck and f"'{DEFAULT_PORT}'" in healthcheck
    assert _final("EXPOSE") == [str(DEFAULT_PORT)]
    copies = [a.split() for a in _final("COPY")]
    assert ["config/example.yaml", IMAGE_CONFIG] in copies
    assert _final("STOPSIGNAL") == ["SIGTERM"]


def _dockerignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last pattern matching the path or a parent decides."""
    parts = PurePosixPath(path).parts
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    ignored = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        body = pattern.removeprefix("!").strip("/")
        regex = re.escape(body).replace(r"\*\*/", "(.*/)?").replace(r"\*\*", ".*")
        regex = regex.replace(r"\*", "[^/]*").replace(r"\?", "[^/]")
        regex = re.sub(r"\\\[([^\]]*)\\\]", r"[\1]", regex)
        if any(re.fullmatch(regex, candidate) for candidate in candidates):
            ignored = not negate
    return ignored


def test_dockerignore_keeps_what_copy_needs_and_drops_the_rest() -> None:
    """Every COPY source exists and reaches the build; .venv, .git and tests do not."""
    patterns = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text(encoding="utf-8").splitlines()
        if line.strip() and not line.startswith("#")
    ]
    sources = []
    for instruction, arguments in _dockerfile():
        if instruction == "COPY" and not arguments.startswith("--from"):
            sources += [s.rstrip("/") for s in arguments.split()[:-1] if not s.startswith("--")]
    assert sources
    for source in sources:
        assert (ROOT / source).exists(), source
        assert not _dockerignored(source, patterns), source
    assert not _dockerignored("proxy/cli.py", patterns)
    for dropped in (".venv/bin/python", ".git/HEAD", "tests/test_deploy.py", "bench/x.py",
                    "proxy/__pycache__/cli.cpython-311.pyc", "config/local.yaml"):  # fmt: skip
        assert _dockerignored(dropped, patterns), dropped


# --------------------------------------------------------------------------- compose


def _host_path(service: dict[str, Any], container_path: str) -> Path:
    """The host file behind ``container_path``, through the service's bind mounts."""
    best: tuple[str, str] | None = None
    for volume in service.get("volumes", []):
        source, target = volume.split(":")[:2]
        inside = container_path == target or container_path.startswith(target.rstrip("/") + "/")
        if inside and (best is None or len(target) > len(best[1])):
            best = (source, target)
    assert best is not None, f"{container_path} is not mounted"
    return ROOT / best[0] / container_path[len(best[1]) :].lstrip("/")


def _service_image_is_ours(service: dict[str, Any]) -> bool:
    return "build" in service


def _sim_ports(compose: dict[str, Any]) -> dict[str, int]:
    """Simulated replicas by service name, with the port each listens on."""
    ports = {}
    for name, service in compose["services"].items():
        command = service.get("command")
        if _service_image_is_ours(service) and command and command[0] == "sim":
            args = _cli(command)
            assert args.host == "0.0.0.0", f"{name} must listen beyond its own loopback"
            ports[name] = args.port
    return ports


def _proxy_services(compose: dict[str, Any]) -> list[str]:
    """Services that run ``admission-proxy serve``."""
    return [
        name
        for name, service in compose["services"].items()
        if _service_image_is_ours(service)
        and service.get("command")
        and service["command"][0] == "serve"
    ]


def test_compose_runs_two_proxies_on_one_redis() -> None:
    """Two proxy instances of the demo config, on two published ports, share the compose
    Redis (state.backend redis, its URL the redis service) and wait for it to be healthy."""
    compose = _compose()
    names = _proxy_services(compose)
    assert len(names) >= 2
    published = set()
    for name in names:
        service = compose["services"][name]
        env = {k: str(v) for k, v in service["environment"].items()}
        config = _config_from(_host_path(service, _cli(service["command"]).config), env)
        assert config.state.backend == "redis"
        url = urlsplit(config.state.redis_url)
        assert url.hostname == "redis" and url.port == 6379
        assert service["depends_on"]["redis"]["condition"] == "service_healthy"
        published |= {p.split(":")[0] for p in service["ports"]}
    assert len(published) == len(names)
    redis = compose["services"]["redis"]
    assert "redis-cli" in redis["healthcheck"]["test"]


def test_kubernetes_gateway_shares_its_limits_in_redis() -> None:
    """The gateway config uses the Redis of its own manifests (Service name and port), runs
    2+ pods, passes ``check-config --workers`` of their count, and no longer tells operators
    to divide limits by hand."""
    objects, generated, _ = _kustomize("gateway")
    config_file = generated["admission-proxy-config"]
    config = _config_from(config_file)
    assert config.state.backend == "redis"
    url = urlsplit(config.state.redis_url)
    service = _one(objects, "Service", "admission-redis")
    assert url.hostname == service["metadata"]["name"]
    assert url.port == service["spec"]["ports"][0]["port"]
    redis = _one(objects, "StatefulSet", "admission-redis")
    container = redis["spec"]["template"]["spec"]["containers"][0]
    assert service["spec"]["ports"][0]["targetPort"] in {p["name"] for p in container["ports"]}
    assert _one(objects, "Deployment")["spec"]["replicas"] >= 2
    text = config_file.read_text(encoding="utf-8").lower()
    assert "per proxy pod" not in text and "half" not in text and "divide" not in text


def test_compose_has_the_whole_stack() -> None:
    """The proxy, two simulated replicas, the collector, Jaeger, Prometheus and Grafana."""
    services = set(_compose()["services"])
    expected = {"proxy", "otel-collector", "jaeger", "prometheus", "grafana"}
    assert expected <= services
    assert len(_sim_ports(_compose())) == 2


def test_compose_bind_mounts_and_build_exist() -> None:
    """Every ./ bind mount and every build context on the host exists."""
    for name, service in _compose()["services"].items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            assert source.startswith("./"), f"{name}: {volume} is not a relative bind mount"
            assert (ROOT / source).exists(), f"{name}: {source} does not exist"
        if "build" in service:
            context = ROOT / service["build"]["context"]
            assert (context / service["build"].get("dockerfile", "Dockerfile")).is_file()


def test_compose_proxy_runs_serve_on_the_demo_config() -> None:
    """serve --config on the mounted demo config; the environment points it at the sims."""
    compose = _compose()
    proxy = compose["services"]["proxy"]
    args = _cli(proxy["command"])
    assert args.command == "serve" and args.host is None and args.port is None
    path = _host_path(proxy, args.config)
    assert path == ROOT / "config" / "demo.yaml"
    env = {k: str(v) for k, v in proxy["environment"].items()}
    config = _config_from(path, env)
    assert config.server.host == "0.0.0.0"
    published = {int(p.split(":")[-1]) for p in proxy["ports"]}
    assert config.server.port in published
    sims = _sim_ports(compose)
    assert {r.name for r in config.replicas} == set(sims)
    for replica in config.replicas:
        for url in (replica.url, replica.metrics_url):
            assert url is not None
            parts = urlsplit(url)
            assert parts.hostname in sims and parts.port == sims[parts.hostname], url
    assert {*sims, "otel-collector"} <= set(proxy["depends_on"])


def test_compose_commands_are_the_cli_as_it_is() -> None:
    """Every command given to the proxy image parses with the real CLI and its sim flags."""
    from proxy.sim.cli import config_from_args

    compose = _compose()
    for name, service in compose["services"].items():
        if not _service_image_is_ours(service) or "entrypoint" in service:
            continue
        args = _cli(service["command"])
        if args.command == "sim":
            config_from_args(args)
            probe = " ".join(service["healthcheck"]["test"])
            assert f"127.0.0.1:{args.port}/health" in probe, name
    traffic = compose["services"]["traffic"]
    script = traffic["entrypoint"][-1]
    assert _host_path(traffic, script).is_file()
    config = traffic["command"][traffic["command"].index("--config") + 1]
    assert _host_path(traffic, config) == ROOT / "config" / "demo.yaml"


def test_compose_traffic_sends_every_demo_tenant(monkeypatch: pytest.MonkeyPatch) -> None:
    """The traffic script finds a usable key for every tenant of the demo config."""
    spec = importlib.util.spec_from_file_location("traffic", DEPLOY / "compose" / "traffic.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "traffic", module)  # dataclasses look their module up
    spec.loader.exec_module(module)
    demo = _load(ROOT / "config" / "demo.yaml")
    flows = module.flows(demo)
    assert {f.tenant for f in flows} == set(demo["tenants"])
    for flow in flows:
        assert flow.key in demo["tenants"][flow.tenant]["api_keys"]
        assert flow.rate_per_s > 0


def test_compose_prometheus_scrapes_the_proxy_and_replicas() -> None:
    """Scrape targets are compose services on their real ports; rule files exist."""
    compose = _compose()
    service = compose["services"]["prometheus"]
    flag = next(c for c in service["command"] if c.startswith("--config.file="))
    path = _host_path(service, flag.split("=", 1)[1])
    assert path == DEPLOY / "prometheus" / "prometheus.yml"
    prometheus = _load(path)
    for rule_file in prometheus["rule_files"]:
        assert (path.parent / rule_file).is_file(), rule_file
    targets = {
        target
        for job in prometheus["scrape_configs"]
        for static in job["static_configs"]
        for target in static["targets"]
    }
    proxy = compose["services"]["proxy"]
    port = _config_from(ROOT / "config" / "demo.yaml", dict(proxy["environment"])).server.port
    proxies = {f"{name}:{port}" for name in _proxy_services(compose)}
    expected = proxies | {f"{name}:{p}" for name, p in _sim_ports(compose).items()}
    assert targets == expected


def test_compose_grafana_and_tracing_are_wired() -> None:
    """Grafana loads the dashboard from its provider; traces go proxy -> collector -> Jaeger."""
    compose = _compose()
    grafana = compose["services"]["grafana"]
    provider = _load(DEPLOY / "grafana" / "provisioning" / "dashboards" / "admission-proxy.yaml")
    folder = provider["providers"][0]["options"]["path"]
    assert _host_path(grafana, f"{folder}/admission-proxy.json") == DEPLOY / "grafana" / (
        "dashboard.json"
    )
    assert _host_path(grafana, "/etc/grafana/provisioning/dashboards").is_dir()
    datasource = _load(DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yaml")
    url = urlsplit(datasource["datasources"][0]["url"])
    assert url.hostname == "prometheus" and url.port == 9090
    assert "9090:9090" in compose["services"]["prometheus"]["ports"]

    collector = compose["services"]["otel-collector"]
    flag = next(c for c in collector["command"] if c.startswith("--config="))
    otel = _load(_host_path(collector, flag.split("=", 1)[1]))
    http = urlsplit("//" + otel["receivers"]["otlp"]["protocols"]["http"]["endpoint"])
    endpoint = urlsplit(compose["services"]["proxy"]["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"])
    assert endpoint.hostname == "otel-collector" and endpoint.port == http.port
    exporters = otel["service"]["pipelines"]["traces"]["exporters"]
    assert all(name in otel["exporters"] for name in exporters)
    jaeger = urlsplit("//" + otel["exporters"]["otlp/jaeger"]["endpoint"])
    assert jaeger.hostname in compose["services"]


# --------------------------------------------------------------------------- metrics used


_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
_SELECTOR = re.compile(r"(?<![\w:$])([A-Za-z_:][\w:]*)(?![\w:])\s*(\{[^}]*\})?(?!\s*\()")
_MATCHER = re.compile(r'(\w+)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"')
_LABEL_VALUES = re.compile(r"label_values\(\s*([A-Za-z_:][\w:]*)\s*(\{[^}]*\})?\s*,\s*(\w+)\s*\)")
_KEYWORDS = frozenset(
    {"and", "or", "unless", "bool", "offset", "inf", "nan", "by", "without", "on", "ignoring"}
    | {"group_left", "group_right"}
)


def _selectors(expr: str) -> tuple[list[tuple[str, list[tuple[str, str, str]]]], set[str]]:
    """PromQL -> ([(metric, [(label, op, value)])], labels named in by/on/... clauses)."""
    grouped: set[str] = set()
    for match in _GROUPING.finditer(expr):
        grouped |= {label.strip() for label in match[2].split(",") if label.strip()}
    rest = _GROUPING.sub(" ", expr)
    rest = re.sub(r"\[[^\]]*\]", " ", rest)
    found = []
    for match in _SELECTOR.finditer(rest):
        if match[1] in _KEYWORDS:
            continue
        found.append((match[1], _MATCHER.findall(match[2] or "")))
    return found, grouped


def _dashboard() -> dict[str, Any]:
    dashboard: dict[str, Any] = json.loads(
        (DEPLOY / "grafana" / "dashboard.json").read_text(encoding="utf-8")
    )
    return dashboard


def _panels(items: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in items:
        yield panel
        yield from _panels(panel.get("panels", []))


def _alert_rules() -> list[dict[str, Any]]:
    alerts = _load(DEPLOY / "prometheus" / "alerts.yml")
    return [rule for group in alerts["groups"] for rule in group["rules"]]


def _queries() -> list[tuple[str, str]]:
    """(where, PromQL) for every dashboard target, alert rule and dashboard variable.

    A ``label_values(metric, label)`` variable reads as ``sum by (label) (metric)``.
    """
    dashboard = _dashboard()
    queries = [
        (f"panel {p['title']!r}", t["expr"])
        for p in _panels(dashboard["panels"])
        for t in p.get("targets", [])
    ]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            match = _LABEL_VALUES.fullmatch(variable["definition"])
            assert match is not None, variable["definition"]
            queries.append((f"variable {variable['name']}", f"sum by ({match[3]}) ({match[1]})"))
    queries += [(f"alert {r['alert']}", str(r["expr"])) for r in _alert_rules()]
    return queries


def _contract_name(used: str) -> str:
    """The contract metric a series name belongs to (``x_bucket`` -> histogram ``x``)."""
    for name, (kind, _) in CONTRACT_METRICS.items():
        series = [name] if kind == "counter" else [name + s for s in SUFFIXES[kind]]
        if used in series:
            return name
    pytest.fail(f"{used} is not a metric of docs/REFERENCE.md")


def _subclasses(cls: type[ProxyError]) -> Iterator[type[ProxyError]]:
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


def test_promql_selector_extraction() -> None:
    """The extractor finds metrics and matchers, not functions, keywords or variables."""
    expr = (
        "histogram_quantile(0.95, sum by (le, layer) (rate(admission_wait_seconds_bucket"
        '{tenant=~"$tenant"}[$__rate_interval]))) / on (x) group_left m_b and c offset 1h'
    )
    selectors, grouped = _selectors(expr)
    assert selectors == [
        ("admission_wait_seconds_bucket", [("tenant", "=~", "$tenant")]),
        ("m_b", []),
        ("c", []),
    ]
    assert grouped == {"le", "layer", "x"}


def test_dashboard_covers_the_issue_panels() -> None:
    """Queue depth, wait per layer, rejections by reason, goodput, TTFT, seats against limit,
    retries and GPU each have a panel."""
    shown: dict[str, list[list[tuple[str, str, str]]]] = {}
    for where, expr in _queries():
        if where.startswith("panel"):
            for name, matchers in _selectors(expr)[0]:
                shown.setdefault(name, []).append(matchers)
    for name in (
        "admission_queue_depth",
        "admission_wait_seconds_bucket",
        "admission_requests_total",
        "admission_goodput_total",
        "admission_ttft_seconds_bucket",
        "admission_replica_inflight",
        "admission_replica_limit",
        "admission_retries_total",
        "admission_gpu_utilization_ratio",
        "admission_gpu_memory_used_ratio",
    ):
        assert name in shown, name
    assert any(
        ("outcome", "=~", "rejected|timed_out") in m for m in shown["admission_requests_total"]
    )
    ids = [p["id"] for p in _panels(_dashboard()["panels"])]
    assert len(ids) == len(set(ids))


def test_alert_rules_cover_the_issue_signals() -> None:
    """Queue near capacity, rejections rising, goodput falling, retry budget exhausted."""
    rules = {r["alert"]: r for r in _alert_rules()}
    assert {
        "AdmissionQueueNearCapacity",
        "AdmissionRejectionsRising",
        "AdmissionGoodputFalling",
        "AdmissionRetryBudgetExhausted",
    } <= set(rules)
    for rule in rules.values():
        expr = str(rule["expr"])
        assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}"), expr
        assert rule["labels"]["severity"] in {"warning", "critical"}
        assert rule["annotations"]["summary"]


def test_queries_use_contract_names_labels_and_values() -> None:
    """Every metric, label and label value a query uses is one the reference's metric table
    (and its reason codes) define: a typo would draw an empty panel or a silent alert."""
    reasons = {cls.reason for cls in _subclasses(ProxyError)} | EXTRA_REASONS
    values = {"reason": reasons, "outcome": set(get_args(Outcome)), "layer": LAYERS}
    for where, expr in _queries():
        selectors, grouped = _selectors(expr)
        assert selectors, f"{where}: no metric in {expr}"
        in_expr: set[str] = set(TARGET_LABELS)
        for used, matchers in selectors:
            labels = CONTRACT_METRICS[_contract_name(used)][1]
            allowed = labels | TARGET_LABELS | ({"le"} if used.endswith("_bucket") else set())
            in_expr |= allowed
            for label, _, value in matchers:
                assert label in allowed, f"{where}: {used} has no label {label!r}"
                if label in values and "$" not in value:
                    unknown = set(value.split("|")) - values[label]
                    assert not unknown, f"{where}: {label} {sorted(unknown)} never occurs"
        assert grouped <= in_expr, f"{where}: grouping by {sorted(grouped - in_expr)}"


def _reference_section(title: str) -> str:
    """The text of one ``## title`` section of docs/REFERENCE.md."""
    text = REFERENCE.read_text(encoding="utf-8")
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def test_reference_metric_table_is_the_contract_copy() -> None:
    """CONTRACT_METRICS here is docs/REFERENCE.md's metric table, name for name."""
    table: dict[str, tuple[str, frozenset[str]]] = {}
    for line in _reference_section("Metrics").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not cells[0].startswith("`admission_"):
            continue
        labels = frozenset(re.findall(r"`(\w+)`", re.sub(r"\([^)]*\)", "", cells[2])))
        for name in re.findall(r"`(\w+)`", cells[0]):
            kind = re.match(r"\w+", cells[1])
            assert kind is not None, line
            table[name] = (kind[0], labels)
    assert table == CONTRACT_METRICS


def _reference_config() -> dict[str, Any]:
    """The configuration block of docs/REFERENCE.md: every key with its default."""
    section = _reference_section("Configuration (YAML)")
    block = re.search(r"```yaml\n(.*?)```", section, re.DOTALL)
    assert block is not None, "no yaml block in the Configuration section"
    document: dict[str, Any] = yaml.safe_load(block[1])
    return document


def test_reference_config_lists_every_key_with_its_default() -> None:
    """The reference's config block is a valid config whose every key and default is the
    settings model's (a minimal config's effective dump): a key renamed, added without
    documentation or a default changed in either place fails here."""
    documented = _reference_config()
    parse_config(yaml.safe_dump(documented))  # every documented key exists, values valid
    replica, tenant_name = documented["replicas"][0], next(iter(documented["tenants"]))
    required_replica = {k: replica[k] for k in ("name", "url", "max_concurrency")}
    required_tenant = {"api_keys": documented["tenants"][tenant_name]["api_keys"]}
    minimal = {"replicas": [required_replica], "tenants": {tenant_name: required_tenant}}
    effective = yaml.safe_load(dump_effective_config(parse_config(yaml.safe_dump(minimal))))
    assert set(documented) == set(effective)
    for key in effective:
        if key not in ("replicas", "tenants"):
            assert documented[key] == effective[key], key
    assert documented["replicas"][0] == effective["replicas"][0]
    tenant = effective["tenants"][tenant_name]
    # The dump spells "no override" out as nulls; the reference writes it as {}.
    tenant["budgets"] = {k: v for k, v in tenant["budgets"].items() if v is not None}
    assert documented["tenants"] == effective["tenants"]


def test_reference_reason_codes_are_the_proxys() -> None:
    """Every reason code of the proxy's error tree is in the reference's status table."""
    section = _reference_section("HTTP behaviour")
    for cls in _subclasses(ProxyError):
        assert f"`{cls.reason}`" in section, cls.reason


async def test_live_metrics_export_everything_used(start_proxy: Start, upstream_url: str) -> None:
    """A live proxy's /metrics declares every reference metric with its type and labels, and
    nothing else under ``admission_``, so every
    name the dashboard and alerts query exists (families without samples yet count by TYPE)."""
    proxy = await start_proxy(make_config([upstream_url]))
    auth = {"Authorization": f"Bearer {KEY_A}"}
    body = {"model": "m", "messages": [], "max_tokens": 3, "stream": True}
    response = await proxy.client.post("/v1/chat/completions", json=body, headers=auth)
    assert response.status == 200
    await response.read()
    text = await (await proxy.client.get("/metrics")).text()

    families = {f.name: f for f in text_string_to_metric_families(text)}
    exported: dict[str, str] = {}
    for exported_family in families.values():
        for suffix in SUFFIXES.get(exported_family.type, ("",)):
            exported[exported_family.name + suffix] = exported_family.type
    exported_names = {
        f.name + ("_total" if f.type == "counter" else "")
        for f in families.values()
        if f.name.startswith("admission_") and not f.name.endswith("_created")
    }
    assert exported_names == set(CONTRACT_METRICS), "every exported metric is in the reference"
    for name, (kind, labels) in CONTRACT_METRICS.items():
        family = families.get(name.removesuffix("_total") if kind == "counter" else name)
        assert family is not None and family.type == kind, f"/metrics lacks {name} ({kind})"
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            assert set(sample.labels) - {"le"} == labels, (name, sample)
    for where, expr in _queries():
        for used, _ in _selectors(expr)[0]:
            assert used in exported, f"{where}: /metrics does not export {used}"
    sampled = {s.name for f in families.values() for s in f.samples}
    for name in ("admission_requests_total", "admission_ttft_seconds_bucket",
                 "admission_goodput_total", "admission_wait_seconds_bucket",
                 "admission_replica_inflight", "admission_replica_limit"):  # fmt: skip
        assert name in sampled, f"{name} has no sample after a completed stream"


# --------------------------------------------------------------------------- Kubernetes


def _kustomize(mode: str) -> tuple[list[dict[str, Any]], dict[str, Path], dict[str, Any]]:
    """The objects of a kustomization (resources), its generated ConfigMap files, itself."""
    directory = DEPLOY / "kubernetes" / mode
    kustomization: dict[str, Any] = _load(directory / "kustomization.yaml")
    objects = []
    for resource in kustomization["resources"]:
        objects += [d for d in yaml.safe_load_all((directory / resource).read_text()) if d]
    generated = {}
    for generator in kustomization.get("configMapGenerator", []):
        assert generator["options"]["disableNameSuffixHash"] is True
        (file,) = generator["files"]
        generated[generator["name"]] = directory / file
    return objects, generated, kustomization


def _one(objects: list[dict[str, Any]], kind: str, name: str = "admission-proxy") -> dict[str, Any]:
    """The one object of ``kind``; where there are several (the gateway's Redis beside the
    proxy), the one labelled ``app.kubernetes.io/name: name``."""
    found = [o for o in objects if o["kind"] == kind]
    if len(found) > 1 or name != "admission-proxy":
        found = [o for o in found if o["metadata"]["labels"].get("app.kubernetes.io/name") == name]
    (one,) = found
    return one


def _container(pod: dict[str, Any], name: str) -> dict[str, Any]:
    matches: list[dict[str, Any]] = [c for c in pod["containers"] if c["name"] == name]
    (found,) = matches
    return found


def _port(container: dict[str, Any], port: int | str) -> int:
    """A probe's or a Service's port, by number or by the container's port name."""
    if isinstance(port, int):
        return port
    (number,) = [p["containerPort"] for p in container["ports"] if p["name"] == port]
    return int(number)


def _sleep_s(container: dict[str, Any]) -> int:
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    return int(command[1])


@pytest.mark.parametrize("mode", ["gateway", "sidecar"])
def test_kubernetes_proxy_container_matches_its_config(mode: str) -> None:
    """Image command, mounted ConfigMap, port, probes on /readyz and /healthz, Service and
    selectors: all agree with the config the pod reads."""
    objects, generated, kustomization = _kustomize(mode)
    deployment = _one(objects, "Deployment")
    template = deployment["spec"]["template"]
    pod = template["spec"]
    proxy = _container(pod, "admission-proxy")

    assert proxy["image"] in {i["name"] for i in kustomization["images"]}
    args = _cli(proxy["args"])
    assert args.command == "serve" and args.host is None and args.port is None
    mount = next(m for m in proxy["volumeMounts"] if args.config.startswith(m["mountPath"] + "/"))
    assert mount["mountPath"] == CONFIG_DIR and mount.get("readOnly") is True
    assert "subPath" not in mount, "subPath mounts never receive ConfigMap updates"
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    config_file = generated[volume["configMap"]["name"]]
    assert PurePosixPath(args.config).name == config_file.name
    config = _config_from(config_file)

    (http,) = proxy["ports"]
    assert http["containerPort"] == config.server.port
    ready, live = proxy["readinessProbe"]["httpGet"], proxy["livenessProbe"]["httpGet"]
    assert (ready["path"], live["path"]) == ("/readyz", "/healthz")
    assert _port(proxy, ready["port"]) == _port(proxy, live["port"]) == config.server.port
    assert template["metadata"]["annotations"]["prometheus.io/port"] == str(config.server.port)

    service = _one(objects, "Service")
    assert service["spec"]["selector"].items() <= template["metadata"]["labels"].items()
    assert deployment["spec"]["selector"]["matchLabels"] == service["spec"]["selector"]
    for port in service["spec"]["ports"]:
        assert _port(proxy, port["targetPort"]) == config.server.port

    drain_s = _sleep_s(proxy) + config.server.shutdown_grace_ms / 1000 + EXIT_MARGIN_S
    assert pod["terminationGracePeriodSeconds"] > drain_s
    assert pod["enableServiceLinks"] is False, "service links inject ADMISSION_* variables"


@pytest.mark.parametrize("mode", ["gateway", "sidecar"])
def test_kubernetes_pods_run_non_root_with_requests(mode: str) -> None:
    """Pod runs as a non-root uid; the proxy is locked down; every container requests resources."""
    objects, _, _ = _kustomize(mode)
    pod = _one(objects, "Deployment")["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    for container in pod["containers"]:
        context = container["securityContext"]
        assert context.get("runAsUser", 1) != 0 and not context.get("privileged", False)
        assert context["allowPrivilegeEscalation"] is False
        assert context["capabilities"]["drop"] == ["ALL"]
        assert {"cpu", "memory"} <= set(container["resources"]["requests"]), container["name"]
        assert "memory" in container["resources"]["limits"], container["name"]
    proxy = _container(pod, "admission-proxy")
    assert proxy["securityContext"]["readOnlyRootFilesystem"] is True


def test_kubernetes_gateway_survives_disruptions() -> None:
    """Several proxy pods, a PodDisruptionBudget that still lets a node drain, no surge gap."""
    objects, _, _ = _kustomize("gateway")
    deployment = _one(objects, "Deployment")
    budget = _one(objects, "PodDisruptionBudget")
    replicas = deployment["spec"]["replicas"]
    assert replicas >= 2 and 1 <= budget["spec"]["minAvailable"] < replicas
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert budget["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0


def test_kubernetes_sidecar_fronts_its_own_gpu_engine() -> None:
    """The one replica is vLLM on the pod's loopback port, gpu_index is set, vLLM holds the
    GPU, the ports do not collide, and vLLM outlives the proxy's drain."""
    objects, generated, _ = _kustomize("sidecar")
    pod = _one(objects, "Deployment")["spec"]["template"]["spec"]
    vllm, proxy = _container(pod, "vllm"), _container(pod, "admission-proxy")
    (config_file,) = generated.values()
    config = _config_from(config_file)
    (replica,) = config.replicas
    vllm_port = int(vllm["args"][vllm["args"].index("--port") + 1])
    assert vllm["args"][vllm["args"].index("--host") + 1] == "127.0.0.1"
    for url in (replica.url, replica.metrics_url):
        assert url is not None
        parts = urlsplit(url)
        assert parts.hostname in {"127.0.0.1", "localhost"} and parts.port == vllm_port
    assert replica.gpu_index is not None
    assert vllm["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert "nvidia.com/gpu" not in proxy["resources"].get("limits", {})
    assert vllm_port != config.server.port
    drain_s = _sleep_s(proxy) + config.server.shutdown_grace_ms / 1000 + EXIT_MARGIN_S
    assert _sleep_s(vllm) > drain_s, "vLLM must still answer while the proxy drains"
    assert pod["terminationGracePeriodSeconds"] > _sleep_s(vllm)


# --------------------------------------------------------------------------- autoscaling

AUTOSCALING = DEPLOY / "kubernetes" / "autoscaling"


def _pressure_classes(matchers: list[tuple[str, str, str]]) -> set[str]:
    """The classes a ``priority`` matcher selects (``=`` or ``=~`` with ``|``)."""
    (values,) = [value for label, op, value in matchers if label == "priority" and "=" in op]
    return set(values.split("|"))


def test_autoscaling_examples_scale_the_sidecar_on_budget_pressure() -> None:
    """The KEDA ScaledObject and the HPA both scale the sidecar Deployment (one engine per
    pod) on admission_budget_pressure of configured classes, at a threshold inside (0, 1),
    up at once and down slowly; neither is in a kustomization (apply one, not both)."""
    objects, generated, _ = _kustomize("sidecar")
    deployment = _one(objects, "Deployment")
    (config_file,) = generated.values()
    classes = set(_config_from(config_file).priorities)
    target = {"apiVersion": "apps/v1", "kind": "Deployment", "name": deployment["metadata"]["name"]}

    keda = _load(AUTOSCALING / "keda-scaledobject.yaml")
    assert (keda["apiVersion"], keda["kind"]) == ("keda.sh/v1alpha1", "ScaledObject")
    assert keda["spec"]["scaleTargetRef"] == target
    assert 1 <= keda["spec"]["minReplicaCount"] < keda["spec"]["maxReplicaCount"]
    (trigger,) = keda["spec"]["triggers"]
    assert trigger["type"] == "prometheus"
    selectors, grouped = _selectors(trigger["metadata"]["query"])
    (metric, matchers) = selectors[0]
    assert [m for m, _ in selectors] == ["admission_budget_pressure"] and not grouped
    labels = CONTRACT_METRICS[metric][1]
    assert {label for label, _, _ in matchers} <= labels
    assert _pressure_classes(matchers) <= classes
    keda_at = float(trigger["metadata"]["threshold"])
    behavior = keda["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]

    hpa = _load(AUTOSCALING / "hpa-external.yaml")
    assert (hpa["apiVersion"], hpa["kind"]) == ("autoscaling/v2", "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"] == target
    (external,) = hpa["spec"]["metrics"]
    assert external["type"] == "External"
    assert external["external"]["metric"]["name"] in CONTRACT_METRICS
    (expression,) = external["external"]["metric"]["selector"]["matchExpressions"]
    assert expression["key"] in labels and set(expression["values"]) <= classes
    assert set(expression["values"]) == _pressure_classes(matchers)
    value = external["external"]["target"]["value"]
    hpa_at = int(value.removesuffix("m")) / 1000 if value.endswith("m") else float(value)
    assert 0 < hpa_at == keda_at < 1

    for scaling in (behavior, hpa["spec"]["behavior"]):
        assert scaling["scaleUp"]["stabilizationWindowSeconds"] == 0
        assert scaling["scaleDown"]["stabilizationWindowSeconds"] >= 300
    assert not (AUTOSCALING / "kustomization.yaml").exists()


# --------------------------------------------------------------------------- what alerts count

#: Reasons answered on the reserved paths only (``/admin/*``, ``/healthz``...), which are
#: never counted in ``admission_requests_total``.
RESERVED_ONLY_REASONS = frozenset({"not_found", "method_not_allowed", "no_previous_config"})
#: 429 because the service's queues are full, not because of the tenant's own quota:
#: counted as capacity (the alert and the dashboard agree on this).
CAPACITY_429 = frozenset({"tenant_queue_full"})


def _counted_reasons() -> dict[str, int]:
    """Every reason ``admission_requests_total`` may carry for a refusal, with its status."""
    return {
        cls.reason: cls.status
        for cls in _subclasses(ProxyError)
        if "reason" in vars(cls) and cls.reason not in RESERVED_ONLY_REASONS
    }


def _reason_matcher(expr: str, op: str) -> set[str]:
    """The reasons of the one ``reason`` matcher with ``op`` on admission_requests_total."""
    found = [
        set(value.split("|"))
        for metric, matchers in _selectors(expr)[0]
        if metric == "admission_requests_total"
        for label, matcher_op, value in matchers
        if label == "reason" and matcher_op == op
    ]
    assert len(found) == 1, f"expected one reason{op} matcher in {expr}"
    return found[0]


def test_rejection_alert_counts_every_capacity_refusal() -> None:
    """AdmissionRejectionsRising counts every 503 the service sheds for capacity (Redis
    refusing with state_unavailable and the connection cap included) and the full queue,
    and nothing a tenant earned itself: a reason left out is an outage nobody is told of."""
    reasons = _counted_reasons()
    capacity = {r for r, status in reasons.items() if status == 503} - {"shutting_down"}
    capacity |= CAPACITY_429
    (rule,) = [r for r in _alert_rules() if r["alert"] == "AdmissionRejectionsRising"]
    assert _reason_matcher(str(rule["expr"]), "=~") == capacity


def test_goodput_ratio_leaves_out_what_tenants_earned_themselves() -> None:
    """The goodput ratio (alert and dashboard alike) is over the requests the service took
    on: every 4xx the proxy answers for the tenant's own doing (keys, quotas, caps, models,
    routes, bodies) and clients that left are out of it. A tenant that spent its daily
    token quota must not page anyone as an outage."""
    own = {r for r, status in _counted_reasons().items() if 400 <= status < 500} - CAPACITY_429
    expected = own | {"client_disconnected"}
    (rule,) = [r for r in _alert_rules() if r["alert"] == "AdmissionGoodputFalling"]
    ratios = [("alert AdmissionGoodputFalling", str(rule["expr"]))]
    ratios += [
        (where, expr)
        for where, expr in _queries()
        if where.startswith("panel") and "admission_goodput_total" in expr and "/" in expr
    ]
    assert len(ratios) == 2, ratios
    for where, expr in ratios:
        assert _reason_matcher(expr, "!~") == expected, where


def _grouping(expr: str, metric: str) -> set[str]:
    """The labels of the ``by (...)`` of the aggregation applied to ``metric``."""
    match = re.search(r"\bby\s*\(([^)]*)\)\s*\(\s*" + re.escape(metric) + r"\b", expr)
    assert match is not None, f"{metric} is not aggregated by labels in {expr}"
    return {label.strip() for label in match[1].split(",")}


def test_alerts_on_process_local_queues_stay_per_instance() -> None:
    """Queues and their queue_capacity are each process's own (Redis shares limits, not
    queues): a depth threshold holds per instance. Summed over the gateway's pods, two
    half-empty queues fired the 'near capacity' alert."""
    for rule in _alert_rules():
        expr = str(rule["expr"])
        if "admission_queue_depth" in {m for m, _ in _selectors(expr)[0]}:
            assert "instance" in _grouping(expr, "admission_queue_depth"), rule["alert"]


def test_replica_limit_panel_tells_shared_seats_from_separate_engines() -> None:
    """Every proxy that shares seats in Redis reports the replica's whole limit: summed over
    the gateway's pods (or compose's two proxies) the limit read double. Sidecar pods each
    front their own engine under the same name, whose limits do add up. The panel tells
    the two apart by ``admission_instances`` (promtool checks the arithmetic below)."""
    using = [(w, e) for w, e in _queries() if "admission_replica_limit" in e]
    assert using
    for where, expr in using:
        metrics = {m for m, _ in _selectors(expr)[0]}
        assert "admission_instances" in metrics, f"{where}: limit summed over shared instances"


@pytest.mark.parametrize(
    "name",
    ["AdmissionSharedStateDown", "AdmissionConfigReloadInvalid", "AdmissionNoHealthyReplica"],
)
def test_alerts_the_deployment_guide_promises_exist(name: str) -> None:
    """docs/DEPLOYMENT.md's alert table is alerts.yml, name for name, and the signals it
    tells operators to alert on (shared state down, an invalid config) have a rule."""
    rules = {r["alert"]: r for r in _alert_rules()}
    assert name in rules
    guide = (ROOT / "docs" / "DEPLOYMENT.md").read_text(encoding="utf-8")
    section = guide[guide.index("## What to watch") :]
    section = section[: section.index("\n## ", 1)]
    table = set(re.findall(r"^\| `(Admission\w+)` \|", section, re.MULTILINE))
    assert table == set(rules)


# --------------------------------------------------------------------------- promtool

PROMETHEUS = DEPLOY / "prometheus"


def _promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        pytest.skip("promtool not installed (scripts/test installs Debian's prometheus as root)")
    return found


def _run_promtool(*args: str) -> str:
    result = subprocess.run(
        [_promtool(), *args], capture_output=True, text=True, timeout=60, check=False
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    return output


def test_prometheus_config_and_rules_pass_promtool() -> None:
    """prometheus.yml and alerts.yml load as Prometheus loads them, and every alert fires
    (and stays quiet) on the situations of alerts_test.yml."""
    _run_promtool("check", "config", str(PROMETHEUS / "prometheus.yml"))
    _run_promtool("check", "rules", str(PROMETHEUS / "alerts.yml"))
    tested = yaml.safe_load((PROMETHEUS / "alerts_test.yml").read_text(encoding="utf-8"))
    assert tested["rule_files"] == ["alerts.yml"]
    covered = {
        case["alertname"] for test in tested["tests"] for case in test.get("alert_rule_test", [])
    }
    assert covered == {r["alert"] for r in _alert_rules()}, "every alert has a unit test"
    _run_promtool("test", "rules", str(PROMETHEUS / "alerts_test.yml"))


def _instant(expr: str) -> str:
    """A dashboard query as Prometheus gets it once Grafana filled its variables."""
    return expr.replace("$__rate_interval", "1m").replace('"$tenant"', '".*"')


def _series(metric: str, instance: str, value: float, **labels: str) -> dict[str, str]:
    text = ",".join(f'{k}="{v}"' for k, v in {"instance": instance, **labels}.items())
    return {"series": f"{metric}{{{text}}}", "values": f"{value}x5"}


def test_every_query_parses_and_replica_limits_add_up(tmp_path: Path) -> None:
    """Every dashboard query (variables filled), alert and scaling query parses in
    Prometheus; the replica-limit query counts a gateway's shared limit once and sidecar
    pods' separate engines each."""
    expressions = [_instant(expr) for _, expr in _queries()]
    keda = _load(AUTOSCALING / "keda-scaledobject.yaml")
    expressions += [t["metadata"]["query"] for t in keda["spec"]["triggers"]]
    parse_only = [{"expr": expr, "eval_time": "1m", "exp_samples": []} for expr in expressions]
    (limit_query,) = {
        _instant(t["expr"])
        for p in _panels(_dashboard()["panels"])
        for t in p.get("targets", [])
        if "admission_replica_limit" in t["expr"]
    }
    limit, replica = "admission_replica_limit", "admission_instances"
    gateway = [_series(limit, f"gw-{i}", 16, replica="vllm-0") for i in "ab"]
    gateway += [_series(replica, f"gw-{i}", 2) for i in "ab"]
    sidecar = [_series(limit, f"sc-{i}", 16, replica="vllm") for i in "abc"]
    sidecar += [_series(replica, f"sc-{i}", 1) for i in "abc"]
    expected = [
        {"labels": '{replica="vllm-0"}', "value": 16},
        {"labels": '{replica="vllm"}', "value": 48},
    ]
    (tmp_path / "none.yml").write_text("groups: []\n", encoding="utf-8")
    tests = {
        "rule_files": ["none.yml"],
        "evaluation_interval": "1m",
        "tests": [
            {"interval": "1m", "input_series": [], "promql_expr_test": parse_only},
            {
                "interval": "1m",
                "input_series": gateway + sidecar,
                "promql_expr_test": [
                    {"expr": limit_query, "eval_time": "2m", "exp_samples": expected}
                ],
            },
        ],
    }
    path = tmp_path / "queries_test.yml"
    path.write_text(yaml.safe_dump(tests, sort_keys=False), encoding="utf-8")
    _run_promtool("test", "rules", str(path))


# --------------------------------------------------------------------------- environment


def _unwrap(annotation: Any) -> Any:
    """``X | None`` and ``Annotated[X, ...]`` -> X."""
    while True:
        origin = get_origin(annotation)
        if origin is Annotated:
            annotation = get_args(annotation)[0]
        elif origin in (Union, UnionType):
            options = [a for a in get_args(annotation) if a is not type(None)]
            if len(options) != 1:
                return annotation
            annotation = options[0]
        else:
            return annotation


def _settings_read(name: str) -> bool:
    """Whether pydantic-settings maps ``name`` onto a key of the config (prefix
    ``ADMISSION_``, ``__`` between levels, any case): a typo is silently ignored."""
    if not name.upper().startswith(ENV_PREFIX):
        return False
    parts = name[len(ENV_PREFIX) :].lower().split(ENV_NESTED_DELIMITER)
    current: Any = Config
    for index, part in enumerate(parts):
        if isinstance(current, type) and issubclass(current, BaseModel):
            field = current.model_fields.get(part)
            if field is None:
                return False
            current = _unwrap(field.annotation)
        elif get_origin(current) is dict and part:
            current = _unwrap(get_args(current)[1])
        else:
            return False
        if index == len(parts) - 1:
            return True
    return False


#: Variables the OpenTelemetry SDK reads (``OTEL_SERVICE_NAME``, ``OTEL_EXPORTER_OTLP_*``...).
OTEL_VARIABLES = frozenset(
    value
    for name, value in vars(otel_environment).items()
    if name.startswith("OTEL_") and isinstance(value, str)
)
#: Read by the NVIDIA container toolkit, for NVML in a container that holds no GPU.
NVIDIA_VARIABLES = frozenset({"NVIDIA_VISIBLE_DEVICES", "NVIDIA_DRIVER_CAPABILITIES"})
#: Set by ``serve --workers N`` for its workers, read by them (workers.py).
WORKER_VARIABLES = frozenset({WORKER_GROUP_ENV, WORKER_COUNT_ENV})


def _read_by_the_proxy(name: str, config: Config) -> bool:
    """Whether a proxy running ``config`` reads the variable ``name``."""
    named = {config.admin.token_env} | {r.api_key_env for r in config.replicas if r.api_key_env}
    if any(r.gpu_index is not None for r in config.replicas):
        named |= NVIDIA_VARIABLES
    return name in named or name in OTEL_VARIABLES or _settings_read(name)


def test_env_names_the_settings_read() -> None:
    """The checker itself: real overrides in, typos and service-link names out."""
    for name in ("ADMISSION_SERVER__PORT", "ADMISSION_REPLICAS", "admission_state__redis_url",
                 "ADMISSION_TENANTS__ACME__WEIGHT", "ADMISSION_PRIORITIES__BATCH__WEIGHT",
                 "ADMISSION_ROUTING__POLICY", "ADMISSION_MODE"):  # fmt: skip
        assert _settings_read(name), name
    for name in ("ADMISSION_STATE_BACKEND", "ADMISSION_SERVER__PROT", "ADMISSION_PROXY_PORT",
                 "ADMISSION_REPLICAS__0__URL", "ADMISSION_SERVER__PORT__X", "ADMISSION_TENANTS__",
                 "OTHER_SERVER__PORT", "ADMISSION_ADMIN_TOKEN"):  # fmt: skip
        assert not _settings_read(name), name


def _proxy_environments() -> Iterator[tuple[str, list[str], Config]]:
    """(where, variable names, the config it runs) for every proxy container we ship."""
    compose = _compose()
    for name in _proxy_services(compose):
        service = compose["services"][name]
        env = {k: str(v) for k, v in service["environment"].items()}
        config = _config_from(_host_path(service, _cli(service["command"]).config), env)
        yield f"compose {name}", list(env), config
    for mode in ("gateway", "sidecar"):
        objects, generated, _ = _kustomize(mode)
        pod = _one(objects, "Deployment")["spec"]["template"]["spec"]
        proxy = _container(pod, "admission-proxy")
        (config_file,) = [generated[v["configMap"]["name"]] for v in pod["volumes"]
                          if "configMap" in v]  # fmt: skip
        yield f"kubernetes {mode}", [e["name"] for e in proxy["env"]], _config_from(config_file)


def test_every_variable_given_to_the_proxy_is_one_it_reads() -> None:
    """Each variable compose and the manifests give the proxy is an ``ADMISSION_*``
    override that reaches a config key, the admin token or an engine key the config
    names, a standard OTEL_* one or the NVIDIA toolkit's for NVML: a misspelt override
    (ADMISSION_STATE_BACKEND) would be ignored without a word."""
    seen = 0
    for where, names, config in _proxy_environments():
        for name in names:
            seen += 1
            assert _read_by_the_proxy(name, config), f"{where}: nothing reads {name}"
    assert seen


#: ``ADMISSION_...`` written out in full (not ``ADMISSION_*`` or ``ADMISSION_<SECTION>``).
_ADMISSION_NAME = re.compile(r"\bADMISSION_[A-Za-z0-9_]*[A-Za-z0-9](?![\w*<])")


def test_every_variable_the_deployment_files_name_exists() -> None:
    """Every ``ADMISSION_*`` variable named in the Dockerfile (its HEALTHCHECK reads one),
    compose, deploy/ and docs/DEPLOYMENT.md is one the proxy reads."""
    default = make_config(["http://127.0.0.1:9"])
    files = [ROOT / "Dockerfile", ROOT / "docker-compose.yml", ROOT / "docs" / "DEPLOYMENT.md"]
    files += [p for p in DEPLOY.rglob("*") if p.is_file()]
    found = 0
    for path in files:
        for name in _ADMISSION_NAME.findall(path.read_text(encoding="utf-8")):
            found += 1
            known = _read_by_the_proxy(name, default) or name in WORKER_VARIABLES
            assert known, f"{_rel(path)}: nothing reads {name}"
    assert found


# --------------------------------------------------------------------------- probes, live


def _probe_budget_s(probe: dict[str, Any]) -> int:
    """How long the kubelet lets a probe fail before it acts (restart, or no traffic)."""
    delay = int(probe.get("initialDelaySeconds", 0))
    return delay + int(probe.get("periodSeconds", 10)) * int(probe.get("failureThreshold", 3))


async def _get_status(session: aiohttp.ClientSession, url: str) -> tuple[int, Any]:
    async with session.get(url) as response:
        return response.status, await response.json()


async def _until_status(
    session: aiohttp.ClientSession, url: str, status: int, within_s: float
) -> Any:
    """Poll ``url`` until it answers ``status``; its JSON body then."""
    async with asyncio.timeout(within_s):
        while True:
            got, body = await _get_status(session, url)
            if got == status:
                return body
            await asyncio.sleep(0.05)


@pytest.mark.parametrize("mode", ["sidecar", "gateway"])
async def test_kubernetes_probes_answer_as_the_manifest_expects(
    mode: str, request: pytest.FixtureRequest
) -> None:
    """The proxy container's own command on its ConfigMap file, as a real process: liveness
    answers 200 within the liveness probe's budget while the engine still loads (a restart
    would not help), readiness is 503 naming the starting replicas until the engine
    answers, then 200; on SIGTERM readiness turns 503 while liveness stays 200 (the drain
    is not a death), and the process exits before the pod's grace period ends. Only the
    listen address (a loopback port the OS picks) and the engine URLs differ; the gateway
    gets a real Redis at its redis_url."""
    objects, generated, _ = _kustomize(mode)
    pod = _one(objects, "Deployment")["spec"]["template"]["spec"]
    proxy = _container(pod, "admission-proxy")
    args = _cli(proxy["args"])
    (config_file,) = [generated[v["configMap"]["name"]] for v in pod["volumes"]
                      if "configMap" in v]  # fmt: skip
    assert PurePosixPath(args.config).parent == PurePosixPath(CONFIG_DIR)
    ready_path = proxy["readinessProbe"]["httpGet"]["path"]
    live_path = proxy["livenessProbe"]["httpGet"]["path"]
    live_budget_s = _probe_budget_s(proxy["livenessProbe"])
    stop_budget_s = pod["terminationGracePeriodSeconds"] - _sleep_s(proxy)

    engine = await start_sim(SimConfig(seed=0))
    await engine.refuse_for(None)  # the engine is still loading its model
    document = _load(config_file)
    replicas = [{**r, "url": engine.url, "metrics_url": None} for r in document["replicas"]]
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith(ENV_PREFIX)}
    env["ADMISSION_REPLICAS"] = json.dumps(replicas)
    if document.get("state", {}).get("backend") == "redis":
        env["ADMISSION_STATE__REDIS_URL"] = request.getfixturevalue("redis_server").url
    argv = [*proxy["args"]]
    argv[argv.index(args.config)] = str(config_file)
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "proxy", *argv, "--host", "127.0.0.1", "--port", "0",
        stdout=asyncio.subprocess.PIPE, env=env,
    )  # fmt: skip
    events: list[dict[str, Any]] = []
    try:
        assert process.stdout is not None
        async with asyncio.timeout(live_budget_s):
            while not any(e.get("event") == "listening" for e in events):
                line = await process.stdout.readline()
                assert line, f"the proxy exited before listening: {events}"
                events.append(json.loads(line))
        port = next(e["port"] for e in events if e.get("event") == "listening")
        drain = asyncio.ensure_future(_read_events(process, events))
        base = f"http://127.0.0.1:{port}"
        async with aiohttp.ClientSession() as session:
            assert (await _get_status(session, base + live_path))[0] == 200
            status, body = await _get_status(session, base + ready_path)
            assert status == 503
            assert body["starting"] == [r["name"] for r in replicas]

            await engine.accept()  # loaded: the proxy probes, warms up and takes traffic
            await _until_status(session, base + ready_path, 200, within_s=30)
            assert (await _get_status(session, base + live_path))[0] == 200

            # A stream in flight holds the drain open until its client leaves.
            stream = await session.post(
                base + "/v1/chat/completions",
                json={"model": "sim-model", "messages": [{"role": "user", "content": "hi"}],
                      "max_tokens": 60_000, "stream": True},
                headers={"Authorization": f"Bearer {_example_key(config_file)}"},
            )  # fmt: skip
            assert stream.status == 200, await stream.text()
            await stream.content.readline()  # tokens are flowing
            process.send_signal(signal.SIGTERM)
            body = await _until_status(session, base + ready_path, 503, within_s=5)
            assert body["shutting_down"] is True
            assert (await _get_status(session, base + live_path))[0] == 200
            stream.close()
        async with asyncio.timeout(stop_budget_s):
            assert await process.wait() == 0
        await drain
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
        await engine.close()


def _example_key(config_file: Path) -> str:
    """The example key a config's comment hashes (``printf '%s' 'KEY' | sha256sum``), checked
    against the ``sha256:`` entries it stands for."""
    match = re.search(r"printf '%s' '([^']+)' \| sha256sum", config_file.read_text("utf-8"))
    assert match is not None, f"{_rel(config_file)} names no example key"
    config = _config_from(config_file)
    stored = {entry for tenant in config.tenants.values() for entry in tenant.api_keys}
    assert f"sha256:{hash_api_key(match[1])}" in stored, match[1]
    return match[1]


async def _read_events(process: asyncio.subprocess.Process, events: list[dict[str, Any]]) -> None:
    """Keep the process's log pipe drained (its JSON lines) until it closes."""
    assert process.stdout is not None
    while line := await process.stdout.readline():
        events.append(json.loads(line))


# --------------------------------------------------------------------------- processes and CPU


def _cores(quantity: str | int | float) -> float:
    """A Kubernetes CPU quantity (``500m``, ``2``) in cores."""
    text = str(quantity)
    return int(text[:-1]) / 1000 if text.endswith("m") else float(text)


@pytest.mark.parametrize("mode", ["gateway", "sidecar"])
def test_kubernetes_cpu_request_fits_the_proxy_processes(mode: str) -> None:
    """One proxy process uses at most one core; ``serve --workers N`` uses N (and needs
    Redis for N > 1). The CPU a pod requests for the proxy is no more than its processes
    can use: ``cpu: 4`` without ``--workers 4`` reserves three idle cores."""
    objects, generated, _ = _kustomize(mode)
    pod = _one(objects, "Deployment")["spec"]["template"]["spec"]
    proxy = _container(pod, "admission-proxy")
    args = _cli(proxy["args"])
    (config_file,) = [generated[v["configMap"]["name"]] for v in pod["volumes"]
                      if "configMap" in v]  # fmt: skip
    assert workers_refusal(_config_from(config_file), args.workers) is None
    assert 0 < _cores(proxy["resources"]["requests"]["cpu"]) <= args.workers


def test_compose_healthcheck_probes_the_port_the_proxy_serves() -> None:
    """The image's HEALTHCHECK probes ``$ADMISSION_SERVER__PORT`` (else the default port):
    in every compose proxy that is the port its config serves, or the proxy stays
    unhealthy and what waits for it (traffic) never starts."""
    compose = _compose()
    for name in _proxy_services(compose):
        service = compose["services"][name]
        env = {k: str(v) for k, v in service["environment"].items()}
        config = _config_from(_host_path(service, _cli(service["command"]).config), env)
        probed = int(env.get("ADMISSION_SERVER__PORT", DEFAULT_PORT))
        assert probed == config.server.port, name
    waiting = compose["services"]["traffic"]["depends_on"]
    assert waiting["proxy"]["condition"] == "service_healthy"


#: A repository path in prose or a comment: ``deploy/...``, ``config/...``, ``docs/...``.
_REPO_PATH = re.compile(r"(?<![\w/.-])((?:deploy|config|docs|scripts|bench)/[\w./-]*\w)")


def test_every_repository_path_the_deployment_files_name_exists() -> None:
    """Paths docs/DEPLOYMENT.md, the Dockerfile, compose and deploy/ send a reader to
    (``kubectl apply -k deploy/kubernetes/gateway``, ``deploy/prometheus/alerts.yml``) exist."""
    files = [ROOT / "Dockerfile", ROOT / "docker-compose.yml", ROOT / "docs" / "DEPLOYMENT.md"]
    files += [p for p in DEPLOY.rglob("*") if p.is_file()]
    named = 0
    for path in files:
        for found in _REPO_PATH.findall(path.read_text(encoding="utf-8")):
            named += 1
            assert (ROOT / found).exists(), f"{_rel(path)} names {found}, which does not exist"
    assert named


@pytest.mark.parametrize("mode", ["gateway", "sidecar"])
def test_kustomize_builds_what_kubectl_applies(mode: str) -> None:
    """``kubectl kustomize`` (what ``kubectl apply -k`` applies) builds each directory, with
    the config file as the ConfigMap's ``config.yaml`` and the image as kustomization names."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl not installed")
    directory = DEPLOY / "kubernetes" / mode
    result = subprocess.run(
        [kubectl, "kustomize", str(directory)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    built = [d for d in yaml.safe_load_all(result.stdout) if d]
    objects, generated, kustomization = _kustomize(mode)
    assert sorted((o["kind"], o["metadata"]["name"]) for o in built) == sorted(
        [(o["kind"], o["metadata"]["name"]) for o in objects]
        + [("ConfigMap", name) for name in generated]
    )
    for name, path in generated.items():
        (config_map,) = [o for o in built if o["kind"] == "ConfigMap"]
        assert config_map["metadata"]["name"] == name
        assert config_map["data"] == {path.name: path.read_text(encoding="utf-8")}
    (image,) = kustomization["images"]
    pod = _one(built, "Deployment")["spec"]["template"]["spec"]
    assert _container(pod, "admission-proxy")["image"] == f"{image['newName']}:{image['newTag']}"


async def _raw_get(port: int, path: str) -> tuple[int, dict[str, str], bytes]:
    """One GET on a new connection (as the kubelet and Prometheus open one per probe)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(f"GET {path} HTTP/1.1\r\nHost: probe\r\n\r\n".encode())
        await writer.drain()
        head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
        headers = dict(line.split(": ", 1) for line in head[1:] if line)
        body = await reader.readexactly(int(headers["Content-Length"]))
        return int(head[0].split()[1]), headers, body
    finally:
        writer.close()


async def test_probes_and_scrapes_answer_at_the_connection_cap(tmp_path: Path) -> None:
    """At ``server.max_connections`` a new client connection is answered 503
    overloaded_connections, but the kubelet's probes and Prometheus' scrape still get their
    answers (liveness 200: a restart would drop every connection; readiness by its
    replicas; metrics while the overload is on), each closing its connection after."""
    path = tmp_path / "proxy.yaml"
    document = {
        "server": {"max_connections": 2, "header_ms": 60_000},
        "replicas": [{"name": "r0", "url": "http://127.0.0.1:9", "max_concurrency": 1}],
        "tenants": {"a": {"api_keys": [KEY_A]}},
    }
    path.write_text(yaml.safe_dump(document), encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith(ENV_PREFIX)}
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "proxy", "serve", "--config", str(path),
        "--host", "127.0.0.1", "--port", "0", stdout=asyncio.subprocess.PIPE, env=env,
    )  # fmt: skip
    events: list[dict[str, Any]] = []
    held: list[asyncio.StreamWriter] = []
    try:
        assert process.stdout is not None
        async with asyncio.timeout(20):
            while not any(e.get("event") == "listening" for e in events):
                line = await process.stdout.readline()
                assert line, f"the proxy exited before listening: {events}"
                events.append(json.loads(line))
        port = next(e["port"] for e in events if e.get("event") == "listening")
        drain = asyncio.ensure_future(_read_events(process, events))
        for _ in range(2):
            held.append((await asyncio.open_connection("127.0.0.1", port))[1])
        status, headers, _ = await _raw_get(port, "/v1/models")
        assert (status, headers["X-Admission-Reason"]) == (503, "overloaded_connections")

        status, headers, body = await _raw_get(port, "/healthz")
        assert status == 200 and headers["Connection"] == "close"
        status, headers, body = await _raw_get(port, "/readyz")
        assert status == 503 and "X-Admission-Reason" not in headers
        assert json.loads(body)["ready"] is False  # no replica: not the connection cap
        status, headers, body = await _raw_get(port, "/metrics")
        assert status == 200 and b"admission_requests_total" in body
        assert b'reason="overloaded_connections"' in body
        status, headers, _ = await _raw_get(port, "/admin/state")
        assert (status, headers["X-Admission-Reason"]) == (503, "overloaded_connections")
    finally:
        for writer in held:
            writer.close()
        if process.returncode is None:
            process.send_signal(signal.SIGTERM)
            async with asyncio.timeout(20):
                await process.wait()
    await drain


def test_one_pod_monitor_selector_finds_every_proxy_pod() -> None:
    """Gateway and sidecar pods (each with a proxy) carry the label the scrape comments
    and docs/DEPLOYMENT.md tell a PodMonitor to select, on the port named ``http``; the
    gateway's Redis does not (it has no /metrics)."""
    key, value = "app.kubernetes.io/part-of", "admission-proxy"
    for mode in ("gateway", "sidecar"):
        objects, _, _ = _kustomize(mode)
        for kind in ("Deployment", "StatefulSet"):
            for workload in [o for o in objects if o["kind"] == kind]:
                template = workload["spec"]["template"]
                names = {c["name"] for c in template["spec"]["containers"]}
                labelled = template["metadata"]["labels"].get(key) == value
                assert labelled == ("admission-proxy" in names), workload["metadata"]["name"]
                if labelled:
                    proxy = _container(template["spec"], "admission-proxy")
                    assert "http" in {p["name"] for p in proxy["ports"]}
    selector = f"{key}={value}"
    assert selector in (DEPLOY / "prometheus" / "prometheus.yml").read_text(encoding="utf-8")
    guide = (ROOT / "docs" / "DEPLOYMENT.md").read_text(encoding="utf-8")
    assert f"`{key}: {value}`" in guide


@pytest.mark.parametrize("mode", ["gateway", "sidecar"])
def test_containers_of_other_images_can_run_as_the_pods_uid(mode: str) -> None:
    """A container of another image (vLLM) run under the pod's numeric uid has no passwd
    entry for it: ``getpass.getuser()`` (torch's compile cache) raises unless ``USER`` is
    set, and the home directory is not its own unless ``HOME`` is. Our image defines its
    uid (the Dockerfile's USER), so the proxy needs neither."""
    objects, _, kustomization = _kustomize(mode)
    ours = {image["name"] for image in kustomization["images"]}
    for kind in ("Deployment", "StatefulSet"):
        for workload in [o for o in objects if o["kind"] == kind]:
            pod = workload["spec"]["template"]["spec"]
            for container in pod["containers"]:
                if container["image"] in ours:
                    user = _final("USER")[-1].split(":")[0]
                    assert str(pod["securityContext"]["runAsUser"]) == user
                    continue
                uid = container.get("securityContext", {}).get("runAsUser")
                uid = uid or pod.get("securityContext", {}).get("runAsUser")
                if uid is None or container["image"].startswith("redis:"):
                    continue  # the image's own user; redis' uid 999 is in its passwd
                env = {e["name"] for e in container.get("env", [])}
                assert {"HOME", "USER"} <= env, container["name"]


# --------------------------------------------------------------------------- the guide

GUIDE = ROOT / "docs" / "DEPLOYMENT.md"


def _guide_blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", GUIDE.read_text(encoding="utf-8"), re.DOTALL)


def test_every_config_snippet_in_the_guide_is_valid() -> None:
    """Each YAML snippet of docs/DEPLOYMENT.md, completed with a minimal replica and tenant
    where it has none, passes the config schema (key names, types, enum values); the
    ``routes`` snippet is the default list itself."""
    validator = jsonschema.Draft202012Validator(json.loads(schema.render()))
    minimal = {
        "replicas": [{"name": "r0", "url": "http://127.0.0.1:9", "max_concurrency": 1}],
        "tenants": {"a": {"api_keys": ["k"]}},
    }
    blocks = _guide_blocks("yaml")
    assert blocks
    for block in blocks:
        snippet = yaml.safe_load(block)
        errors = [
            f"{list(e.absolute_path)}: {e.message}"
            for e in validator.iter_errors({**minimal, **snippet})
        ]
        assert errors == [], block
    (routes,) = [yaml.safe_load(b)["routes"] for b in blocks if "routes:" in b.split("\n")[0]]
    assert tuple(routes) == DEFAULT_ROUTES


#: An ``admission-proxy ...`` command in backticks (wrapped lines joined).
_COMMAND = re.compile(r"`(admission-proxy [^`]+)`")
#: The guide's placeholders, as a reader fills them in.
PLACEHOLDERS = {"PATH": "config.yaml", "N": "2"}


def _guide_commands() -> list[list[str]]:
    text = re.sub(r"\s*\n\s*", " ", GUIDE.read_text(encoding="utf-8"))
    commands = [shlex.split(c)[1:] for c in _COMMAND.findall(text)]
    for block in _guide_blocks("sh"):
        for line in block.splitlines():
            if not line.startswith("docker run "):
                continue
            words = shlex.split(line, comments=True)
            commands.append(words[words.index("admission-proxy") + 1 :])
    return [[PLACEHOLDERS.get(w, w) for w in command] for command in commands]


def test_every_command_the_guide_gives_is_the_cli() -> None:
    """Each ``admission-proxy`` command in docs/DEPLOYMENT.md (and each ``docker run`` of
    the image with arguments) parses with the real CLI; a ``loadtest`` named in prose gets
    the one flag it needs (``--url``) from the reader."""
    commands = [c for c in _guide_commands() if c]
    assert len(commands) >= 4
    for command in commands:
        if command[0] == "loadtest" and "--url" not in command:
            command = [*command, "--url", "http://127.0.0.1:8080"]
        _cli(command)
    lines = [line for block in _guide_blocks("sh") for line in block.splitlines()]
    schema_runs = [
        shlex.split(line, comments=True)[3:]
        for line in lines
        if line.startswith("python -m proxy.schema")
    ]
    assert sorted(schema_runs) == [["--check"], ["--write"]]
    assert schema.main(["--check"]) == 0  # the committed schema is what --write writes


def test_the_guides_kubectl_targets_are_the_manifests_objects() -> None:
    """``deployment/NAME`` and ``kubectl apply -k DIR`` in the guide name Deployments and
    kustomizations that exist."""
    text = re.sub(r"\s*\n\s*", " ", GUIDE.read_text(encoding="utf-8"))
    deployments = {
        o["metadata"]["name"]
        for mode in ("gateway", "sidecar")
        for o in _kustomize(mode)[0]
        if o["kind"] == "Deployment"
    }
    named = re.findall(r"`?deployment/([\w-]+)`", text)
    assert named and set(named) <= deployments
    applied = re.findall(r"kubectl apply -k (deploy/[\w/.-]*\w)", text)
    assert applied
    for directory in applied:
        assert (ROOT / directory / "kustomization.yaml").is_file(), directory


def test_the_guide_names_every_override_compose_gives_the_proxy() -> None:
    """docs/DEPLOYMENT.md says which keys compose overrides from the environment: exactly
    the ``ADMISSION_*`` variables the compose proxies get."""
    guide = GUIDE.read_text(encoding="utf-8")
    section = guide[guide.index("## The whole stack on one machine") :]
    section = section[: section.index("\n## ", 1)]
    named = set(_ADMISSION_NAME.findall(section))
    compose = _compose()
    for name in _proxy_services(compose):
        given = {k for k in compose["services"][name]["environment"] if k.startswith(ENV_PREFIX)}
        assert given == named, name


def test_containers_listen_beyond_their_own_loopback() -> None:
    """The config baked into the image and each Kubernetes ConfigMap listen on every
    interface at the port the container exposes: on loopback, no probe, Service or
    published port could reach the proxy. (Compose overrides demo.yaml's loopback host.)"""
    baked = _config_from(ROOT / "config" / "example.yaml")
    assert baked.server.host in ("0.0.0.0", "::")
    assert [str(baked.server.port)] == _final("EXPOSE")
    for mode in ("gateway", "sidecar"):
        _, generated, _ = _kustomize(mode)
        for config_file in generated.values():
            assert _config_from(config_file).server.host in ("0.0.0.0", "::"), mode
