"""Real ``llama-server`` processes for the engine tests (see ``bench/real_engine.py``).

The engine is built once per machine (minutes, cached); each test module
starts its own servers on OS-chosen loopback ports and stops them. Where the
machine has no C++ toolchain the engine tests are skipped with that reason;
any other build failure fails them, so a broken build never hides as a skip.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.real_engine import Engine, MissingToolchain, ensure

#: The model name the servers answer to (``--alias``), unless a test names another.
MODEL = "tiny"
#: A server that is not healthy by then failed to start.
START_TIMEOUT_S = 60.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class LlamaServer:
    """One ``llama-server`` child process; ``kill`` and ``start`` again keep the port."""

    def __init__(
        self,
        engine: Engine,
        log_dir: Path,
        name: str,
        *,
        parallel: int,
        threads: int = 1,
        model: Path | None = None,
        alias: str = MODEL,
    ) -> None:
        self.engine = engine
        self.model = model or engine.model
        #: The name the server lists in ``/v1/models`` and answers to (``--alias``).
        self.alias = alias
        self.name = name
        self.parallel = parallel
        self.threads = threads
        self.port = free_port()
        self.log = log_dir / f"{name}.log"
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        argv = [
            str(self.engine.server),
            "-m", str(self.model),
            "--host", "127.0.0.1",
            "--port", str(self.port),
            "--parallel", str(self.parallel),
            # Total context, split across the slots: 4096 tokens each.
            "-c", str(4096 * self.parallel),
            "-t", str(self.threads),
            "--metrics",
            "--no-webui",
            "--alias", self.alias,
        ]  # fmt: skip
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        self._wait_healthy()

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited {self.process.returncode}:\n{self.tail()}")
            with (
                contextlib.suppress(OSError),
                urllib.request.urlopen(self.url + "/health", timeout=1.0) as response,
            ):
                if response.status == 200:
                    return
            time.sleep(0.05)
        raise RuntimeError(f"{self.name} not healthy after {START_TIMEOUT_S:.0f} s:\n{self.tail()}")

    def kill(self) -> None:
        """SIGKILL: the replica vanishes mid-request, as a crashed engine does."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=10)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


_built: Engine | MissingToolchain | None = None


def _build() -> Engine | MissingToolchain:
    global _built
    if _built is None:
        try:
            _built = ensure(os.cpu_count())
        except MissingToolchain as exc:
            _built = exc
    return _built


@pytest.hookimpl(trylast=True)  # after ``-m`` has deselected what it will
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Build the engine before any test runs when an engine test is selected.

    The first build takes minutes; inside a fixture it would count against
    the first engine test's timeout. ``scripts/test`` builds it even earlier,
    in plain sight; this covers a bare ``pytest`` run.
    """
    if any(item.get_closest_marker("engine") for item in items):
        _build()


@pytest.fixture(scope="session")
def real_engine() -> Engine:
    """The built server and model (``pytest_collection_modifyitems`` built them)."""
    built = _build()
    if isinstance(built, MissingToolchain):
        pytest.skip(f"engine tests need a C++ toolchain to build llama-server: {built}")
    return built


@contextlib.contextmanager
def llama_servers(
    engine: Engine,
    log_dir: Path,
    count: int,
    *,
    parallel: int,
    threads: int = 1,
    model: Path | None = None,
) -> Iterator[list[LlamaServer]]:
    servers = [
        LlamaServer(engine, log_dir, f"llama-{i}", parallel=parallel, threads=threads, model=model)
        for i in range(count)
    ]
    try:
        for server in servers:
            server.start()
        yield servers
    finally:
        for server in servers:
            server.stop()


@pytest.fixture(scope="module")
def llama_pair(
    real_engine: Engine, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[LlamaServer]]:
    """Two replicas with ``--parallel 2`` and one thread each (two cores)."""
    with llama_servers(real_engine, tmp_path_factory.mktemp("llama"), 2, parallel=2) as servers:
        yield servers
