"""Stopping background tasks: ``proxy.tasks.stop``."""

from __future__ import annotations

import asyncio

import pytest

from proxy.tasks import stop


class Swallowed(Exception):
    """What a library may turn a cancellation into."""


async def test_stop_ends_a_loop_that_swallowed_its_first_cancellation() -> None:
    """A retry loop whose library turned the first cancellation into its own error (as a
    Redis client cancelled while it connects can) is cancelled again and ends; one
    cancel() alone left it running for ever."""
    swallowed = 0
    started = asyncio.Event()

    async def retrying() -> None:
        nonlocal swallowed
        while True:
            try:
                try:
                    started.set()
                    await asyncio.sleep(3600)
                except asyncio.CancelledError:
                    if swallowed:
                        raise
                    swallowed += 1
                    raise Swallowed from None
            except Swallowed:
                pass  # the loop retries on its library's error
            await asyncio.sleep(0.01)

    task = asyncio.create_task(retrying())
    await started.wait()
    stopper = asyncio.create_task(stop(task))
    done, _ = await asyncio.wait({stopper}, timeout=10)  # waits; cancels nothing
    if not done:  # before the fix: one cancel() only, the loop goes on
        stopper.cancel()
        await asyncio.wait({stopper})
    assert stopper in done, "stop() did not end a loop that swallowed a cancellation"
    assert task.cancelled() and swallowed == 1


async def test_stop_leaves_a_prompt_task_alone_and_reraises_its_error() -> None:
    """A task that ends at its first cancellation is cancelled once; one that had
    already failed has its error raised, as awaiting it would."""

    async def failing() -> None:
        raise ValueError("boom")

    task = asyncio.create_task(failing())
    await asyncio.wait({task})
    with pytest.raises(ValueError, match="boom"):
        await stop(task)
    await stop(None)
