"""``serve --workers N``: whichever worker a scrape reaches, ``/metrics`` counts them all.

Before, a scrape saw the one worker the kernel handed it to: its counters, the
next scrape another's, which Prometheus reads as counter resets. Each worker
now serves its own exposition on a Unix socket private to its group, and the
worker scraped adds its siblings' to its own (``proxy/worker_metrics.py``).
"""

from __future__ import annotations

import asyncio
import os
import secrets
import socket
import tempfile
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import uvloop
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from proxy import worker_metrics
from proxy.app import build_app
from proxy.runtime import RUNTIME
from proxy.worker_metrics import (
    GAUGE_MERGE,
    WorkerMetrics,
    merge,
    socket_dir,
)
from tests.fleet import start_serve, write_config
from tests.helpers import KEY_A, make_config, samples_by_label
from tests.redis_server import RedisServer

CHAT = "/v1/chat/completions"
AUTH = {"Authorization": f"Bearer {KEY_A}"}
BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
REQUESTS = 40
SCRAPES = 6


def _worker(requests: int, depth: float, healthy: float, waited: float) -> str:
    """One worker's exposition: a counter, a histogram and three kinds of gauge."""
    registry = CollectorRegistry()
    Counter("admission_requests", "R", ["tenant"], registry=registry).labels("a").inc(requests)
    Histogram("admission_ttft_seconds", "T", ["tenant"], registry=registry).labels("a").observe(
        waited
    )
    Gauge("admission_queue_depth", "Q", ["tenant"], registry=registry).labels("a").set(depth)
    Gauge("admission_replica_healthy", "H", ["replica"], registry=registry).labels("r0").set(
        healthy
    )
    Gauge("admission_replica_limit", "L", ["replica"], registry=registry).labels("r0").set(8)
    Gauge("admission_something_new", "N", registry=registry).set(depth)
    return generate_latest(registry).decode()


def test_counters_and_histograms_add_up_and_each_gauge_by_its_meaning() -> None:
    text = merge([_worker(3, 2, 1, 0.02), _worker(5, 4, 0, 0.3)]).decode()
    assert samples_by_label(text, "admission_requests_total", "tenant") == {"a": 8.0}
    assert samples_by_label(text, "admission_ttft_seconds_count", "tenant") == {"a": 2.0}
    buckets = samples_by_label(text, "admission_ttft_seconds_bucket", "le")
    assert (buckets["0.025"], buckets["0.5"], buckets["+Inf"]) == (1.0, 2.0, 2.0)
    assert samples_by_label(text, "admission_queue_depth", "tenant") == {"a": 6.0}  # summed
    assert samples_by_label(text, "admission_replica_healthy", "replica") == {"r0": 0.0}  # least
    assert samples_by_label(text, "admission_replica_limit", "replica") == {"r0": 8.0}  # same
    assert "admission_something_new 6.0" in text  # a gauge not listed is summed


def test_one_worker_comes_out_as_it_went_in() -> None:
    text = _worker(3, 2, 1, 0.02)
    assert merge([text]).decode() == text


def test_label_values_with_spaces_quotes_and_braces_are_series_of_their_own() -> None:
    """The merge reads a series as the text before its value (not with prometheus-client's
    parser, too slow for the event loop): values that look like syntax stay whole."""
    odd = ["a b", 'a"b', "a,b}", "a\\b", "a\nb", "a"]
    texts = []
    for worker in range(3):
        registry = CollectorRegistry()
        counter = Counter("admission_requests", "R", ["tenant", "outcome"], registry=registry)
        for i, tenant in enumerate(odd):
            counter.labels(tenant, "completed").inc(worker + i)
        texts.append(generate_latest(registry).decode())
    totals = {
        sample.labels["tenant"]: sample.value
        for family in text_string_to_metric_families(merge(texts).decode())
        for sample in family.samples
        if sample.name == "admission_requests_total"
    }
    assert totals == {tenant: float(3 * i + 3) for i, tenant in enumerate(odd)}


def _group() -> str:
    return f"test-{os.getpid()}-{secrets.token_hex(4)}"


@pytest.mark.parametrize("kind", ["open_to_all", "a_link"])
async def test_a_socket_directory_not_this_users_alone_is_refused(
    tmp_path: Path, kind: str
) -> None:
    """A directory of the group's name already there and open to others (or a link to
    one elsewhere) would let anyone read the metrics or add sockets to every scrape."""
    group = _group()
    directory = socket_dir(group)
    if kind == "open_to_all":
        directory.mkdir()
        directory.chmod(0o777)
    else:
        target = tmp_path / "elsewhere"
        target.mkdir(mode=0o700)
        directory.symlink_to(target)
    sockets = WorkerMetrics(group, CollectorRegistry())
    try:
        with pytest.raises(PermissionError, match="not a directory of this user's alone"):
            await sockets.start()
        assert not list(directory.glob("*.sock"))
    finally:
        await sockets.close()
        if directory.is_symlink():
            directory.unlink()
        elif directory.exists():
            directory.rmdir()


async def test_a_long_temporary_directory_still_binds_the_socket(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A socket path past the system's limit (108 bytes) cannot be bound: with a long
    TMPDIR the worker could not start. The sockets then go under /tmp."""
    long = tmp_path / ("t" * 80)
    long.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(long))
    registry = CollectorRegistry()
    Counter("admission_requests", "R", registry=registry).inc(7)
    sockets = WorkerMetrics(_group(), registry)
    await sockets.start()
    try:
        assert len(os.fsencode(sockets.path)) < 108  # Linux's sun_path, its NUL included
        async with (
            aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=str(sockets.path))) as s,
            s.get("http://worker/metrics") as resp,
        ):
            assert "admission_requests_total 7.0" in await resp.text()
    finally:
        await sockets.close()
    assert not sockets.directory.exists()


def test_a_sibling_that_cannot_take_the_connection_now_keeps_its_socket(tmp_path: Path) -> None:
    """Only a socket nothing listens on is a dead worker's. A live one whose accept
    backlog is full answers EAGAIN (uvloop, the proxy's loop): its socket was removed,
    and that worker was left out of every later scrape."""
    group = _group()
    directory = socket_dir(group)
    directory.mkdir(mode=0o700)
    busy, dead = directory / "999998.sock", directory / "999999.sock"
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(busy))
    listener.listen(0)  # never accepts: the backlog fills
    with socket.socket(socket.AF_UNIX) as killed:
        killed.bind(str(dead))  # bound, then closed: a worker killed
    waiting = []
    try:
        for _ in range(8):  # fill the backlog (Linux takes one or two past listen(0))
            client = socket.socket(socket.AF_UNIX)
            client.setblocking(False)
            waiting.append(client)
            try:
                client.connect(str(busy))
            except BlockingIOError:
                break
        else:
            pytest.skip("this kernel's backlog did not fill")
        sockets = WorkerMetrics(group, CollectorRegistry())
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(sockets.scrape())
        assert busy.exists()
        assert not dead.exists()
    finally:
        for client in waiting:
            client.close()
        listener.close()
        for path in directory.glob("*.sock"):
            path.unlink()
        directory.rmdir()


async def test_a_sibling_that_stalls_counts_with_what_it_last_answered(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A live sibling that does not answer in time was left out of that scrape: its
    counters dropped and came back, two resets for Prometheus (rate() then counts
    every worker's whole total as new). It counts with its last answer instead."""
    monkeypatch.setattr(worker_metrics, "SIBLING_TIMEOUT_S", 30.0)  # a loaded machine
    group = _group()
    stalled = asyncio.Event()
    release = asyncio.Event()

    async def sibling(request: web.Request) -> web.Response:
        if stalled.is_set():
            await release.wait()  # a worker whose loop is busy elsewhere
        return web.Response(body=_worker(5, 0, 1, 0.1).encode())

    runner = web.AppRunner(web.Application(), shutdown_timeout=0.1)
    runner.app.router.add_get("/metrics", sibling)
    own = CollectorRegistry()
    Counter("admission_requests", "R", ["tenant"], registry=own).labels("a").inc(3)
    sockets = WorkerMetrics(group, own)
    await sockets.start()
    await runner.setup()
    path = sockets.directory / "999999.sock"
    try:
        await web.UnixSite(runner, str(path)).start()
        first = (await sockets.scrape()).decode()
        assert samples_by_label(first, "admission_requests_total", "tenant") == {"a": 8.0}
        stalled.set()
        monkeypatch.setattr(worker_metrics, "SIBLING_TIMEOUT_S", 0.2)  # it never answers now
        second = (await sockets.scrape()).decode()
        assert samples_by_label(second, "admission_requests_total", "tenant") == {"a": 8.0}
        path.unlink()  # it died, and another worker removed its socket: not counted now
        third = (await sockets.scrape()).decode()
        assert samples_by_label(third, "admission_requests_total", "tenant") == {"a": 3.0}
        assert "0 siblings' last read kept" in repr(sockets)  # not kept for good
    finally:
        release.set()
        await runner.cleanup()
        path.unlink(missing_ok=True)
        await sockets.close()
    assert not sockets.directory.exists()


async def test_a_worker_whose_socket_file_was_removed_serves_it_again() -> None:
    """A cleaner of old temporary files (systemd-tmpfiles ages sockets out of /tmp) or
    a sibling removed this worker's socket: no sibling counted it until it restarted.
    Its next scrape binds the socket again."""
    registry = CollectorRegistry()
    Counter("admission_requests", "R", registry=registry).inc(4)
    sockets = WorkerMetrics(_group(), registry)
    await sockets.start()
    try:
        sockets.path.unlink()
        sockets.directory.rmdir()
        await asyncio.gather(sockets.scrape(), sockets.scrape())
        async with (
            aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=str(sockets.path))) as s,
            s.get("http://worker/metrics") as resp,
        ):
            assert "admission_requests_total 4.0" in await resp.text()
    finally:
        await sockets.close()
    assert not sockets.directory.exists()


async def test_the_last_worker_to_stop_removes_a_killed_siblings_socket() -> None:
    """A sibling killed (SIGKILL, a crash) leaves its socket file: the group's directory
    was left in the temporary directory, one per group that ever lost a worker."""
    group = _group()
    sockets = WorkerMetrics(group, CollectorRegistry())
    await sockets.start()
    try:
        with socket.socket(socket.AF_UNIX) as killed:
            killed.bind(str(sockets.directory / "999999.sock"))
    finally:
        await sockets.close()
    assert not sockets.directory.exists()


async def test_a_worker_stopping_as_its_sibling_removes_the_directory_stops_cleanly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two workers stop at once: the other one removed the group's directory between
    this one's look at it and its listing (``scandir`` raised FileNotFoundError, and
    the worker exited 1 after a clean SIGTERM). Stopping, or a scrape, then finds no
    sibling instead."""
    registry = CollectorRegistry()
    Counter("admission_requests", "R", registry=registry).inc(3)
    sockets = WorkerMetrics(_group(), registry)
    await sockets.start()
    real_glob = Path.glob

    def gone(self: Path, pattern: str) -> Any:
        if self == sockets.directory:
            raise FileNotFoundError(2, "No such file or directory", str(self))
        return real_glob(self, pattern)

    monkeypatch.setattr(Path, "glob", gone)
    assert b"admission_requests_total 3.0" in await sockets.scrape()  # its own alone
    await sockets.close()
    monkeypatch.undo()
    assert not sockets.directory.exists()


@pytest.mark.redis
async def test_every_scrape_counts_every_worker(
    tmp_path: Path, upstream_url: str, redis_server: RedisServer
) -> None:
    """Two workers; 40 requests, each on a new connection (the kernel spreads them over
    both); then every one of six scrapes, each on a new connection, counts all 40."""
    config = {
        "replicas": [{"name": "r0", "url": upstream_url, "max_concurrency": 4}],
        "tenants": {"a": {"api_keys": [KEY_A]}},
        "state": {"backend": "redis", "redis_url": redis_server.url},
    }
    proxy = await start_serve(write_config(tmp_path / "c.yaml", config), workers=2)
    try:
        pids = {line["pid"] for line in proxy.listening()}
        for _ in range(REQUESTS):
            async with (
                aiohttp.ClientSession() as session,
                session.post(proxy.url + CHAT, json=BODY, headers=AUTH) as resp,
            ):
                assert resp.status == 200
        counted = []
        for _ in range(SCRAPES):
            async with (
                aiohttp.ClientSession() as session,
                session.get(proxy.url + "/metrics") as resp,
            ):
                text = await resp.text()
            counted.append(samples_by_label(text, "admission_requests_total", "outcome"))
        assert counted == [{"completed": float(REQUESTS)}] * SCRAPES
        # The group's directory: where one of these workers' sockets is.
        pid = next(iter(pids))
        (socket,) = socket_dir("*").parent.glob(f"{socket_dir('*').name}/{pid}.sock")
        directory = socket.parent
        assert {path.stem for path in directory.glob("*.sock")} == {str(p) for p in pids}
    finally:
        assert await proxy.stop() == 0
    assert not directory.exists()  # the last worker to stop removed it


def test_every_gauge_of_the_proxy_has_a_rule_for_adding_workers_up() -> None:
    """A gauge added later must say how workers add up (a sum is wrong for most)."""
    app = build_app(make_config(["http://127.0.0.1:9"]), seed=1)
    registry = app[RUNTIME].telemetry.metrics.registry
    gauges = {
        family.name
        for family in registry.collect()
        if family.type == "gauge" and not family.name.endswith("_created")
    }
    assert gauges and gauges <= set(GAUGE_MERGE), gauges - set(GAUGE_MERGE)
