"""The progress display while a load test runs.

Owns ``Progress``: a status line refreshed about once a second (rewritten in
place on a terminal, printed as plain lines into a log) plus permanent lines
for finished steps. It reads a status callback; the load loops never format
text or wait on output.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TextIO

from proxy.tasks import stop

__all__ = ["Progress"]

#: Seconds between status lines when the output is not a terminal (logs stay short).
LOG_INTERVAL_S = 5.0
TTY_INTERVAL_S = 0.5


class Progress:
    """Status line plus finished-step lines; ``Progress(None)`` shows nothing."""

    __slots__ = ("_interval_s", "_out", "_status", "_task", "_tty", "_width")

    def __init__(self, out: TextIO | None, interval_s: float | None = None) -> None:
        self._out = out
        self._tty = bool(out is not None and hasattr(out, "isatty") and out.isatty())
        default = TTY_INTERVAL_S if self._tty else LOG_INTERVAL_S
        self._interval_s = default if interval_s is None else interval_s
        self._status: Callable[[], str] | None = None
        self._task: asyncio.Task[None] | None = None
        self._width = 0

    def status(self, render: Callable[[], str] | None) -> None:
        """Show ``render()`` as the live status (None: no status line)."""
        self._status = render

    def line(self, text: str) -> None:
        """A permanent line (a level or phase finished)."""
        if self._out is None:
            return
        self._clear()
        print(text, file=self._out, flush=True)

    async def __aenter__(self) -> Progress:
        if self._out is not None:
            self._task = asyncio.create_task(self._tick(), name="loadtest-progress")
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        task, self._task = self._task, None
        await stop(task)
        self._clear()

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            render = self._status
            if render is not None and self._out is not None:
                self._show(render())

    def _show(self, text: str) -> None:
        assert self._out is not None
        if self._tty:
            padding = " " * max(0, self._width - len(text))
            self._out.write("\r" + text + padding)
            self._out.flush()
            self._width = len(text)
        else:
            print(text, file=self._out, flush=True)

    def _clear(self) -> None:
        if self._tty and self._width and self._out is not None:
            self._out.write("\r" + " " * self._width + "\r")
            self._out.flush()
            self._width = 0
