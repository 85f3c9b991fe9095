"""``serve --workers N``: one scrape of ``/metrics`` counts every worker.

The N workers share one port, so the kernel hands each scrape to any one of
them, and each has only its own counters: a scrape saw one worker's numbers,
the next another's, and Prometheus read every change of worker as a counter
reset (``rate()`` over such a series is meaningless). prometheus-client's own
answer, its multiprocess mode, keeps every value in shared files, which the
request path's counters (``telemetry.metrics``, written for speed) do not
use. Instead each worker also serves its own exposition on a Unix socket in a
directory private to its group (``socket_dir``), and the worker a scrape
reaches reads its siblings' there and answers their sum (``merge``):

- counters and histograms are summed, series by series (a ``_created``
  series takes the earliest);
- each gauge by what it means across processes (``GAUGE_MERGE``): queue
  depths and seats held here are summed; readings every worker takes of the
  same thing (a replica's limit, GPU readings, instances) take the largest;
  health, shared state and quota left take the smallest (one worker that
  sees a problem shows it); the budget pressure takes the worst worker's.

A sibling that does not answer within ``SIBLING_TIMEOUT_S`` (a worker
busy or stalled) counts with the last exposition read from it; one that
nothing listens for any more (a worker killed) is left out, and its socket
file removed. The sockets are only for the group: ``GET /metrics`` here,
and what another module asks to serve on them before they start
(``WorkerMetrics.serve``: ``/state`` of ``worker_state.py``, ``/history``
of ``worker_history.py``), read with ``ask``; the directory is the user's
alone (``_private_dir``: one already there that is not is refused).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import stat
import tempfile
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import cast

import aiohttp
import structlog
from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.utils import floatToGoString

log = structlog.get_logger(__name__)
_go_float = cast(Callable[[float], str], floatToGoString)  # how generate_latest writes a value

#: A sibling that has not answered by then is left out of the scrape.
SIBLING_TIMEOUT_S = 1.0
Merge = Callable[[Sequence[float]], float]
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
#: How each gauge adds up across workers; a gauge not listed is summed.
GAUGE_MERGE: dict[str, Merge] = {
    "admission_queue_depth": sum,
    "admission_queue_depth_max": max,  # the fullest worker's queue (each has its capacity)
    "admission_replica_inflight": sum,
    "admission_replica_limit": max,
    "admission_replica_healthy": min,
    "admission_gpu_utilization_ratio": max,
    "admission_gpu_memory_used_ratio": max,
    "admission_model_queue_depth": sum,
    "admission_budget_pressure": max,
    "admission_quota_remaining_tokens": min,
    "admission_state_up": min,
    "admission_instances": max,
}


#: The longest Unix socket path a system binds (Linux's 108 bytes with the NUL; macOS 104).
MAX_SOCKET_PATH = 103
#: The longest socket file name here: a pid (7 digits at most on Linux) and ``.sock``.
_LONGEST_SOCKET_NAME = len("/4194304.sock")


def socket_dir(group: str) -> Path:
    """Where the workers of ``group`` (one ``serve --workers`` parent) serve their metrics.

    Under the temporary directory, unless its path is so long that a socket in it
    could not be bound (a long ``TMPDIR``): then under ``/tmp``. Every worker of the
    group picks the same place, since they share their environment.
    """
    name = f"admission-proxy-{group}"
    base = Path(tempfile.gettempdir())
    if len(os.fsencode(base / name)) + _LONGEST_SOCKET_NAME > MAX_SOCKET_PATH:
        base = Path("/tmp")  # made private, or refused, by _private_dir
    return base / name


def _private_dir(directory: Path) -> None:
    """Make ``directory`` (0700), or check that the one there is this user's alone.

    One left by someone else (or a link to one) would let them read the
    workers' metrics, add sockets of their own to every scrape, or remove ours.
    """
    directory.mkdir(mode=0o700, exist_ok=True)
    info = os.lstat(directory)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o077:
        raise PermissionError(
            f"{directory} is not a directory of this user's alone (mode "
            f"{stat.filemode(info.st_mode)}, owner uid {info.st_uid}): not serving the "
            "worker metrics socket there; remove it"
        )


def _rule(name: str, kind: str) -> Merge:
    """How the family ``name`` (its ``# TYPE`` line's name and ``kind``) adds up."""
    if name.endswith("_created"):
        return min  # when the series began: the earliest worker's
    if kind == "gauge":
        return GAUGE_MERGE.get(name, sum)
    return sum


def merge(texts: Sequence[str]) -> bytes:
    """The Prometheus text of several workers' expositions, added up as one process's.

    Read line by line, not with prometheus-client's parser: that one took
    about 50 us a line, over a second for four workers of a hundred tenants,
    and the scrape runs on the event loop of a worker serving requests.
    Every worker's text comes from the same ``generate_latest`` (labels
    sorted, one sample a line, ``name{labels} value``), so a series is the
    text before its value's space, and each family keeps its first worker's
    ``# HELP`` and ``# TYPE`` lines.
    """
    heads: dict[str, list[str]] = {}  # each family's comment lines, in first-seen order
    rules: dict[str, Merge] = {}
    series: dict[str, dict[str, list[float]]] = {}
    for text in texts:
        family: dict[str, list[float]] = {}
        for line in text.splitlines():
            if line.startswith("#"):
                parts = line.split(" ", 3)
                if len(parts) < 4 or parts[1] not in ("HELP", "TYPE"):
                    continue
                name = parts[2]
                if name not in heads:
                    heads[name], series[name] = [], {}
                    rules[name] = _rule(name, "untyped")
                if parts[1] == "TYPE":
                    rules[name] = _rule(name, parts[3])
                if len(heads[name]) < 2:
                    heads[name].append(line)
                family = series[name]
            elif line:
                key, _, value = line.rpartition(" ")
                family.setdefault(key, []).append(float(value))
    out = []
    for name, head in heads.items():
        out.extend(head)
        rule = rules[name]
        out.extend(f"{key} {_go_float(rule(found))}" for key, found in series[name].items())
    return ("\n".join(out) + "\n").encode() if out else b""


class WorkerMetrics:
    """This worker's metrics socket, and the group's merged scrape."""

    __slots__ = (
        "_last", "_rebinding", "_registry", "_routes", "_runner", "_site", "directory", "path",
    )  # fmt: skip

    def __init__(self, group: str, registry: CollectorRegistry) -> None:
        self._registry = registry
        self._routes: dict[str, Handler] = {}
        self.directory = socket_dir(group)
        self.path = self.directory / f"{os.getpid()}.sock"
        self._runner: web.AppRunner | None = None
        self._site: web.UnixSite | None = None
        self._rebinding = asyncio.Lock()
        #: Each live sibling's last exposition read (``_sibling``).
        self._last: dict[Path, str] = {}

    def __repr__(self) -> str:
        return f"<WorkerMetrics {self.path}, {len(self._last)} siblings' last read kept>"

    def serve(self, route: str, handler: Handler) -> None:
        """Serve ``GET route`` on this worker's socket too (before ``start``)."""
        self._routes[route] = handler

    async def start(self) -> None:
        _private_dir(self.directory)
        app = web.Application()
        app.router.add_get("/metrics", self._own)
        for route, handler in self._routes.items():
            app.router.add_get(route, handler)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        self._runner = runner
        await self._bind()

    async def _bind(self) -> None:
        """Serve on ``path`` (again, when its file was removed: see ``scrape``)."""
        assert self._runner is not None
        if self._site is not None:
            await self._site.stop()
        _private_dir(self.directory)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()  # a former process of the same pid
        self._site = web.UnixSite(self._runner, str(self.path))
        await self._site.start()

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = self._site = None
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        _remove_dead(self.directory)  # a killed sibling's, else the directory stays
        with contextlib.suppress(OSError):
            self.directory.rmdir()  # the group's last worker to stop

    async def _own(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self._registry))

    async def siblings(self) -> list[Path]:
        """The other workers' sockets, this worker's own bound again first if gone.

        A socket file of this worker's found gone (a temporary-file cleaner such
        as systemd-tmpfiles ages sockets out of /tmp, a sibling removed it) is made
        again: else no sibling counted this worker until it restarted.
        """
        if self._runner is not None and not self.path.exists():
            async with self._rebinding:  # two scrapes at once bind it once
                if self._runner is not None and not self.path.exists():
                    log.warning("worker metrics socket gone, served again", socket=str(self.path))
                    await self._bind()
        return [p for p in _sockets(self.directory) if p != self.path]

    async def scrape(self) -> bytes:
        """Every reachable worker's metrics, this one's included, merged."""
        siblings = await self.siblings()
        own = generate_latest(self._registry).decode()
        for gone in self._last.keys() - set(siblings):
            del self._last[gone]  # a dead worker's socket another worker removed
        found = await asyncio.gather(*(self._sibling(path) for path in siblings))
        return merge([own, *(text for text in found if text is not None)])

    async def _sibling(self, path: Path) -> str | None:
        """A sibling's exposition; its last one read when it is alive but did not answer.

        Left out of the sum, a live sibling's counters would drop for one scrape and
        come back at the next: Prometheus reads each as a reset, and ``rate()`` counts
        the other workers' whole totals (then the sibling's) as new requests.
        """
        try:
            text = await ask(path, "/metrics", SIBLING_TIMEOUT_S)
        except Unanswered as exc:
            log.warning("worker metrics not read", socket=str(path), error=str(exc))
            return self._last.get(path)
        if text is None:
            self._last.pop(path, None)
        else:
            self._last[path] = text
        return text


class Unanswered(Exception):
    """A sibling that is alive, or may be, but did not answer in time (or not 200)."""


async def ask(path: Path, route: str, timeout_s: float) -> str | None:
    """``GET route`` of the sibling whose socket is ``path``, within ``timeout_s``.

    None when nothing listens there (a worker that died without cleaning up:
    its socket file is removed); ``Unanswered`` for a live one that did not
    answer, whose socket stays.
    """
    try:
        async with (
            aiohttp.ClientSession(
                connector=aiohttp.UnixConnector(path=str(path)),
                timeout=aiohttp.ClientTimeout(total=timeout_s),
            ) as session,
            session.get(f"http://worker{route}") as response,
        ):
            if response.status != 200:
                raise Unanswered(f"HTTP {response.status}")
            return await response.text()
    except aiohttp.ClientConnectorError as exc:
        if isinstance(exc.os_error, ConnectionRefusedError | FileNotFoundError):
            _forget(path)
            return None
        # A live worker too (one whose accept backlog is full: EAGAIN on
        # uvloop): removing its socket would leave it out of every scrape.
        raise Unanswered(repr(exc)) from exc
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise Unanswered(repr(exc)) from exc


def _remove_dead(directory: Path) -> None:
    """Remove the sockets in ``directory`` nothing listens on (workers killed since).

    A connect to a Unix socket answers at once, listened on or not: no thread.
    """
    for path in _sockets(directory):
        with socket.socket(socket.AF_UNIX) as probe:
            probe.setblocking(False)
            try:
                probe.connect(str(path))
            except (ConnectionRefusedError, FileNotFoundError):
                _forget(path)
            except OSError:
                pass  # alive but busy (EAGAIN): left as it is


def _sockets(directory: Path) -> list[Path]:
    """The sockets in ``directory``; none when it is gone (the group's last other
    worker removed it while this one was stopping too)."""
    try:
        return list(directory.glob("*.sock"))
    except FileNotFoundError:
        return []


def _forget(path: Path) -> None:
    """Remove a dead worker's socket file (a local unlink: not worth a thread)."""
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


#: The app's ``WorkerMetrics``; None outside a ``serve --workers`` group.
WORKER_METRICS: web.AppKey[WorkerMetrics | None] = web.AppKey("worker_metrics")
