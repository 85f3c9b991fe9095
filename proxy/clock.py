"""The ``Clock`` seam: one source of monotonic time for budgets and quotas.

Production code reads the monotonic clock; timers that enforce deadlines are
armed with relative delays. Tests of the scheduler, quotas and
budgets use ``FakeClock`` and move time by hand: no sleeps.
"""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float:
        """Monotonic seconds; only differences are meaningful."""
        ...


class MonotonicClock:
    """``time.monotonic``, with sub-millisecond resolution.

    Not ``loop.time()``: uvloop's loop clock is cached per loop iteration in
    whole milliseconds, too coarse for per-layer timings. Timers are armed
    with relative delays (``call_later``, ``asyncio.timeout``), so deadlines
    on this clock and the loop's own timers agree.
    """

    __slots__ = ()

    def now(self) -> float:
        return time.monotonic()

    def __repr__(self) -> str:
        return "MonotonicClock()"


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
