"""Runtime state of one simulated replica, shared by its handlers.

Owns the live `Faults`, the fault dice, the request counters, the shutdown
signal, and the timer that ends a timed connection refusal. The listener
itself belongs to whoever serves the app (`SimServer`); it plugs in here as a
`ConnectionGate`, so the app can refuse connections without knowing about
sites and sockets. An app served by someone else (pytest's `aiohttp_server`)
has no gate, and asking it to refuse connections is a `FaultsError`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Mapping
from typing import Protocol

from aiohttp import web
from prometheus_client import CollectorRegistry

from proxy.sim.config import SimConfig
from proxy.sim.engine import SimEngine
from proxy.sim.faults import FaultDice, Faults, FaultsError, update_faults

__all__ = ["ENGINE_KEY", "REGISTRY_KEY", "STATE_KEY", "ConnectionGate", "SimState"]

_log = logging.getLogger(__name__)


class ConnectionGate(Protocol):
    """Stops and restarts accepting TCP connections on the same port.

    `refuse` also closes idle keep-alive connections (those not in
    `SimState.busy_connections`), or a pooled client would never notice.
    """

    async def refuse(self) -> None: ...

    async def accept(self) -> None: ...


class SimState:
    """Mutable control plane of one sim; the engine is separate (`ENGINE_KEY`).

    `faults` is replaced whole on every change, so a handler that read it once
    acts on one consistent setting for its whole request.
    """

    __slots__ = (
        "_refusal_timer",
        "busy_connections",
        "closing",
        "config",
        "dice",
        "faults",
        "gate",
        "in_flight",
        "requests_total",
        "resets_injected",
    )

    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.faults = config.faults
        self.dice = FaultDice(config.seed)
        self.gate: ConnectionGate | None = None
        self.closing = asyncio.Event()
        self.requests_total = 0
        self.in_flight = 0
        self.resets_injected = 0
        # Protocols of connections with a request in progress (see ConnectionGate).
        self.busy_connections: set[object] = set()
        self._refusal_timer: asyncio.Task[None] | None = None

    async def apply_faults(self, changes: Mapping[str, object]) -> Faults:
        """Validate and swap in `changes`; start or end a refusal when asked.

        Raises `FaultsError` and changes nothing when a value is invalid.
        """
        faults = update_faults(self.faults, changes)
        refuse_ms = faults.refuse_connections_ms
        if "refuse_connections_ms" in changes and refuse_ms != 0 and self.gate is None:
            raise FaultsError(
                "refuse_connections_ms needs a sim served by start_sim() or the sim command"
            )
        self.faults = faults
        if "refuse_connections_ms" in changes:
            await self._set_refusal(refuse_ms)
        return faults

    async def close(self) -> None:
        """Signal shutdown to waiting handlers and stop the refusal timer."""
        self.closing.set()
        await self._cancel_refusal_timer()

    async def _set_refusal(self, refuse_ms: float) -> None:
        await self._cancel_refusal_timer()
        gate = self.gate
        if gate is None:
            return
        if refuse_ms == 0:
            await gate.accept()
            return
        await gate.refuse()
        if refuse_ms > 0:
            self._refusal_timer = asyncio.create_task(
                self._accept_after(refuse_ms / 1000.0), name="sim-refusal-timer"
            )

    async def _accept_after(self, seconds: float) -> None:
        await asyncio.sleep(seconds)
        if self.gate is None:
            return
        try:
            await self.gate.accept()
        except OSError as exc:
            # The port was taken meanwhile: stay refusing, and say so, rather
            # than kill the timer task with an exception nobody awaits.
            _log.warning("sim: cannot listen again after a refusal: %s", exc)
            return
        self.faults = dataclasses.replace(self.faults, refuse_connections_ms=0.0)

    async def _cancel_refusal_timer(self) -> None:
        timer, self._refusal_timer = self._refusal_timer, None
        if timer is not None and timer is not asyncio.current_task():
            timer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await timer

    def __repr__(self) -> str:
        return (
            f"<SimState {self.in_flight} in flight, {self.requests_total} requests, "
            f"{self.dice.errors_injected} errors injected>"
        )


STATE_KEY = web.AppKey("sim_state", SimState)
ENGINE_KEY = web.AppKey("sim_engine", SimEngine)
REGISTRY_KEY = web.AppKey("sim_metrics_registry", CollectorRegistry)
