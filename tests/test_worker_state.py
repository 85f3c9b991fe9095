"""``serve --workers N``: whichever worker it reaches, ``/admin/state`` is the group's.

Before, each worker answered with its own share: a tenant's queue showed the
requests queued on the worker the kernel picked, and the next poll another's.
Each worker now serves its view on its group socket, and the worker asked
merges its siblings' into its own field by field (``proxy/worker_state.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from aiohttp import web
from prometheus_client import CollectorRegistry

from proxy import worker_state
from proxy.admin import admin_state
from proxy.app import build_app
from proxy.runtime import RUNTIME, Runtime
from proxy.settings import parse_config
from proxy.worker_metrics import WorkerMetrics, socket_dir
from proxy.worker_state import (
    POOL_RULES,
    REPLICA_RULES,
    STATE_RULES,
    TENANT_RULES,
    WorkerState,
    merge,
    own_part,
)
from tests.fleet import ProxyProcess, start_serve, write_config
from tests.helpers import KEY_A, KEY_B
from tests.redis_server import RedisServer
from tests.upstreams import Upstream

CHAT = "/v1/chat/completions"
#: Bound on every wait below (two worker processes on a busy 2-core machine).
WAIT_S = 20.0
#: Requests sent at most until both workers queue one (all on one: 2^-29).
MAX_SENT = 30
#: Reads of /admin/state at most until both workers have answered one (2^-39).
READS = 40
#: The Redis call bound of the two-worker test: no call on a loaded machine counts as
#: Redis down (which would admit a request on a worker's local share).
STATE_TIMEOUT_MS = 5000


def _runtime() -> Runtime:
    """A real app's runtime: two replicas in model pools, a tenant with a token quota."""
    doc = {
        "replicas": [
            {"name": "r0", "url": "http://127.0.0.1:9", "max_concurrency": 4, "models": ["m"]},
            {"name": "r1", "url": "http://127.0.0.1:9", "max_concurrency": 4, "models": ["m"]},
        ],
        "model_aliases": {"fast": "m"},
        "tenants": {
            "a": {"api_keys": [KEY_A], "token_quota": {"per_minute": 1000, "per_day": 9000}},
            "b": {"api_keys": [KEY_B], "max_concurrency": 2},
        },
    }
    return build_app(parse_config(yaml.safe_dump(doc)), seed=1)[RUNTIME]


def _tenant(queued: int, inflight: int, day_left: int | None = None) -> dict[str, Any]:
    quota = None
    if day_left is not None:
        day = {"limit": 9000, "used": 9000 - day_left, "remaining": day_left}
        minute = {"limit": 1000, "used": 0, "remaining": 1000}
        quota = dict(used=day["used"], limit=9000, unit="tokens today", minute=minute, day=day)
    return dict(queued=queued, inflight=inflight, weight=1.0, max_concurrency=2,
                queue_capacity=100, priority="standard", rate_per_s=None, quota=quota)  # fmt: skip


def _replica(inflight: int, state: str, failures: int, engine: Any) -> dict[str, Any]:
    return dict(inflight=inflight, limit=4, headroom=0, ejected=state == "ejected",
                draining=False, warming=False, starting=False, state=state, saturated=False,
                gpu_guarded=False, consecutive_failures=failures,
                probe_error="refused" if failures else None, engine=engine, gpu=None,
                models=["m"], pool=None)  # fmt: skip


def _part(queued: int, inflight: int, requests: int, **more: Any) -> dict[str, Any]:
    """One worker's part of ``/admin/state``, as its group socket serves it."""
    state, failures = more.get("state", "serving"), more.get("failures", 0)
    budget = dict(allowance=0.2 * requests + 50, summary="", requests=requests, retries=1,
                  ratio=0.2, floor=50.0)  # fmt: skip
    return {
        "tenants": {"a": _tenant(queued, inflight, more.get("day_left"))},
        "replicas": {"r0": _replica(inflight, state, failures, more.get("engine"))},
        "pools": {},
        "retry_budget": budget,
        "headroom_grants": 1,
        "shutting_down": more.get("shutting_down", False),
    }


def test_each_field_adds_up_by_what_it_means_across_workers() -> None:
    """Queues and seats held by each worker are summed; what the group shares (a
    replica's limit, a tenant's cap, engine readings) is one figure; health shows the
    worst worker's; the quota the reading with least left; the retry floor once."""
    engine = {"waiting": 2, "running": 1, "kv_cache": 0.5}
    own = _part(3, 1, requests=10, day_left=5000)
    sibling = _part(4, 2, requests=30, day_left=4000, state="ejected", failures=3,
                    engine=engine, shutting_down=True)  # fmt: skip
    sibling["tenants"]["c"] = _tenant(1, 0)  # a reload not yet reached this worker
    merged = merge([own, sibling])
    a = merged["tenants"]["a"]
    assert (a["queued"], a["inflight"], a["max_concurrency"], a["queue_capacity"]) == (7, 3, 2, 200)
    assert (a["quota"]["used"], a["quota"]["day"]["remaining"]) == (5000, 4000)
    assert merged["tenants"]["c"] == _tenant(1, 0)
    r0 = merged["replicas"]["r0"]
    assert (r0["inflight"], r0["limit"], r0["state"], r0["ejected"]) == (3, 4, "ejected", True)
    assert (r0["consecutive_failures"], r0["probe_error"], r0["engine"]) == (3, "refused", engine)
    assert merged["retry_budget"] == {
        "allowance": 0.2 * 40 + 50.0,  # not 0.2 * 40 + 2 * 50
        "summary": "<RetryBudget 2 retries / 40 requests in 10 s>",
    }
    assert (merged["headroom_grants"], merged["shutting_down"]) == (2, True)


def test_one_worker_alone_merges_to_the_view_of_a_single_process() -> None:
    """A group whose siblings did not answer still answers exactly one process's view
    (plus ``workers``): nothing of the merge's own bookkeeping shows."""
    runtime = _runtime()
    runtime.retry_budget.record_request()
    assert merge([own_part(runtime, admin_state)]) == admin_state(runtime)


def test_every_field_of_the_state_view_has_a_rule_for_adding_workers_up() -> None:
    """A field added to ``/admin/state`` later must say how workers add up: taken from
    the answering worker alone, it would show that worker's share again."""
    view: Any = admin_state(_runtime())
    assert view["tenants"] and view["replicas"] and view["pools"], view  # every level seen
    assert set(view) <= set(STATE_RULES), set(view) - set(STATE_RULES)
    levels = [("tenants", TENANT_RULES), ("replicas", REPLICA_RULES), ("pools", POOL_RULES)]
    for level, rules in levels:
        for name, entry in view[level].items():
            assert set(entry) <= set(rules), (level, name, set(entry) - set(rules))
    assert view["tenants"]["a"]["quota"] is not None  # least_left met a real quota view
    budget = merge([own_part(_runtime(), admin_state)])["retry_budget"]
    assert set(budget) == set(view["retry_budget"])


@contextlib.contextmanager
def _dead_socket(path: Path) -> Iterator[None]:
    """A socket file nothing listens on: a worker killed."""
    with socket.socket(socket.AF_UNIX) as killed:
        killed.bind(str(path))
    try:
        yield
    finally:
        path.unlink(missing_ok=True)


async def test_a_stalled_sibling_is_named_and_a_dead_one_left_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Three siblings: one answers (its queue counts), one stalls (left out, named in
    ``workers``, and the answer still comes), one was killed (left out, socket removed)."""
    monkeypatch.setattr(worker_state, "SIBLING_TIMEOUT_S", 0.2)
    runtime = _runtime()
    sockets = WorkerMetrics(f"test-{os.getpid()}-{secrets.token_hex(4)}", CollectorRegistry())
    group = WorkerState(sockets, runtime, admin_state)
    release = asyncio.Event()
    sibling_part = own_part(_runtime(), admin_state)
    sibling_part["tenants"]["b"]["queued"] = 5

    async def answers(request: web.Request) -> web.Response:
        return web.json_response(sibling_part)

    async def stalls(request: web.Request) -> web.Response:
        await release.wait()  # a worker whose loop is busy elsewhere
        return web.json_response(sibling_part)

    runners = []
    await sockets.start()
    try:
        for pid, handler in ((999997, answers), (999998, stalls)):
            runner = web.AppRunner(web.Application(), shutdown_timeout=0.1)
            runner.app.router.add_get("/state", handler)
            await runner.setup()
            runners.append(runner)
            await web.UnixSite(runner, str(sockets.directory / f"{pid}.sock")).start()
        dead = sockets.directory / "999999.sock"
        with _dead_socket(dead):
            state = await group.state()
            assert not dead.exists()
        assert state["workers"] == {"answered": 2, "unanswered": [999998], "served_by": os.getpid()}
        assert state["tenants"]["b"]["queued"] == 5
        assert (
            state["tenants"]["b"]["queue_capacity"]
            == 2
            * admin_state(runtime)["tenants"][
                "b"  # type: ignore[index]
            ]["queue_capacity"]
        )
    finally:
        release.set()
        for runner in runners:
            await runner.cleanup()
        for path in sockets.directory.glob("99999*.sock"):
            path.unlink()
        await sockets.close()
    assert not sockets.directory.exists()


def _socket_of(pid: int) -> Path:
    (path,) = socket_dir("*").parent.glob(f"{socket_dir('*').name}/{pid}.sock")
    return path


async def _own_views(pids: set[int]) -> dict[int, dict[str, Any]]:
    """Each worker's own part, read on its group socket (what it alone holds)."""
    views = {}
    for pid in pids:
        connector = aiohttp.UnixConnector(path=str(_socket_of(pid)))
        async with (
            aiohttp.ClientSession(connector=connector) as session,
            session.get("http://worker/state") as resp,
        ):
            views[pid] = await resp.json()
    return views


async def _until(proxy: ProxyProcess, pids: set[int], holds: Any) -> dict[int, dict[str, Any]]:
    """Each worker's own view, once ``holds(views)``; fails after ``WAIT_S`` (saying how
    the requests ended)."""
    deadline = time.monotonic() + WAIT_S
    while not holds(views := await _own_views(pids)):
        assert time.monotonic() < deadline, json.dumps([views, proxy.named("request")])
        await asyncio.sleep(0.05)
    return views


def _queued(views: dict[int, dict[str, Any]]) -> list[int]:
    return [view["tenants"]["a"]["queued"] for view in views.values()]


def _placed(views: dict[int, dict[str, Any]]) -> int:
    """Tenant a's requests queued or in flight, over every worker's own view."""
    return sum(view["tenants"]["a"]["queued"] + view["tenants"]["a"]["inflight"]
               for view in views.values())  # fmt: skip


async def _ask(proxy: ProxyProcess, hang_ms: int) -> None:
    """A request through a fresh connection (any worker), left hanging until cancelled."""
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "hang_ms": hang_ms}
    async with (
        aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session,
        session.post(proxy.url + CHAT, json=body, headers={"Authorization": f"Bearer {KEY_A}"}),
    ):
        pass


@pytest.mark.redis
async def test_requests_queued_on_two_workers_show_in_one_answer(
    tmp_path: Path, upstream_url: str, upstream_state: Upstream, redis_server: RedisServer
) -> None:
    """Two workers, one seat (in Redis): one request holds it, then requests on fresh
    connections until each worker queues some. Every /admin/state answer, whichever
    worker gives it, counts all of them (queued or in flight), and says both answered;
    the upstream ran one of them only (the seat is the group's)."""
    config = {
        "replicas": [{"name": "r0", "url": upstream_url, "max_concurrency": 1}],
        "tenants": {"a": {"api_keys": [KEY_A]}},
        "budgets": {"queue_ms": 50_000, "first_byte_ms": 55_000, "total_ms": 110_000},
        "server": {"shutdown_grace_ms": 1000},
        # Held off by a full seat in Redis, a queued request asks again when the
        # holder's lease would expire unrenewed: not during this test. A Redis call
        # slower than ``timeout_ms`` (50 ms by default: a worker's first seat call on a
        # loaded machine) counts as Redis down, and the worker admits on its local share
        # (one seat each): a second request would run, in flight there for good.
        "state": {
            "backend": "redis",
            "redis_url": redis_server.url,
            "lease_ms": 60_000,
            "timeout_ms": STATE_TIMEOUT_MS,
        },
    }
    proxy = await start_serve(write_config(tmp_path / "c.yaml", config), workers=2)
    pids = {int(line["pid"]) for line in proxy.listening()}
    requests = [asyncio.create_task(_ask(proxy, hang_ms=100_000))]
    try:
        assert len(pids) == 2
        # A request is queued or in flight; one granted a seat here and then refused
        # it in Redis is queued again (the seat's in-flight count can show it a moment).
        views = await _until(proxy, pids, lambda v: _placed(v) == 1)
        sent = 0
        while not all(_queued(views)):
            assert sent < MAX_SENT
            requests.append(asyncio.create_task(_ask(proxy, hang_ms=100_000)))
            sent += 1
            views = await _until(proxy, pids, lambda v, n=sent + 1: _placed(v) == n)
        served_by = set()
        async with aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(force_close=True)
        ) as session:
            for _ in range(READS):
                async with session.get(proxy.url + "/admin/state") as resp:
                    state = await resp.json()
                tenant = state["tenants"]["a"]
                assert tenant["queued"] + tenant["inflight"] == sent + 1
                assert tenant["queued"] >= len(pids)  # each worker queues one at least
                assert state["replicas"]["r0"]["limit"] == 1  # the group's seat, not one each
                workers = state["workers"]
                assert (workers["answered"], workers["unanswered"]) == (2, [])
                served_by.add(workers["served_by"])
                if served_by == pids:
                    break
        assert served_by == pids
        assert upstream_state.active == 1
    finally:
        for request in requests:
            request.cancel()
        await asyncio.gather(*requests, return_exceptions=True)
        assert await proxy.stop() == 0


async def test_a_single_process_answers_as_before(start_proxy: Any, upstream_url: str) -> None:
    """Outside a worker group, /admin/state is the process's own view: no ``workers``."""
    doc = {
        "replicas": [{"name": "r0", "url": upstream_url, "max_concurrency": 2}],
        "tenants": {"a": {"api_keys": [KEY_A]}},
    }
    proxy = await start_proxy(parse_config(yaml.safe_dump(doc)))
    async with proxy.client.get("/admin/state") as resp:
        state = json.loads(await resp.text())
    assert state == json.loads(json.dumps(admin_state(proxy.runtime)))
    assert "workers" not in state
