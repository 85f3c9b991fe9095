"""Running the event loop, and stopping the background tasks a component owns.

Every long-lived loop (health probes, the GPU sampler, the config watcher,
log flushing, load-test samplers) is a task its owner starts and, on the way
out, cancels and awaits, so its ``finally`` blocks have run before the owner
closes what the loop used.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine
from typing import Any

#: How long ``stop`` waits for a cancelled task before cancelling it again.
RECANCEL_S = 1.0


async def stop(task: asyncio.Task[Any] | None) -> None:
    """Cancel ``task`` and wait until it has ended; None is a no-op.

    A library may turn a cancellation into an error of its own (a Redis
    client cancelled while it connects), and a loop that retries on that
    error would then outlive one ``cancel()``: a worker told to stop right
    after it started hung in its shutdown that way. A task still running
    ``RECANCEL_S`` after a cancel is cancelled again, until it ends.
    """
    if task is None:
        return
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=RECANCEL_S)
    with contextlib.suppress(asyncio.CancelledError):
        await task


def run_async(main: Coroutine[Any, Any, int]) -> int:
    """Run on uvloop when it is installed (it is a dependency on Linux)."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - only on platforms without uvloop
        return asyncio.run(main)
    result: int = uvloop.run(main)
    return result
