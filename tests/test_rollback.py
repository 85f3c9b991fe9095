"""Config history and ``POST /admin/rollback``: the last good configs, and going back one."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Awaitable, Callable
from itertools import count
from pathlib import Path
from typing import Any

import pytest
import yaml

from proxy.config_history import ConfigHistory
from proxy.reload import RELOADER
from proxy.settings import load_config
from tests.conftest import ProxyUnderTest
from tests.helpers import KEY_A, SteadyLoad, make_config, samples_by_label, wait_for

Start = Callable[..., Awaitable[ProxyUnderTest]]
CHAT = "/v1/chat/completions"
AUTH = {"Authorization": f"Bearer {KEY_A}"}
HISTORY_LINE = re.compile(r"^#   sha256:([0-9a-f]{64}) applied (\S+)( \(running\))?$", re.M)


def test_history_keeps_the_last_good_configs_and_steps_back_one() -> None:
    """Up to config_history entries, oldest dropped; each rollback hands back the one before
    the running one and drops the running one; with one entry there is nothing to go to."""
    ticks = count()
    history = ConfigHistory(3, now=lambda: f"t{next(ticks)}")
    config = make_config(["http://127.0.0.1:1"], config_history=3)
    for digest in ("a", "b", "c", "d"):
        history.applied(config, digest)
    assert [e["sha256"] for e in history.describe()] == ["d", "c", "b"]
    assert history.previous is not None and history.previous.sha256 == "c"
    running, dropped = history.rolled_back()
    assert (running.sha256, running.applied_at, dropped.sha256) == ("c", "t2", "d")
    assert history.rolled_back()[0].sha256 == "b"
    assert history.previous is None and len(history) == 1
    with pytest.raises(IndexError):
        history.rolled_back()
    assert "1/3, running b" in repr(history)


def test_the_same_file_applied_again_keeps_the_config_to_go_back_to() -> None:
    """config_history 3: a, then b, then b reloaded twice more (SIGHUP, POST
    /admin/reload of an unchanged file): b is one entry, applied at its last reload,
    and a rollback still goes back to a (three copies of b had pushed a out)."""
    ticks = count()
    history = ConfigHistory(3, now=lambda: f"t{next(ticks)}")
    config = make_config(["http://127.0.0.1:1"], config_history=3)
    for digest in ("a", "b", "b", "b"):
        history.applied(config, digest)
    assert history.describe() == [
        {"sha256": "b", "applied_at": "t3"}, {"sha256": "a", "applied_at": "t0"},
    ]  # fmt: skip
    assert history.previous is not None and history.previous.sha256 == "a"


def _document(upstream_url: str, seats: int) -> dict[str, Any]:
    return {
        "replicas": [{"name": "r0", "url": upstream_url, "max_concurrency": seats}],
        "tenants": {"a": {"api_keys": [KEY_A]}},
        "config_history": 3,
    }


def _write(path: Path, document: dict[str, Any]) -> str:
    text = yaml.safe_dump(document)
    path.write_text(text)
    return hashlib.sha256(text.encode()).hexdigest()


async def test_a_bad_but_valid_config_is_rolled_back_under_load_losing_nothing(
    start_proxy: Start, upstream_url: str, tmp_path: Path
) -> None:
    """Eight clients in a loop; a reload to one seat (valid, but a quarter of the fleet),
    then POST /admin/rollback: the first config runs again and the answer names it by hash
    and time; every request of the whole run is answered 200; /admin/config lists the
    history; the rollback is counted."""
    path = tmp_path / "proxy.yaml"
    good = _write(path, _document(upstream_url, seats=4))
    proxy = await start_proxy(load_config(path), config_path=str(path))

    async def chat() -> int:
        resp = await proxy.client.post(CHAT, json={"hang_ms": 5}, headers=AUTH)
        await resp.read()
        return resp.status

    async with SteadyLoad(chat, clients=8) as load:
        await wait_for(lambda: len(load.statuses) > 20)
        bad = _write(path, _document(upstream_url, seats=1))
        assert (await (await proxy.client.post("/admin/reload")).json())["result"] == "ok"
        r0 = proxy.runtime.pool.get("r0")
        assert r0 is not None and r0.limit == 1
        await wait_for(lambda: len(load.statuses) > 60)

        answer = await proxy.client.post("/admin/rollback")
        assert answer.status == 200
        body = await answer.json()
        assert body["result"] == "ok"
        assert body["running"]["sha256"] == good and body["replaced"]["sha256"] == bad
        assert [e["sha256"] for e in body["history"]] == [good]
        assert r0.limit == 4 and proxy.runtime.rules.config.replicas[0].max_concurrency == 4
        seen = len(load.statuses)
        await wait_for(lambda: len(load.statuses) > seen + 40)
        await load.stop()
    statuses = load.statuses
    assert set(statuses) == {200}

    text = await (await proxy.client.get("/admin/config")).text()
    listed = HISTORY_LINE.findall(text)
    assert [(digest, running) for digest, _, running in listed] == [(good, " (running)")]
    assert listed[0][1] == body["running"]["applied_at"]
    assert yaml.safe_load(text)["replicas"][0]["max_concurrency"] == 4  # still loads as YAML
    metrics = await (await proxy.client.get("/metrics")).text()
    rolled = samples_by_label(metrics, "admission_config_reloads_total", "result")
    assert rolled.get("rolled_back") == 1.0
    proxy.assert_idle()


async def test_rollback_with_nothing_to_go_back_to_is_409(
    start_proxy: Start, upstream_url: str, tmp_path: Path
) -> None:
    """The start-up config alone, or no config file at all: 409 no_previous_config with
    the error body; the running config stays. GET on the path is 405."""
    path = tmp_path / "proxy.yaml"
    _write(path, _document(upstream_url, seats=4))
    proxy = await start_proxy(load_config(path), config_path=str(path))
    before = proxy.runtime.rules
    answer = await proxy.client.post("/admin/rollback")
    assert answer.status == 409
    assert answer.headers["X-Admission-Reason"] == "no_previous_config"
    assert (await answer.json())["error"]["code"] == "no_previous_config"
    assert proxy.runtime.rules is before
    assert (await proxy.client.get("/admin/rollback")).status == 405
    text = await (await proxy.client.get("/admin/config")).text()
    assert len(HISTORY_LINE.findall(text)) == 1

    fileless = await start_proxy(make_config([upstream_url]))
    answer = await fileless.client.post("/admin/rollback")
    assert answer.status == 409 and answer.headers["X-Request-Id"]
    assert (await answer.json())["error"]["code"] == "no_previous_config"


async def test_rollback_steps_back_one_config_at_a_time(
    start_proxy: Start, upstream_url: str, tmp_path: Path
) -> None:
    """Three configs (4, 2, 1 seats): two rollbacks reach the first, a third is 409; an
    invalid file in between never enters the history."""
    path = tmp_path / "proxy.yaml"
    first = _write(path, _document(upstream_url, seats=4))
    proxy = await start_proxy(load_config(path), config_path=str(path))
    second = _write(path, _document(upstream_url, seats=2))
    assert (await proxy.client.post("/admin/reload")).status == 200
    path.write_text("replicas: []\n")
    assert (await proxy.client.post("/admin/reload")).status == 422
    _write(path, _document(upstream_url, seats=1))
    assert (await proxy.client.post("/admin/reload")).status == 200
    r0 = proxy.runtime.pool.get("r0")
    assert r0 is not None
    assert (await (await proxy.client.post("/admin/rollback")).json())["running"]["sha256"] == (
        second
    )
    assert r0.limit == 2
    assert (await (await proxy.client.post("/admin/rollback")).json())["running"]["sha256"] == (
        first
    )
    assert r0.limit == 4
    assert (await proxy.client.post("/admin/rollback")).status == 409


async def test_a_reload_passed_on_by_another_worker_reads_only_a_changed_file(
    start_proxy: Start, upstream_url: str, tmp_path: Path
) -> None:
    """``serve --workers N`` passes an admin reload on to the other workers, whose file
    watchers may have read the same change already: ``reload(if_changed=True)`` then
    leaves the history alone (a second entry of the same config would make the next
    rollback a no-op there, and the workers' histories differ); a file that did change
    since is read as by any reload."""
    path = tmp_path / "proxy.yaml"
    _write(path, _document(upstream_url, seats=4))
    proxy = await start_proxy(load_config(path), config_path=str(path))
    reloader = proxy.client.app[RELOADER]
    assert reloader is not None
    two = _write(path, _document(upstream_url, seats=2))
    assert (await reloader.reload("file_change")).ok
    assert reloader.history.describe()[0]["sha256"] == two
    entries = len(reloader.history.describe())
    result = await reloader.reload("admin (another worker)", if_changed=True)
    assert result.ok and not result.changed
    assert len(reloader.history.describe()) == entries
    three = _write(path, _document(upstream_url, seats=3))
    result = await reloader.reload("admin (another worker)", if_changed=True)
    assert result.ok and result.changed
    assert reloader.history.describe()[0]["sha256"] == three
    r0 = proxy.runtime.pool.get("r0")
    assert r0 is not None and r0.limit == 3
