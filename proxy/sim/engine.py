"""A continuous-batching engine model: the "GPU" of the simulated replica.

Owns the waiting queue, the running batch, the KV-cache budget and the one
background step loop. It never touches HTTP: handlers `submit` a sequence,
await `Sequence.admitted()` and `Sequence.next_tokens()`, and `abort` it when
their client goes away.

The model, per step:

1. drop sequences whose client is gone (their `client_gone` probe says so);
2. admit waiting sequences FIFO while a slot is free and the sequence's KV
   reservation (prompt + max tokens) fits; the head of the queue blocks the
   ones behind it, as in an FCFS engine;
3. sleep once for the whole batch: `decode_base_ms + decode_per_seq_ms * batch`
   plus `prefill_ms_per_token` for each prompt token admitted in this step;
4. give every running sequence one token; a sequence that reached its
   `max_tokens` finishes and frees its slot and KV.

Throughput is `batch / step_ms(batch)`: it rises with the batch and flattens
towards `1 / decode_per_seq_ms`, while each token takes longer: the knee a
staircase load test finds. When nothing is running or waiting the loop parks
on an event; it never spins.

Per-token cost is a list append and a future wake-up per sequence (see
`proxy.sim.sequence`), so one core keeps hundreds of streams going.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from proxy.sim.config import SimConfig
from proxy.sim.sequence import VOCABULARY, Sequence, SequenceState

__all__ = [
    "EngineClosed",
    "EngineError",
    "EngineFull",
    "EngineStats",
    "PromptTooLong",
    "SimEngine",
]

Sleep = Callable[[float], Awaitable[None]]
Clock = Callable[[], float]


class EngineError(Exception):
    """Base of the engine's refusals."""


class EngineFull(EngineError):
    """The waiting queue is at `max_waiting`: refuse at once (HTTP 503)."""


class EngineClosed(EngineError):
    """The engine is shut down (HTTP 503)."""


class PromptTooLong(EngineError):
    """The sequence needs more KV cache than the whole engine has (HTTP 400)."""


@dataclass(frozen=True, slots=True)
class EngineStats:
    """A snapshot of the engine's gauges and counters (for `/sim/stats`, `/metrics`)."""

    running: int
    waiting: int
    kv_cache_usage: float
    submitted: int
    rejected: int
    completed: int
    aborted: int
    tokens_generated: int
    prompt_tokens: int
    peak_running: int
    peak_waiting: int
    steps: int
    modelled_busy_s: float


class SimEngine:
    """Continuous-batching scheduler with `slots` sequences and a KV budget.

    Usage::

        engine = SimEngine(SimConfig(slots=4))
        await engine.start()
        seq = engine.submit(prompt_tokens=20, max_tokens=8)
        try:
            queue_s = await seq.admitted()
            while tokens := await seq.next_tokens():
                ...
        finally:
            engine.abort(seq)  # no-op once finished
        await engine.close()

    `sleep` and `clock` are injectable so tests can step the engine by hand.
    """

    def __init__(
        self,
        config: SimConfig,
        *,
        sleep: Sleep = asyncio.sleep,
        clock: Clock = time.monotonic,
    ) -> None:
        self._config = config
        self._sleep = sleep
        self._clock = clock
        self._rng = random.Random(config.seed)
        self._waiting: deque[Sequence] = deque()
        self._running: dict[int, Sequence] = {}
        self._kv_used = 0
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self._next_id = 0
        self._submitted = 0
        self._rejected = 0
        self._completed = 0
        self._aborted = 0
        self._tokens_generated = 0
        self._prompt_tokens = 0
        self._peak_running = 0
        self._peak_waiting = 0
        self._steps = 0
        self._modelled_busy_s = 0.0

    @property
    def config(self) -> SimConfig:
        return self._config

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def kv_cache_usage(self) -> float:
        """Reserved KV cache as a fraction of capacity, 0..1."""
        return self._kv_used / self._config.kv_cache_tokens

    def step_ms(self, batch_size: int, prefill_tokens: int = 0) -> float:
        """Modelled duration of one step: decode for the batch plus new prompts' prefill."""
        config = self._config
        return (
            config.decode_base_ms
            + config.decode_per_seq_ms * batch_size
            + config.prefill_ms_per_token * prefill_tokens
        )

    async def start(self) -> None:
        if self._task is None and not self._closed:
            self._task = asyncio.create_task(self._run(), name="sim-engine-steps")

    async def close(self) -> None:
        """Stop the step loop and abort everything, waking every consumer."""
        self._closed = True
        self.abort_all()
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def submit(
        self,
        prompt_tokens: int,
        max_tokens: int,
        *,
        client_gone: Callable[[], bool] | None = None,
    ) -> Sequence:
        """Queue a sequence, or raise `EngineFull`, `EngineClosed` or `PromptTooLong`.

        `client_gone` is polled at every step boundary; when it returns True
        the sequence is aborted, which is how a disconnect that nobody awaits
        (a non-streaming request) still frees its slot within one step.
        """
        if prompt_tokens < 1 or max_tokens < 1:
            raise ValueError("prompt_tokens and max_tokens must be >= 1")
        if self._closed:
            raise EngineClosed("engine is shut down")
        if prompt_tokens + max_tokens > self._config.kv_cache_tokens:
            raise PromptTooLong(
                f"prompt ({prompt_tokens}) + max_tokens ({max_tokens}) exceeds the "
                f"KV cache ({self._config.kv_cache_tokens} tokens)"
            )
        max_waiting = self._config.max_waiting
        # Sequences that a free slot will take at the next step boundary do not
        # count as waiting (the KV budget is ignored here, for an O(1) check).
        free_slots = self._config.slots - len(self._running)
        if max_waiting is not None and len(self._waiting) - free_slots >= max_waiting:
            self._rejected += 1
            raise EngineFull(f"waiting queue is full ({max_waiting} requests)")
        self._next_id += 1
        size = len(VOCABULARY)
        seq = Sequence(
            self._next_id,
            prompt_tokens,
            max_tokens,
            enqueued_at=self._clock(),
            token_offset=self._rng.randrange(size),
            stride=self._rng.randrange(1, size),
            client_gone=client_gone,
        )
        self._submitted += 1
        self._waiting.append(seq)
        self._peak_waiting = max(self._peak_waiting, len(self._waiting))
        self._wakeup.set()
        return seq

    def abort(self, seq: Sequence) -> None:
        """Remove `seq` from the queue or the batch at once; no-op once it is done."""
        if seq.state is SequenceState.WAITING:
            self._waiting.remove(seq)
        elif seq.state is SequenceState.RUNNING:
            del self._running[seq.seq_id]
            self._kv_used -= seq.kv_tokens
        else:
            return
        seq.state = SequenceState.ABORTED
        seq.finished_at = self._clock()
        self._aborted += 1
        seq.notify()

    def abort_all(self) -> None:
        for seq in [*self._waiting, *self._running.values()]:
            self.abort(seq)

    def stats(self) -> EngineStats:
        return EngineStats(
            running=len(self._running),
            waiting=len(self._waiting),
            kv_cache_usage=self.kv_cache_usage,
            submitted=self._submitted,
            rejected=self._rejected,
            completed=self._completed,
            aborted=self._aborted,
            tokens_generated=self._tokens_generated,
            prompt_tokens=self._prompt_tokens,
            peak_running=self._peak_running,
            peak_waiting=self._peak_waiting,
            steps=self._steps,
            modelled_busy_s=self._modelled_busy_s,
        )

    async def _run(self) -> None:
        while True:
            self._drop_gone()
            prefill_tokens = self._admit()
            if not self._running:
                # Idle (or everything just left): park until the next submit.
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            step_ms = self.step_ms(len(self._running), prefill_tokens)
            await self._sleep(step_ms / 1000.0)
            self._steps += 1
            self._modelled_busy_s += step_ms / 1000.0
            self._decode()

    def _drop_gone(self) -> None:
        gone = [
            seq
            for seq in [*self._waiting, *self._running.values()]
            if seq.client_gone is not None and seq.client_gone()
        ]
        for seq in gone:
            self.abort(seq)

    def _admit(self) -> int:
        """Move waiting sequences into the batch; return the prompt tokens to prefill."""
        slots = self._config.slots
        capacity = self._config.kv_cache_tokens
        prefill_tokens = 0
        now = self._clock()
        while self._waiting and len(self._running) < slots:
            seq = self._waiting[0]
            if self._kv_used + seq.kv_tokens > capacity:
                break
            self._waiting.popleft()
            self._running[seq.seq_id] = seq
            self._kv_used += seq.kv_tokens
            self._prompt_tokens += seq.prompt_tokens
            prefill_tokens += seq.prompt_tokens
            seq.state = SequenceState.RUNNING
            seq.admitted_at = now
            seq.notify()
        self._peak_running = max(self._peak_running, len(self._running))
        return prefill_tokens

    def _decode(self) -> None:
        now = self._clock()
        finished: list[Sequence] = []
        for seq in self._running.values():
            seq.emit_token()
            if seq.generated >= seq.max_tokens:
                finished.append(seq)
        self._tokens_generated += len(self._running)
        for seq in finished:
            del self._running[seq.seq_id]
            self._kv_used -= seq.kv_tokens
            seq.state = SequenceState.FINISHED
            seq.finished_at = now
            self._completed += 1
            seq.notify()

    def __repr__(self) -> str:
        return (
            f"<SimEngine {len(self._running)} running, {len(self._waiting)} waiting, "
            f"kv {self.kv_cache_usage:.0%}, {self._completed} completed, {self._aborted} aborted>"
        )
