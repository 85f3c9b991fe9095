"""Serving a sim in-process: `start_sim()` and the `SimServer` handle it returns.

Owns the `AppRunner` and the listening socket. Connection refusal is real:
the TCP site is stopped (new connects get ECONNREFUSED, a client sees a
connect error) and idle keep-alive connections are closed (in-flight requests
finish first), then a new site is bound to the same port when the refusal
ends. Port 0 lets the OS choose; the chosen port is read back from the socket
and reused for every re-bind.

Usage::

    sim = await start_sim(SimConfig(slots=2))
    try:
        ...  # talk to sim.url
        await sim.refuse_for(1.0)  # connect errors for a second, same port after
    finally:
        await sim.close()
"""

from __future__ import annotations

from types import TracebackType

from aiohttp import web

from proxy.sim.config import SimConfig
from proxy.sim.engine import SimEngine
from proxy.sim.faults import FOREVER, Faults
from proxy.sim.server import build_sim_app
from proxy.sim.state import ENGINE_KEY, STATE_KEY, SimState

__all__ = ["SHUTDOWN_TIMEOUT_S", "SimServer", "start_sim"]

SHUTDOWN_TIMEOUT_S = 5.0
"""How long `close()` lets in-flight handlers finish (they are aborted first)."""


class _Listener:
    """The runner's one TCP site, which can be stopped and re-bound on the same port."""

    __slots__ = ("_busy", "_closed", "_host", "_runner", "_site", "port")

    def __init__(self, runner: web.AppRunner, host: str, port: int, busy: set[object]) -> None:
        self._runner = runner
        self._busy = busy
        self._host = host
        self.port = port
        self._site: web.TCPSite | None = None
        self._closed = False

    @property
    def accepting(self) -> bool:
        return self._site is not None

    async def accept(self) -> None:
        if self._site is not None or self._closed:
            return
        site = web.TCPSite(self._runner, self._host, self.port, reuse_address=True)
        try:
            await site.start()
        except BaseException:
            await site.stop()  # unregister the dead site from the runner
            raise
        self._site = site
        self.port = site.port

    async def refuse(self) -> None:
        site, self._site = self._site, None
        if site is not None:
            await site.stop()
        server = self._runner.server
        if server is not None:
            for connection in server.connections:
                if connection in self._busy:
                    connection.close()  # after the response in progress
                else:
                    connection.force_close()  # idle keep-alive: the client's pool sees it

    def close(self) -> None:
        """From now on `accept()` is a no-op: the runner is being torn down."""
        self._closed = True

    def __repr__(self) -> str:
        listening = "accepting" if self.accepting else "refusing"
        return f"<_Listener {self._host}:{self.port} {listening}>"


class SimServer:
    """A running simulated replica: its URL, engine, fault controls and shutdown."""

    def __init__(self, app: web.Application, runner: web.AppRunner, listener: _Listener) -> None:
        self._app = app
        self._runner = runner
        self._listener = listener
        self._host = listener_host = _url_host(listener._host)
        self.url = f"http://{listener_host}:{listener.port}"

    @property
    def port(self) -> int:
        return self._listener.port

    @property
    def host(self) -> str:
        return self._host

    @property
    def app(self) -> web.Application:
        return self._app

    @property
    def engine(self) -> SimEngine:
        return self._app[ENGINE_KEY]

    @property
    def state(self) -> SimState:
        return self._app[STATE_KEY]

    @property
    def faults(self) -> Faults:
        return self.state.faults

    @property
    def accepting(self) -> bool:
        return self._listener.accepting

    async def set_faults(self, **changes: object) -> Faults:
        """Same as `POST /sim/faults` with `changes`; raises `FaultsError` when invalid."""
        return await self.state.apply_faults(changes)

    async def refuse_for(self, seconds: float | None) -> None:
        """Refuse connections now; accept again after `seconds` (None: until `accept()`)."""
        if seconds is not None and seconds <= 0:
            raise ValueError(f"seconds must be > 0 or None, got {seconds}")
        refuse_ms = FOREVER if seconds is None else seconds * 1000.0
        await self.set_faults(refuse_connections_ms=refuse_ms)

    async def accept(self) -> None:
        """End a refusal: listen again on the same port."""
        await self.set_faults(refuse_connections_ms=0.0)

    async def close(self) -> None:
        self._listener.close()
        await self.state.close()
        await self._runner.cleanup()

    async def __aenter__(self) -> SimServer:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    def __repr__(self) -> str:
        listening = "accepting" if self.accepting else "refusing"
        return f"<SimServer {self.url} {listening} {self.engine!r}>"


async def start_sim(config: SimConfig, host: str = "127.0.0.1", port: int = 0) -> SimServer:
    """Serve a sim on `host:port` (0: the OS picks) and return its handle.

    A `refuse_connections_ms` in `config.faults` starts once the port is
    bound, so even a refusing sim has a known port to come back on.
    """
    app = build_sim_app(config)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=SHUTDOWN_TIMEOUT_S)
    await runner.setup()
    state = app[STATE_KEY]
    listener = _Listener(runner, host, port, state.busy_connections)
    try:
        await listener.accept()
        state.gate = listener
        if config.faults.refuse_connections_ms != 0:
            await state.apply_faults({"refuse_connections_ms": config.faults.refuse_connections_ms})
    except BaseException:
        listener.close()
        await runner.cleanup()
        raise
    return SimServer(app, runner, listener)


def _url_host(host: str) -> str:
    if host in ("", "0.0.0.0", "::"):
        return "127.0.0.1"
    return f"[{host}]" if ":" in host else host
