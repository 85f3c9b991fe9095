"""``serve --workers N``: whichever worker it reaches, ``/admin/history`` is the group's.

The status page's waits, requests not served by reason and goodput come from
``/admin/history``, which each worker samples on its own: the page showed the
share of the worker its poll reached. The worker asked now merges every
worker's points on one grid of slots, and their wait buckets before taking
quantiles (``proxy/worker_history.py``).
"""

from __future__ import annotations

import asyncio
import os
import secrets
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from aiohttp import web
from prometheus_client import CollectorRegistry

from proxy.app import build_app
from proxy.clock import FakeClock
from proxy.runtime import RUNTIME
from proxy.settings import parse_config
from proxy.telemetry.history import History, Totals, state_point
from proxy.telemetry.metrics import LATENCY_BUCKETS
from proxy.worker_history import (
    REPLICA_POINT_RULES,
    TENANT_POINT_RULES,
    WorkerHistory,
    merge_points,
)
from proxy.worker_metrics import WorkerMetrics, socket_dir
from tests.fleet import ProxyProcess, start_serve, write_config
from tests.helpers import KEY_A
from tests.redis_server import RedisServer

BOUNDS = (*LATENCY_BUCKETS, float("inf"))
CHAT = "/v1/chat/completions"
#: Bound on every wait below (two worker processes on a busy 2-core machine).
WAIT_S = 30.0
#: Requests sent at most until both workers refused some (all on one: 2^-29).
MAX_SENT = 30
#: Reads of /admin/history at most until both workers have answered one (2^-39).
READS = 40


def _point(t: float, queued: int, **ended: Any) -> dict[str, Any]:
    tenant = {"queued": queued, "inflight": 1, **ended}
    replica = {"inflight": 1, "limit": 4, "headroom": 0, "state": "serving", "saturated": False,
               "gpu_guarded": False, "engine_waiting": None, "engine_running": None,
               "kv_cache": None, "gpu_memory": None}  # fmt: skip
    return {"t": t, "tenants": {"a": tenant}, "replicas": {"r0": replica}}


def test_points_of_workers_sampled_at_other_moments_add_up_on_one_grid() -> None:
    """Two workers sampling every 2 s at other phases: per 2 s slot, what ended is added
    up (a worker's two points in one slot both count), the gauges are each worker's
    latest, summed. A slot not over yet, or not after ``since``, is not answered."""
    one = [_point(100.1, 1, completed=2), _point(102.1, 2, refused={"rate_limited": 1}),
           _point(104.1, 9)]  # fmt: skip
    two = [_point(100.5, 3, completed=1, refused={"rate_limited": 2}),
           _point(102.5, 4, completed=1), _point(103.9, 5, completed=4)]  # fmt: skip
    merged = merge_points([one, two], 2.0, since=None, now=104.2)
    assert [p["t"] for p in merged] == [102.0, 104.0]  # (104, 106] has not ended
    first, second = (p["tenants"]["a"] for p in merged)
    assert first == {"queued": 4, "inflight": 2, "completed": 3, "refused": {"rate_limited": 2}}
    assert second == {"queued": 7, "inflight": 2, "refused": {"rate_limited": 1}, "completed": 5}
    assert merged[1]["replicas"]["r0"]["inflight"] == 2
    assert merge_points([one, two], 2.0, since=102.0, now=106.0)[0]["t"] == 104.0


def test_every_field_of_a_history_point_has_a_rule_for_adding_workers_up() -> None:
    """A field added to the history's points later must say how workers add up."""
    doc = {
        "replicas": [{"name": "r0", "url": "http://127.0.0.1:9", "max_concurrency": 4}],
        "tenants": {"a": {"api_keys": [KEY_A]}},
    }
    runtime = build_app(parse_config(yaml.safe_dump(doc)), seed=1)[RUNTIME]
    history = History(FakeClock())
    ended = {("a", "completed", "none"): 2.0, ("a", "rejected", "rate_limited"): 1.0}
    history.sample(state_point(runtime), Totals(ended, {"a": 1.0}, {}, BOUNDS))
    (point,) = history.since(None)["points"]
    assert set(point) == {"t", "tenants", "replicas"}
    tenant = point["tenants"]["a"]
    assert {"completed", "good", "refused"} <= set(tenant)  # every field seen
    assert set(tenant) <= set(TENANT_POINT_RULES), set(tenant) - set(TENANT_POINT_RULES)
    replica = point["replicas"]["r0"]
    assert set(replica) <= set(REPLICA_POINT_RULES), set(replica) - set(REPLICA_POINT_RULES)


async def test_the_waits_are_quantiles_of_every_workers_buckets_added_up() -> None:
    """This worker saw 10 fast queue waits, its sibling 30 slow ones: the p50 is a slow
    wait (of the 40 together), not a quantile of one worker's. The sibling's points count;
    a poll after a point asks the sibling for the newer ones only."""
    clock = FakeClock(100.1)
    history = History(clock)
    fast, slow = [0.0] * len(BOUNDS), [0.0] * len(BOUNDS)
    fast[BOUNDS.index(0.01)], slow[BOUNDS.index(10.0)] = 10.0, 30.0
    zero = {("queue", "a"): tuple([0.0] * len(BOUNDS))}
    history.sample({"tenants": {"a": {"queued": 1, "inflight": 0}}}, Totals({}, {}, zero, BOUNDS))
    clock.advance(2.0)
    history.sample({}, Totals({}, {}, {("queue", "a"): tuple(fast)}, BOUNDS))
    clock.advance(2.0)
    sockets = WorkerMetrics(f"test-{os.getpid()}-{secrets.token_hex(4)}", CollectorRegistry())
    group = WorkerHistory(sockets, history)
    sibling = {"points": [_point(100.9, 2, completed=3)], "waits": [["queue", "a", slow]]}

    asked: list[str | None] = []

    async def answers(request: web.Request) -> web.Response:
        asked.append(request.query.get("since"))
        return web.json_response(sibling)

    runner = web.AppRunner(web.Application(), shutdown_timeout=0.1)
    runner.app.router.add_get("/history", answers)
    await sockets.start()
    try:
        await runner.setup()
        await web.UnixSite(runner, str(sockets.directory / "999999.sock")).start()
        answer = await group.since(None)
        later = await group.since(102.0)
    finally:
        await runner.cleanup()
        (sockets.directory / "999999.sock").unlink(missing_ok=True)
        await sockets.close()
    assert answer["workers"] == {"answered": 2, "unanswered": [], "served_by": os.getpid()}
    waits = answer["waits"]["a"]["queue"]
    assert waits["count"] == 40.0
    assert waits["p50"] is not None and waits["p50"] > 5.0  # in the slow bucket
    first = answer["points"][0]
    assert (first["t"], first["tenants"]["a"]["queued"], first["tenants"]["a"]["completed"]) == (
        102.0,
        3,
        3,
    )
    assert asked == [None, "102.0"]
    assert [p["t"] for p in later["points"]] == [104.0]


async def _refused(proxy: ProxyProcess, session: aiohttp.ClientSession, pid: int | None) -> int:
    """Requests refused ``rate_limited`` in the history (one worker's own, on its group
    socket, when ``pid`` is given; else through the port, whichever worker answers)."""
    if pid is None:
        async with session.get(proxy.url + "/admin/history") as resp:
            history = await resp.json()
    else:
        (path,) = socket_dir("*").parent.glob(f"{socket_dir('*').name}/{pid}.sock")
        async with (
            aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=str(path))) as own,
            own.get("http://worker/history") as resp,
        ):
            history = await resp.json()
    return sum(
        p["tenants"].get("a", {}).get("refused", {}).get("rate_limited", 0)
        for p in history["points"]
    )


@pytest.mark.redis
async def test_refusals_on_two_workers_show_in_one_history(
    tmp_path: Path, upstream_url: str, redis_server: RedisServer
) -> None:
    """Two workers, one rate bucket (in Redis) with one token: requests on fresh
    connections until both workers refused some. Every /admin/history answer, whichever
    worker gives it, counts every refusal once the slots they fell in have ended."""
    config = {
        "replicas": [{"name": "r0", "url": upstream_url, "max_concurrency": 4}],
        "tenants": {"a": {"api_keys": [KEY_A], "rate_per_s": 0.001, "burst": 1}},
        "state": {"backend": "redis", "redis_url": redis_server.url},
    }
    proxy = await start_serve(write_config(tmp_path / "c.yaml", config), workers=2)
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    headers = {"Authorization": f"Bearer {KEY_A}"}
    try:
        pids = [int(line["pid"]) for line in proxy.listening()]
        async with aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(force_close=True)
        ) as session:
            refused = 0
            deadline = time.monotonic() + WAIT_S
            while True:
                shares = [await _refused(proxy, session, pid) for pid in pids]
                if sum(shares) == refused and all(shares):
                    break
                assert time.monotonic() < deadline, (shares, refused)
                if sum(shares) < refused:
                    await asyncio.sleep(0.2)  # a sample every 2 s
                    continue
                assert refused < MAX_SENT
                async with session.post(proxy.url + CHAT, json=body, headers=headers) as resp:
                    refused += resp.status == 429
            served_by = set()
            for _ in range(READS):
                while (total := await _refused(proxy, session, None)) < refused:
                    assert time.monotonic() < deadline, (total, refused)  # a slot not over yet
                    await asyncio.sleep(0.2)
                assert total == refused
                async with session.get(proxy.url + "/admin/history") as resp:
                    answer = await resp.json()
                assert answer["workers"]["answered"] == 2
                served_by.add(answer["workers"]["served_by"])
                if served_by == set(pids):
                    break
            assert served_by == set(pids)
    finally:
        assert await proxy.stop() == 0
