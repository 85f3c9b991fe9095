"""Stopping background tasks: ``proxy.tasks.stop`` and ``keep_cancellation``."""

from __future__ import annotations

import asyncio
import sys

import pytest

from proxy.tasks import keep_cancellation, stop


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


async def _cancelled_during(block_body: str) -> asyncio.Task[str]:
    """A task running one ``keep_cancellation`` block, cancelled while inside it."""
    inside = asyncio.Event()

    async def body() -> str:
        with keep_cancellation():
            inside.set()
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                if block_body == "returns":
                    return "lost"  # a library that drops the cancellation
                raise Swallowed from None  # ...or turns it into its own error
        return "went on"

    task = asyncio.create_task(body())
    await inside.wait()
    task.cancel()
    await asyncio.wait({task})
    return task


@pytest.mark.parametrize("block_body", ["returns", "raises its own error"])
async def test_keep_cancellation_raises_a_cancel_the_block_lost(block_body: str) -> None:
    """Cancelled inside the block, which returned or raised its own error instead:
    CancelledError comes out of the block, so the task ends cancelled."""
    task = await _cancelled_during(block_body)
    assert task.cancelled()


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="wait_for keeps the cancel from 3.12")
async def test_keep_cancellation_raises_the_cancel_wait_for_lost() -> None:
    """Python 3.11's wait_for returns the result of a step that finished as the cancel
    landed (what redis-py's sends do); the block raises the cancel it lost."""
    finished = asyncio.create_task(asyncio.sleep(0))
    await finished
    outcome = []

    async def body() -> None:
        with keep_cancellation():
            asyncio.current_task().cancel()  # type: ignore[union-attr]
            await asyncio.wait_for(finished, timeout=10)
            outcome.append("wait_for returned")

    task = asyncio.create_task(body())
    await asyncio.wait({task})
    assert outcome == ["wait_for returned"] and task.cancelled()


async def test_keep_cancellation_leaves_what_the_block_handled_alone() -> None:
    """No cancel: the result passes; an asyncio.timeout that expired inside the block
    consumed its own cancel: TimeoutError passes, as does any other error."""
    with keep_cancellation():
        result = await asyncio.sleep(0, result="done")
    assert result == "done"
    with pytest.raises(TimeoutError), keep_cancellation():
        async with asyncio.timeout(0):
            await asyncio.sleep(3600)
    with pytest.raises(ValueError, match="bad"), keep_cancellation():
        raise ValueError("bad")
    assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]
