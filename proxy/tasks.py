"""Running the event loop, and stopping the background tasks a component owns.

Every long-lived loop (health probes, the GPU sampler, the config watcher,
log flushing, load-test samplers) is a task its owner starts and, on the way
out, cancels and awaits, so its ``finally`` blocks have run before the owner
closes what the loop used.

A cancellation can be lost on the way: on Python 3.11 ``asyncio.wait_for``
returns its result when the cancel lands just as the awaited step finishes
(CPython gh-86296, fixed in 3.12), and redis-py sends every command through
it. The task then runs on with the request still counted in ``cancelling()``.
``keep_cancellation`` turns that leftover request back into ``CancelledError``
where a library call returns, so a loop ends at its first ``cancel()``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine, Iterator
from typing import Any

#: How long ``stop`` waits for a cancelled task before cancelling it again.
RECANCEL_S = 1.0


async def stop(task: asyncio.Task[Any] | None) -> None:
    """Cancel ``task`` and wait until it has ended; None is a no-op.

    A loop whose library lost the cancellation (see above) would outlive one
    ``cancel()``: a worker told to stop right after it started hung in its
    shutdown that way, until the Redis loops kept it (``keep_cancellation``).
    In case another one does, a task still running ``RECANCEL_S`` after a
    cancel is cancelled again, until it ends.
    """
    if task is None:
        return
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=RECANCEL_S)
    with contextlib.suppress(asyncio.CancelledError):
        await task


@contextlib.contextmanager
def keep_cancellation() -> Iterator[None]:
    """Raise ``CancelledError`` after the block if the task was cancelled during it
    and the block returned or failed with an error of its own instead.

    For library calls in a retrying loop: the lost cancel (see above) or one a
    library turned into its own error would otherwise be retried over. A cancel
    the block consumed itself (an ``asyncio.timeout`` that expired inside it) is
    no longer counted by ``cancelling()`` and is left alone.
    """
    task = asyncio.current_task()
    before = 0 if task is None else task.cancelling()
    try:
        yield
    except Exception as exc:
        if task is not None and task.cancelling() > before:
            raise asyncio.CancelledError from exc
        raise
    if task is not None and task.cancelling() > before:
        raise asyncio.CancelledError


def run_async(main: Coroutine[Any, Any, int]) -> int:
    """Run on uvloop when it is installed (it is a dependency on Linux)."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - only on platforms without uvloop
        return asyncio.run(main)
    result: int = uvloop.run(main)
    return result
