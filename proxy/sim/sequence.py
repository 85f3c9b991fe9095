"""One sequence inside the simulated engine, and the channel its tokens take.

Owns the sequence's state machine (waiting → running → finished, or aborted
from either) and the hand-off of token ids to its single consumer: the engine
appends ids and wakes one future; the consumer takes everything pending at
once. No I/O, no scheduling decisions: those belong to `SimEngine`.

Token ids come from an arithmetic walk over a small vocabulary, with an
offset and a stride drawn at submit time, so text depends only on the seed
and the order of submits, never on how steps interleave, and costs nothing.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Callable

__all__ = ["VOCABULARY", "Sequence", "SequenceAborted", "SequenceState"]

_WORDS = (
    "the of and to in is that for it as with was on be by at this from or an are not "
    "have but had they which one you were all we can her has there been if more when "
    "will would who so no model token batch queue cache tensor kernel stream latency "
    "replica shard prefill decode warp block sample"
)
VOCABULARY: tuple[str, ...] = tuple(" " + word for word in _WORDS.split())
"""Token texts, each with its leading space. 61 entries: a prime, so every
stride in 1..60 walks the whole vocabulary before repeating."""


class SequenceAborted(Exception):
    """Raised to a sequence's consumer once the sequence was aborted."""


class SequenceState(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"


class Sequence:
    """One request inside the engine, and the channel its tokens arrive on.

    Exactly one consumer awaits it. Times are from the engine's clock; the
    `*_s` properties are only meaningful once the matching state is reached.
    """

    __slots__ = (
        "_offset",
        "_pending",
        "_stride",
        "_waiter",
        "admitted_at",
        "client_gone",
        "enqueued_at",
        "finished_at",
        "generated",
        "max_tokens",
        "prompt_tokens",
        "seq_id",
        "state",
    )

    def __init__(
        self,
        seq_id: int,
        prompt_tokens: int,
        max_tokens: int,
        *,
        enqueued_at: float,
        token_offset: int,
        stride: int,
        client_gone: Callable[[], bool] | None,
    ) -> None:
        self.seq_id = seq_id
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.client_gone = client_gone
        self.state = SequenceState.WAITING
        self.generated = 0
        self.enqueued_at = enqueued_at
        self.admitted_at = enqueued_at
        self.finished_at = enqueued_at
        self._offset = token_offset
        self._stride = stride
        self._pending: list[int] = []
        self._waiter: asyncio.Future[None] | None = None

    @property
    def kv_tokens(self) -> int:
        """KV cache reserved while running: the prompt plus every token it may generate."""
        return self.prompt_tokens + self.max_tokens

    @property
    def queue_s(self) -> float:
        return self.admitted_at - self.enqueued_at

    @property
    def inference_s(self) -> float:
        return self.finished_at - self.admitted_at

    @property
    def done(self) -> bool:
        return self.state in (SequenceState.FINISHED, SequenceState.ABORTED)

    async def admitted(self) -> float:
        """Wait until the sequence is in the running batch; return its queue time (s)."""
        while self.state is SequenceState.WAITING:
            await self._wait()
        if self.state is SequenceState.ABORTED:
            raise SequenceAborted(self.seq_id)
        return self.queue_s

    async def next_tokens(self) -> list[int]:
        """Token ids produced since the last call; `[]` once the sequence finished.

        Several ids come back at once only when the consumer fell behind the
        engine; the engine never waits for a slow consumer.
        """
        while not self._pending and not self.done:
            await self._wait()
        if self.state is SequenceState.ABORTED:
            raise SequenceAborted(self.seq_id)
        tokens, self._pending = self._pending, []
        return tokens

    def emit_token(self) -> None:
        """Engine side: append the next token id and wake the consumer."""
        self._pending.append((self._offset + self.generated * self._stride) % len(VOCABULARY))
        self.generated += 1
        self.notify()

    async def _wait(self) -> None:
        waiter = asyncio.get_running_loop().create_future()
        self._waiter = waiter
        try:
            await waiter
        finally:
            self._waiter = None

    def notify(self) -> None:
        """Engine side: wake the consumer after a state change or new tokens."""
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def __repr__(self) -> str:
        return (
            f"<Sequence {self.seq_id} {self.state.value} "
            f"{self.generated}/{self.max_tokens} tokens, prompt {self.prompt_tokens}>"
        )
