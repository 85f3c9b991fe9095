"""An operator writing the YAML by hand: the mistakes people make, said in words at their path.

Each test is one mistake (or one habit, such as YAML merge keys) met while
writing configs from config/example.yaml and docs/REFERENCE.md, and what
``check-config``, ``serve`` and ``GET /admin/config`` must say about it.
"""

from __future__ import annotations

import asyncio
import io
import os
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import yaml

from proxy.cli import EXIT_INVALID, EXIT_OK, check_config
from proxy.config_warnings import config_warnings
from proxy.reload import needs_restart
from proxy.settings import MAX_CONFIG_BYTES, ConfigError, dump_effective_config, parse_config
from tests.conftest import ProxyUnderTest, ServerFactory
from tests.fleet import CLI as CLI_ARGS
from tests.fleet import ProxyProcess
from tests.helpers import samples_by_label, wait_for
from tests.redis_server import RedisServer
from tests.upstreams import build_upstream

Start = Callable[..., Awaitable[ProxyUnderTest]]

REPO = Path(__file__).resolve().parent.parent
REPLICA = "replicas:\n  - {name: gpu-0, url: 'http://127.0.0.1:9001', max_concurrency: 4}\n"
TENANT = "tenants:\n  acme: {api_keys: [sk-acme-1]}\n"
CHAT = "/v1/chat/completions"


def _closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """No ADMISSION_* variable of the developer's shell leaks into a test."""
    for name in list(os.environ):
        if name.upper().startswith("ADMISSION_"):
            monkeypatch.delenv(name)


def _issues(text: str) -> dict[str, str]:
    with pytest.raises(ConfigError) as caught:
        parse_config(text)
    return {issue.path: issue.message for issue in caught.value.issues}


def _check(tmp_path: Path, text: str) -> tuple[int, str, str]:
    path = tmp_path / "proxy.yaml"
    path.write_text(text)
    out, err = io.StringIO(), io.StringIO()
    code = check_config(str(path), out, err)
    return code, out.getvalue(), err.getvalue()


# --- YAML habits -----------------------------------------------------------


def test_a_key_written_beside_a_merge_key_overrides_the_merged_one() -> None:
    """Shared tenant settings through an anchor and ``<<: *defaults``, one of them
    overridden in place: YAML says the written key wins. It was refused as a "duplicate
    key" (the merged keys were counted as written twice). A key really written twice in
    one mapping is still refused, at its line."""
    text = REPLICA + (
        "tenants:\n"
        "  acme: &defaults\n"
        "    api_keys: [sk-acme-1]\n"
        "    queue_capacity: 8\n"
        "    rate_per_s: 5\n"
        "  globex:\n"
        "    <<: *defaults\n"
        "    api_keys: [sk-globex-1]\n"
        "    queue_capacity: 16\n"
        "  initech:\n"
        "    <<: [*defaults]\n"
        "    api_keys: [sk-initech-1]\n"
    )
    config = parse_config(text)
    globex, initech = config.tenants["globex"], config.tenants["initech"]
    assert (globex.api_keys, globex.queue_capacity, globex.rate_per_s) == (("sk-globex-1",), 16, 5)
    assert (initech.api_keys, initech.queue_capacity) == (("sk-initech-1",), 8)

    twice = (
        REPLICA + "tenants:\n  acme:\n    <<: {weight: 2}\n    api_keys: [a]\n    api_keys: [b]\n"
    )
    assert _issues(twice) == {"<yaml>": "line 7, column 5: duplicate key 'api_keys'"}


def test_a_tab_in_the_indentation_says_yaml_wants_spaces() -> None:
    issues = _issues(REPLICA + "tenants:\n  acme:\n\tapi_keys: [k]\n")
    assert issues["<yaml>"].startswith("line 5, column 1: found character '\\t'")
    assert issues["<yaml>"].endswith("YAML indents with spaces, never tabs")


def test_a_misspelt_key_is_told_the_key_it_resembles() -> None:
    """``api_key`` for ``api_keys``, ``headrom``, ``budget``: "unknown key" alone left the
    operator comparing letters with the reference; the nearest key of that section is
    named, at any depth (lists and tenant names stepped over). Nothing close: no guess."""
    text = (
        "replicas:\n"
        "  - {name: gpu-0, url: 'http://127.0.0.1:9001', max_concurrency: 4, headrom: 1}\n"
        "budget: {queue_ms: 1}\n"
        "routing: {polcy: x}\n"
        "tenants:\n"
        "  acme: {api_key: [k1], token_quota: {per_minut: 3}, budgets: {total: 5}, zzz: 1}\n"
    )
    assert _issues(text) == {
        "replicas[0].headrom": "unknown key; did you mean 'headroom'?",
        "budget": "unknown key; did you mean 'budgets'?",
        "routing.polcy": "unknown key; did you mean 'policy'?",
        "tenants.acme.api_key": "unknown key; did you mean 'api_keys'?",
        "tenants.acme.token_quota.per_minut": "unknown key; did you mean 'per_minute'?",
        "tenants.acme.budgets.total": "unknown key; did you mean 'total_ms'?",
        "tenants.acme.zzz": "unknown key",
    }


def test_a_tenant_without_a_class_under_replaced_priorities_is_told_why() -> None:
    """``priorities`` written with other classes replaces the three defaults; a tenant that
    names no class was told "'standard': unknown priority class", a word it never wrote."""
    text = REPLICA + (
        "priorities: {gold: {weight: 2}, silver: {weight: 1}}\n"
        "tenants:\n  a: {api_keys: [k1]}\n  b: {api_keys: [k2], priority: bronze}\n"
    )
    assert _issues(text) == {
        "tenants.a.priority": "'standard' (the default, as the tenant names none): unknown "
        "priority class (configured: gold, silver)",
        "tenants.b.priority": "'bronze': unknown priority class (configured: gold, silver)",
    }


# --- values of the wrong kind ----------------------------------------------


def test_a_duration_with_a_unit_asks_for_milliseconds() -> None:
    """``queue_ms: 5s``, ``1.5``: every ``*_ms`` key says it wants whole milliseconds."""
    issues = _issues(
        REPLICA + TENANT + "budgets: {queue_ms: 5s, first_byte_ms: 1.5}\n"
        "health: {interval_ms: 2 s}\n"
    )
    wanted = "input should be a whole number of milliseconds (5 s is 5000)"
    assert issues == {
        "budgets.queue_ms": f"{wanted} (got '5s')",
        "budgets.first_byte_ms": f"{wanted} (got 1.5)",
        "health.interval_ms": f"{wanted} (got '2 s')",
    }


@pytest.mark.parametrize(
    ("text", "path"),
    [
        (REPLICA.replace("max_concurrency: 4", "max_concurrency: yes") + TENANT,
         "replicas[0].max_concurrency"),
        (REPLICA + "tenants:\n  acme: {api_keys: [k], weight: on}\n", "tenants.acme.weight"),
        (REPLICA + TENANT + "budgets: {queue_ms: off}\n", "budgets.queue_ms"),
        (REPLICA + TENANT + "config_history: true\n", "config_history"),
        (REPLICA + TENANT + "anonymous: no\n", "anonymous"),
    ],
)  # fmt: skip
def test_a_boolean_is_never_read_as_a_number(text: str, path: str) -> None:
    """``max_concurrency: yes`` ran with one seat (pydantic reads true as 1); no key
    takes a boolean, so each is refused at its path, saying why a word became one."""
    message = _issues(text)[path]
    assert message.startswith("no key here takes true or false (YAML reads unquoted yes, no")


def test_the_same_engine_listed_twice_is_a_warning() -> None:
    """A replica block copied with its name changed but not its URL gives one engine the
    seats of both, silently. It stays valid (two entries may split one engine's knee
    between two model pools), but check-config says so. Scheme and host case, a trailing
    slash and a default port written out are the same URL; another port or path prefix
    is another engine."""
    text = (
        "replicas:\n"
        "  - {name: a, url: 'http://gpu-host:80', max_concurrency: 4}\n"
        "  - {name: b, url: 'HTTP://GPU-host/', max_concurrency: 4}\n"
        "  - {name: c, url: 'http://gpu-host:8001', max_concurrency: 4}\n"
        "  - {name: d, url: 'http://gpu-host/engine-2', max_concurrency: 4}\n"
        "  - {name: e, url: 'https://gpu-host', max_concurrency: 4}\n"
        "  - {name: f, url: 'https://gpu-host:443', max_concurrency: 4}\n" + TENANT
    )
    twice = (
        "it gets the seats of both entries (a block copied without changing its port?); "
        "fine only when their max_concurrency add up to the engine's knee"
    )
    assert [str(w) for w in config_warnings(parse_config(text))] == [
        f"replicas[1].url: the same engine as replicas[0]: {twice}",
        f"replicas[5].url: the same engine as replicas[4]: {twice}",
    ]


# --- secrets ---------------------------------------------------------------

SECRET_URLS = (
    "replicas:\n"
    "  - {name: gpu-0, url: 'http://proxy:upw1@127.0.0.1:9001/v1x',\n"
    "     metrics_url: 'http://scraper:mpw2@127.0.0.1:9001/metrics', max_concurrency: 4}\n"
    "state: {redis_url: 'redis://:rpw3@127.0.0.1:6379/0'}\n" + TENANT
)


def test_check_config_masks_the_password_of_every_url(tmp_path: Path) -> None:
    """A Redis password in ``state.redis_url`` (or basic-auth credentials in a replica URL)
    was printed by check-config, meant for tickets and CI logs: each password is ``***``,
    the user and the rest of the URL kept."""
    code, out, _ = _check(tmp_path, SECRET_URLS)
    assert code == EXIT_OK
    for secret in ("upw1", "mpw2", "rpw3", "sk-acme-1"):
        assert secret not in out
    shown = yaml.safe_load(out)
    assert shown["replicas"][0]["url"] == "http://proxy:***@127.0.0.1:9001/v1x"
    assert shown["replicas"][0]["metrics_url"] == "http://scraper:***@127.0.0.1:9001/metrics"
    assert shown["state"]["redis_url"] == "redis://:***@127.0.0.1:6379/0"
    unmasked = dump_effective_config(parse_config(SECRET_URLS))
    assert "rpw3" in unmasked  # the unmasked dump (round trips) keeps them


def test_an_invalid_url_is_quoted_without_its_password() -> None:
    text = REPLICA + TENANT + "state: {redis_url: 'http://:rpw3@redis:6379'}\n"
    message = _issues(text)["state.redis_url"]
    assert "rpw3" not in message and "'http://:***@redis:6379'" in message


def test_a_redis_url_change_is_logged_without_its_password() -> None:
    """``state.redis_url`` needs a restart: the reload's log line names both values."""
    old = parse_config(REPLICA + TENANT)
    new = parse_config(SECRET_URLS.replace("/v1x", "").replace("mpw2", "m"))
    changed = {key: (a, b) for key, a, b in needs_restart(old, new)}
    assert changed["state.redis_url"] == (
        "redis://127.0.0.1:6379/0", "redis://:***@127.0.0.1:6379/0",
    )  # fmt: skip


async def test_admin_config_masks_the_redis_password(
    start_proxy: Start, upstream_url: str, tmp_path: Path
) -> None:
    """``GET /admin/config`` (dashboards, the loadtest's config hash) showed the Redis
    password of a ``state.redis_url`` in full."""
    text = (
        f"replicas:\n  - {{name: r0, url: '{upstream_url}', max_concurrency: 2}}\n"
        "state: {redis_url: 'rediss://admission:rpw3@redis.internal:6380/2'}\n" + TENANT
    )
    path = tmp_path / "proxy.yaml"
    path.write_text(text)
    proxy = await start_proxy(parse_config(text), config_path=str(path))
    answer = await proxy.client.get("/admin/config")
    body = await answer.text()
    assert answer.status == 200 and "rpw3" not in body
    assert yaml.safe_load(body)["state"]["redis_url"] == (
        "rediss://admission:***@redis.internal:6380/2"
    )


# --- settings that do nothing ----------------------------------------------


def test_check_config_warns_of_settings_that_do_nothing(tmp_path: Path) -> None:
    """Valid, so exit 0 and the effective config; but each knob that has no effect where
    it stands, or points at nothing, is a ``warning:`` line at its path."""
    text = (
        "replicas:\n"
        "  - {name: gpu-0, url: 'http://127.0.0.1:9001', max_concurrency: 4,\n"
        "     api_key_env: OPERATOR_TEST_UNSET_KEY}\n"
        "routing: {affinity_header: X-User, max_load_factor: 2}\n"
        "saturation: {max_waiting: 3}\n"
        "gpu: {memory_guard: 0.9}\n"
        "overload: {at: 0.5}\n"
        "state: {lease_ms: 5000}\n"
        "tenants:\n"
        "  acme: {api_keys: [k], weight: 3, priority: interactive,"
        " allowed_priorities: [batch]}\n"
    )
    code, out, err = _check(tmp_path, text)
    assert code == EXIT_OK and yaml.safe_load(out)["routing"]["max_load_factor"] == 2
    assert err.splitlines() == [
        "warning: routing.affinity_header: has no effect with routing.policy least_loaded "
        "(only prefix_affinity reads it)",
        "warning: routing.max_load_factor: has no effect with routing.policy least_loaded "
        "(only prefix_affinity reads it)",
        "warning: tenants.acme.weight: has no effect with a single tenant (a weight shares "
        "seats among the tenants of one class)",
        "warning: tenants.acme.allowed_priorities: does not list the tenant's priority "
        "'interactive', which is allowed all the same",
        "warning: replicas[0].api_key_env: environment variable OPERATOR_TEST_UNSET_KEY is "
        "unset or empty here: no key would be sent to this replica",
        "warning: saturation.max_waiting: has no effect: no replica has a metrics_url to "
        "read the engine's saturation from",
        "warning: gpu.memory_guard: has no effect: no replica has a gpu_index",
        "warning: overload.at: has no effect while overload.max_tokens_cap is null (never degrade)",
        "warning: state.lease_ms: has no effect with state.backend local",
    ]


def test_the_same_knobs_where_they_act_warn_of_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each knob above, where it does act, and the shipped configs: no warning."""
    monkeypatch.setenv("OPERATOR_TEST_KEY", "k")
    text = (
        "replicas:\n"
        "  - {name: gpu-0, url: 'http://127.0.0.1:9001', max_concurrency: 4, gpu_index: 0,\n"
        "     api_key_env: OPERATOR_TEST_KEY, metrics_url: 'http://127.0.0.1:9001/metrics'}\n"
        "routing: {policy: prefix_affinity, affinity_header: X-User, max_load_factor: 2}\n"
        "saturation: {max_waiting: 3}\n"
        "gpu: {memory_guard: 0.9}\n"
        "overload: {max_tokens_cap: 64, at: 0.5}\n"
        "state: {backend: redis, lease_ms: 5000}\n"
        "tenants:\n"
        "  acme: {api_keys: [k], weight: 3, priority: interactive,"
        " allowed_priorities: [interactive, batch]}\n"
        "  globex: {api_keys: [g]}\n"
    )
    assert config_warnings(parse_config(text)) == []
    empty = config_warnings(parse_config(text), environ={"OPERATOR_TEST_KEY": ""})
    assert [w.path for w in empty] == ["replicas[0].api_key_env"]  # sends no key either
    for shipped in ("example.yaml", "demo.yaml"):
        code, _, err = _check_path(REPO / "config" / shipped)
        assert (code, err) == (EXIT_OK, "")


def _check_path(path: Path) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    return check_config(str(path), out, err), out.getvalue(), err.getvalue()


def test_check_config_exit_codes(tmp_path: Path) -> None:
    """0 for a valid file (warnings or not), 2 for an invalid one, a missing one, a directory
    and an empty one, each with its reason in words and no traceback."""
    assert _check(tmp_path, REPLICA + TENANT)[0] == EXIT_OK
    code, _, err = _check(tmp_path, "")
    assert code == EXIT_INVALID and "replicas: required key is missing" in err
    code, _, err = _check_path(tmp_path)
    assert code == EXIT_INVALID and "<file>: cannot read" in err and "Is a directory" in err
    assert "Traceback" not in err


def _huge(path: Path) -> Path:
    """A valid config followed by comments past ``MAX_CONFIG_BYTES`` (a log file's size)."""
    line = "# " + "x" * 1021 + "\n"
    with path.open("w") as file:
        file.write(REPLICA + TENANT)
        file.write(line * (MAX_CONFIG_BYTES // len(line) + 1))
    return path


def test_a_huge_file_is_refused_for_its_size_unparsed(tmp_path: Path) -> None:
    """A file past 8 MiB (the wrong file named, a log) was read whole and parsed: tens of
    seconds of PyYAML for each reload beside the traffic, and all of memory for a big
    enough one. It is refused at once, in words; a reload keeps the running config."""
    code, out, err = _check_path(_huge(tmp_path / "proxy.yaml"))
    assert (code, out) == (EXIT_INVALID, "")
    assert err.splitlines()[1] == (
        f"<file>: {tmp_path / 'proxy.yaml'} is larger than 8 MiB: a config is a few KiB "
        "(is it the right file?)"
    )


async def test_a_reload_of_a_huge_file_or_a_directory_keeps_the_running_config(
    start_proxy: Start, upstream_url: str, tmp_path: Path
) -> None:
    """The file swapped for a huge one, then for a directory (a ConfigMap mounted at the
    wrong level): each ``POST /admin/reload`` is 422 naming ``<file>`` and why, counted as
    invalid, and the running config is the one that ran before."""
    path = tmp_path / "proxy.yaml"
    text = f"replicas:\n  - {{name: r0, url: '{upstream_url}', max_concurrency: 2}}\n" + TENANT
    path.write_text(text)
    proxy = await start_proxy(parse_config(text), config_path=str(path))
    before = proxy.runtime.rules
    _huge(path)
    answer = await proxy.client.post("/admin/reload")
    body = await answer.json()
    assert answer.status == 422 and body["result"] == "invalid"
    assert [e["path"] for e in body["errors"]] == ["<file>"]
    assert "larger than 8 MiB" in body["errors"][0]["message"]
    path.unlink()
    path.mkdir()
    answer = await proxy.client.post("/admin/reload")
    body = await answer.json()
    assert answer.status == 422 and "Is a directory" in body["errors"][0]["message"]
    assert proxy.runtime.rules is before
    metrics = await (await proxy.client.get("/metrics")).text()
    assert samples_by_label(metrics, "admission_config_reloads_total", "result")["invalid"] == 2


def test_an_override_that_sets_nothing_is_a_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    """``ADMISSION_BUDGET__QUEUE_MS`` (the section misspelt) and ``ADMISSION_STATE_BACKEND``
    (one ``_`` for ``__``) were ignored without a word: the file's value ran. Each is a
    warning naming what was meant; real overrides, the admin token's variable and other
    ``ADMISSION_*`` names (the workers' own) say nothing."""
    for name, value in {
        "ADMISSION_BUDGET__QUEUE_MS": "500", "ADMISSION_STATE_BACKEND": "redis",
        "ADMISSION_XYZ__A": "1", "ADMISSION_SERVER__PORT": "9000",
        "ADMISSION_ADMIN_TOKEN": "t", "ADMISSION_PROXY_WORKER_GROUP": "g",
    }.items():  # fmt: skip
        monkeypatch.setenv(name, value)
    warnings = config_warnings(parse_config(REPLICA + TENANT))
    assert [str(w) for w in warnings] == [
        "<env>: ADMISSION_BUDGET__QUEUE_MS sets nothing: there is no top-level key 'budget'; "
        "did you mean 'budgets'?",
        "<env>: ADMISSION_STATE_BACKEND sets nothing: a key of state is set with two "
        "underscores (ADMISSION_STATE__BACKEND)",
        "<env>: ADMISSION_XYZ__A sets nothing: there is no top-level key 'xyz'",
    ]


# --- reloads ---------------------------------------------------------------


async def test_a_replica_whose_url_changes_is_probed_and_warmed_as_a_new_one(
    start_proxy: Start, upstream_url: str, aiohttp_server: ServerFactory, tmp_path: Path
) -> None:
    """Day ninety: gpu r1 moved to a new host, its ``url`` edited, its name kept. The
    replica was reconfigured in place and kept serving, so traffic went at once to an
    engine that may still be loading. Now the new URL is a new replica (starting until
    probed and warmed: the probe interval here is longer than the test), while the
    request running on the old engine finishes there."""
    second = await aiohttp_server(build_upstream())
    second_url = str(second.make_url("")).rstrip("/")
    moved_to = f"http://127.0.0.1:{_closed_port()}"
    path = tmp_path / "proxy.yaml"

    def document(r1_url: str) -> str:
        return (
            f"replicas:\n  - {{name: r0, url: '{upstream_url}', max_concurrency: 1}}\n"
            f"  - {{name: r1, url: '{r1_url}', max_concurrency: 1}}\n"
            "health: {interval_ms: 600000}\n" + TENANT
        )

    path.write_text(document(second_url))
    proxy = await start_proxy(parse_config(path.read_text()), config_path=str(path))
    await wait_for(lambda: all(r.serving for r in proxy.runtime.pool.replicas))
    auth = {"Authorization": "Bearer sk-acme-1"}
    running = [
        asyncio.ensure_future(proxy.client.post(CHAT, json={"hang_ms": 300}, headers=auth))
        for _ in range(2)
    ]
    await wait_for(lambda: proxy.runtime.pool.total_inflight() == 2)  # one on each
    old = proxy.runtime.pool.get("r1")
    path.write_text(document(moved_to))
    answer = await proxy.client.post("/admin/reload")
    assert (await answer.json())["result"] == "ok"
    new = proxy.runtime.pool.get("r1")
    assert new is not None and new is not old and new.url == moved_to
    assert new.starting and not new.serving
    state = await (await proxy.client.get("/admin/state")).json()
    assert state["replicas"]["r1"]["state"] == "starting"
    assert [r.status for r in await asyncio.gather(*running)] == [200, 200]
    served = await proxy.client.post(CHAT, json={}, headers=auth)
    assert served.status == 200  # on r0: nothing is sent to the engine not yet up
    await wait_for(lambda: not proxy.runtime.active)
    proxy.assert_idle()


async def test_a_url_change_rolled_back_while_the_old_engine_runs_puts_it_back(
    start_proxy: Start, upstream_url: str, aiohttp_server: ServerFactory, tmp_path: Path
) -> None:
    """r1's URL edited, then ``POST /admin/rollback`` while r1's old engine still runs a
    request: r1 is the old replica again, serving at once and counting the request it
    runs against its one seat (not a second replica for one engine, counting 0)."""
    second = await aiohttp_server(build_upstream())
    second_url = str(second.make_url("")).rstrip("/")
    path = tmp_path / "proxy.yaml"

    def document(r1_url: str) -> str:
        return (
            f"replicas:\n  - {{name: r0, url: '{upstream_url}', max_concurrency: 1}}\n"
            f"  - {{name: r1, url: '{r1_url}', max_concurrency: 1}}\n"
            "health: {interval_ms: 600000}\ntimeouts: {cancel_grace_ms: 0}\n" + TENANT
        )

    path.write_text(document(second_url))
    proxy = await start_proxy(parse_config(path.read_text()), config_path=str(path))
    await wait_for(lambda: all(r.serving for r in proxy.runtime.pool.replicas))
    auth = {"Authorization": "Bearer sk-acme-1"}
    running = [  # held for the test's length, then let go by the client
        asyncio.ensure_future(proxy.client.post(CHAT, json={"hang_ms": 60000}, headers=auth))
        for _ in range(2)
    ]
    await wait_for(lambda: proxy.runtime.pool.total_inflight() == 2)
    old = proxy.runtime.pool.get("r1")
    assert old is not None
    path.write_text(document(f"http://127.0.0.1:{_closed_port()}"))
    assert (await (await proxy.client.post("/admin/reload")).json())["result"] == "ok"
    assert proxy.runtime.pool.get("r1") is not old
    answer = await proxy.client.post("/admin/rollback")
    assert answer.status == 200
    back = proxy.runtime.pool.get("r1")
    assert back is old and back.serving and not back.retired
    assert (back.url, back.inflight, back.has_free_seat) == (second_url, 1, False)
    for request in running:
        request.cancel()
    await asyncio.gather(*running, return_exceptions=True)
    await wait_for(lambda: not proxy.runtime.active and proxy.runtime.pool.total_inflight() == 0)
    assert (await proxy.client.post(CHAT, json={}, headers=auth)).status == 200
    proxy.assert_idle()


@pytest.mark.redis
async def test_serve_prints_each_warning_once_for_its_workers(
    tmp_path: Path, upstream_url: str, redis_server: RedisServer
) -> None:
    """``serve`` prints the same ``warning:`` lines as check-config, on stderr before it
    listens; with ``--workers 2`` once (the parent's), not once more per worker."""
    text = (
        f"replicas:\n  - {{name: r0, url: '{upstream_url}', max_concurrency: 2}}\n"
        f"state: {{backend: redis, redis_url: '{redis_server.url}'}}\n"
        "routing: {affinity_header: X-User}\n" + TENANT
    )
    path = tmp_path / "proxy.yaml"
    path.write_text(text)
    args = [*CLI_ARGS, "serve", "--config", str(path), "--host", "127.0.0.1", "--port", "0"]
    with (tmp_path / "stderr").open("wb") as stderr:
        proc = await asyncio.create_subprocess_exec(
            *args, "--workers", "2", stdout=asyncio.subprocess.PIPE, stderr=stderr
        )
    process = ProxyProcess(proc, 2)
    try:
        await process.wait_listening()
    finally:
        assert await process.stop() == 0
    lines = (tmp_path / "stderr").read_text().splitlines()
    assert [line for line in lines if line.startswith("warning:")] == [
        "warning: routing.affinity_header: has no effect with routing.policy least_loaded "
        "(only prefix_affinity reads it)"
    ]
