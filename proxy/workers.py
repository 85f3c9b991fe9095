"""``serve --workers N``: N proxy processes on one port, and the parent that watches them.

A Python process uses one core; N workers use N. Each worker is a plain
``serve`` process whose listener sets ``SO_REUSEPORT``, so the kernel spreads
new connections across them; nothing is shared in memory, so N > 1 is only
allowed with ``state.backend: redis`` (``workers_refusal``), where every
limit lives in Redis and the workers behave as one gateway.

The parent (``supervise``) serves nothing itself. It resolves ``--port 0``
to one free port first (every worker must bind the same one), starts the
workers, forwards SIGTERM, SIGINT and SIGHUP to each (so drain and reload
work as for one process), and exits once every worker has exited after a
signal, with the worst exit code of that shutdown. A worker that dies on its own is started
again after ``RESTART_DELAY_S``, at most ``MAX_RESTARTS`` times in
``RESTART_WINDOW_S`` (then the parent stops the others and exits 1, for the
orchestrator to see); its seats free within ``state.lease_ms`` meanwhile.
A parent that dies (even by SIGKILL) takes its workers along: the kernel
sends each SIGTERM (``_end_with_parent``), and they drain as for a stop.
"""

from __future__ import annotations

import ctypes
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from functools import partial
from types import FrameType

import structlog

from proxy.settings import Config

log = structlog.get_logger(__name__)

#: A worker that died on its own is restarted after this long...
RESTART_DELAY_S = 1.0
#: ...at most this many times within the window, then the parent gives up.
MAX_RESTARTS = 5
RESTART_WINDOW_S = 60.0
#: Set for the workers: their group's name (``worker_admin.py``).
WORKER_GROUP_ENV = "ADMISSION_PROXY_WORKER_GROUP"
#: Set for the workers: how many the group has, the fewest instances there are
#: (``worker_admin.py``: the divisor of ``local_share`` before Redis was ever seen).
WORKER_COUNT_ENV = "ADMISSION_PROXY_WORKERS"
#: prctl(2) option: the signal a process gets when its parent dies.
PR_SET_PDEATHSIG = 1
#: The signals the parent passes on to every worker.
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def workers_refusal(config: Config, workers: int) -> str | None:
    """Why ``workers`` processes may not run this config; None when they may."""
    if workers < 1:
        return "--workers must be at least 1"
    if workers > 1 and config.state.backend != "redis":
        return (
            f"--workers {workers} needs state.backend: redis: with backend local each "
            "process would enforce every limit (rate, caps, replica seats) on its own, "
            f"{workers} times over"
        )
    return None


def resolve_port(host: str, port: int) -> int:
    """``port`` itself, or for 0 a port the OS picks that every worker can bind."""
    if port != 0:
        return port
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, 0))
        chosen: int = sock.getsockname()[1]
        return chosen


class Supervisor:
    """The worker processes and the signals passed on to them."""

    __slots__ = ("_argv", "_env", "_restarts", "_workers", "stopping")

    def __init__(self, argv: Sequence[str], count: int) -> None:
        self._argv = list(argv)
        # One group per parent: the workers pass admin changes on to each other
        # (``worker_admin.py``), and to no other gateway on the same Redis.
        self._env = {
            **os.environ,
            WORKER_GROUP_ENV: f"{os.getpid()}-{secrets.token_hex(4)}",
            WORKER_COUNT_ENV: str(count),
        }
        self._workers: list[subprocess.Popen[bytes] | None] = [None] * count
        self._restarts: list[float] = []
        self.stopping = False

    def __repr__(self) -> str:
        alive = sum(1 for w in self._workers if w is not None and w.poll() is None)
        return f"<Supervisor {alive}/{len(self._workers)} workers alive>"

    def _spawn(self, index: int) -> None:
        end_with_me = partial(_end_with_parent, os.getpid())
        process = subprocess.Popen(self._argv, env=self._env, preexec_fn=end_with_me)
        self._workers[index] = process
        log.info("worker started", worker=index, pid=process.pid)

    def _forward(self, signum: int, frame: FrameType | None = None) -> None:
        if signum != signal.SIGHUP:
            self.stopping = True
        for process in self._workers:
            if process is not None and process.poll() is None:
                process.send_signal(signum)

    def _may_restart(self) -> bool:
        now = time.monotonic()
        self._restarts = [t for t in self._restarts if now - t < RESTART_WINDOW_S]
        if len(self._restarts) >= MAX_RESTARTS:
            return False
        self._restarts.append(now)
        return True

    def run(self) -> int:
        """Start every worker and wait for them; the exit code of the whole."""
        for signum in FORWARDED:
            signal.signal(signum, self._forward)
        for first in range(len(self._workers)):
            self._spawn(first)
        worst = 0
        while any(w is not None for w in self._workers):
            try:
                pid, status = os.wait()
            except ChildProcessError:
                break
            index = next(
                (i for i, w in enumerate(self._workers) if w is not None and w.pid == pid), None
            )
            if index is None:
                continue
            process = self._workers[index]
            assert process is not None
            process.returncode = code = os.waitstatus_to_exitcode(status)
            self._workers[index] = None
            if self.stopping:
                worst = max(worst, abs(code))
                continue
            log.warning("worker exited", worker=index, pid=pid, code=code)
            if not self._may_restart():
                log.error("workers keep exiting: stopping", restarts=MAX_RESTARTS)
                self._forward(signal.SIGTERM)
                worst = max(worst, 1)
                continue
            time.sleep(RESTART_DELAY_S)
            if not self.stopping:
                self._spawn(index)
        return worst


def _end_with_parent(parent: int) -> None:
    """In the worker, before it runs: SIGTERM when the parent dies (Linux
    ``PR_SET_PDEATHSIG``), even by SIGKILL. Left running, orphaned workers kept
    serving on the port, unsupervised, next to the workers of a parent started
    again (two groups, drains applying to one of them). SIGTERM drains them as
    for a stop. Elsewhere nothing: a worker outlives a killed parent.

    Until exec the child keeps the parent's SIGTERM handler (``Supervisor.run``
    installs it first): a SIGTERM caught there is gone, and the worker then ran
    orphaned. Reset to the default, one arriving before exec ends the child (it
    holds nothing yet); exec resets it anyway and the worker installs its own."""
    if not sys.platform.startswith("linux"):
        return
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent:  # it died before the line above
        os.kill(os.getpid(), signal.SIGTERM)


def worker_argv(config_path: str, host: str, port: int) -> list[str]:
    """The command line of one worker: ``serve`` of the same config, listening shared."""
    return [
        sys.executable, "-m", "proxy", "serve", "--config", config_path,
        "--host", host, "--port", str(port), "--reuse-port",
    ]  # fmt: skip


def supervise(config_path: str, host: str, port: int, workers: int) -> int:
    """Run ``workers`` processes of ``config_path`` on ``host:port`` until signalled."""
    port = resolve_port(host, port)
    log.info("supervising", workers=workers, host=host, port=port, pid=os.getpid())
    return Supervisor(worker_argv(config_path, host, port), workers).run()
