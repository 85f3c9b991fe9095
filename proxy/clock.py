"""The ``Clock`` seam: one source of monotonic time for budgets and quotas.

Production code reads the event loop's clock so that deadlines and the timers
that enforce them (``loop.call_at``) agree. Tests of the scheduler, quotas and
budgets use ``FakeClock`` and move time by hand: no sleeps.
"""

from __future__ import annotations

import asyncio
import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float:
        """Monotonic seconds; only differences are meaningful."""
        ...


class LoopClock:
    """The running loop's clock, or ``time.monotonic`` outside a loop.

    uvloop and asyncio both base ``loop.time()`` on the monotonic clock.
    """

    __slots__ = ()

    def now(self) -> float:
        try:
            return asyncio.get_running_loop().time()
        except RuntimeError:
            return time.monotonic()

    def __repr__(self) -> str:
        return "LoopClock()"


class FakeClock:
    """A clock that moves only when told to."""

    __slots__ = ("_now",)

    def __init__(self, start: float = 1000.0) -> None:
        self._now = start

    def now(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError("time does not go backwards")
        self._now += seconds

    def __repr__(self) -> str:
        return f"FakeClock(now={self._now:.3f})"
