"""The load itself: a closed loop of N workers, or open-loop arrivals on a schedule.

Owns ``run_closed_loop`` (the staircase's levels), ``run_open_loop`` (the
phases' Poisson arrivals) and ``LoopLag``, which watches whether this
process's own event loop keeps up: a generator that wakes late sends late,
and then it measures itself, not the target.

Both loops are bounded in requests and in time and end by themselves:

- the closed loop starts at most ``warmup + requests + concurrency``
  requests (or stops ``seconds`` after warm-up), and gives up after
  ``max_duration_s`` whatever happens; when its window closes, each worker
  finishes the request it has in flight (the target is never left with
  abandoned work that would skew the next level) and starts no other;
- the open loop sends exactly the arrivals it was given, then waits at most
  ``drain_timeout_s`` for the last answers and cancels the rest.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import aiohttp

from proxy.loadtest.client import send_one
from proxy.loadtest.results import RequestResult, RequestSpec, percentile
from proxy.tasks import stop

__all__ = [
    "LAG_INTERVAL_S",
    "MAX_REQUESTS_PER_LEVEL",
    "ClosedLoopRun",
    "LoopLag",
    "OpenLoopRun",
    "run_closed_loop",
    "run_open_loop",
]

#: Seconds between the event-loop lag monitor's wake-ups.
LAG_INTERVAL_S = 0.02
#: Upper bound on requests in one time-based level, so even a level that
#: fails in microseconds per request ends.
MAX_REQUESTS_PER_LEVEL = 1_000_000

OnResult = Callable[[RequestResult], None]


class LoopLag:
    """How late this process's event loop wakes up: the generator's own health.

    A task sleeps ``LAG_INTERVAL_S`` again and again and records how much
    later than asked it woke. Use as an async context manager around a load
    run; ``p99_ms(since)`` reads the samples taken after a ``mark()``.
    """

    __slots__ = ("_samples", "_task")

    def __init__(self) -> None:
        self._samples: list[float] = []
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> LoopLag:
        self._task = asyncio.create_task(self._watch(), name="loadtest-loop-lag")
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        task, self._task = self._task, None
        if task is not None:
            await stop(task)

    async def _watch(self) -> None:
        while True:
            before = time.perf_counter()
            await asyncio.sleep(LAG_INTERVAL_S)
            self._samples.append(max(0.0, time.perf_counter() - before - LAG_INTERVAL_S))

    def mark(self) -> int:
        return len(self._samples)

    def p99_ms(self, since: int = 0) -> float | None:
        value = percentile(self._samples[since:], 99)
        return None if value is None else value * 1000.0

    def __repr__(self) -> str:
        return f"<LoopLag {len(self._samples)} samples, p99 {self.p99_ms()} ms>"


@dataclass(slots=True)
class ClosedLoopRun:
    """A closed-loop level: every result (completion order) and the measured slice."""

    results: list[RequestResult]
    measured: list[RequestResult]
    window: tuple[float, float]
    truncated: bool


async def run_closed_loop(
    session: aiohttp.ClientSession,
    base_url: str,
    make_spec: Callable[[int], RequestSpec],
    *,
    concurrency: int,
    warmup: int,
    requests: int | None = None,
    seconds: float | None = None,
    max_duration_s: float,
    zero: float,
    on_result: OnResult | None = None,
) -> ClosedLoopRun:
    """``concurrency`` workers, each sending its next request when the last one ends.

    The first ``warmup`` completions are discarded; the window opens at the
    last of them and closes at completion ``warmup + requests`` (or
    ``seconds`` after it opened). ``truncated`` is set when
    ``max_duration_s`` ran out first.
    """
    if (requests is None) == (seconds is None):
        raise ValueError("give exactly one of requests or seconds")
    loop = asyncio.get_running_loop()
    began = time.perf_counter() - zero
    cap = warmup + requests + concurrency if requests is not None else MAX_REQUESTS_PER_LEVEL
    results: list[RequestResult] = []
    stop = asyncio.Event()
    started = 0
    window_start: float | None = began if warmup == 0 else None
    window_end: float | None = None
    timer: asyncio.TimerHandle | None = None

    def close_window() -> None:
        nonlocal window_end
        if window_end is None:
            window_end = time.perf_counter() - zero
        stop.set()

    def open_window(at: float) -> None:
        nonlocal window_start, timer
        window_start = at
        if seconds is not None:
            timer = loop.call_later(
                max(0.0, seconds - (time.perf_counter() - zero - at)), close_window
            )

    if window_start is not None:
        open_window(window_start)

    async def worker() -> None:
        nonlocal started
        while not stop.is_set() and started < cap:
            index = started
            started += 1
            result = await send_one(session, base_url, make_spec(index), index=index, zero=zero)
            results.append(result)
            if on_result is not None:
                on_result(result)
            done = len(results)
            if window_start is None and done >= warmup:
                open_window(result.ended_at)
            if requests is not None and done == warmup + requests:
                close_window()

    truncated = False
    workers = [asyncio.create_task(worker()) for _ in range(concurrency)]
    try:
        async with asyncio.timeout(max_duration_s):
            await asyncio.gather(*workers)
    except TimeoutError:
        truncated = True
    finally:
        if timer is not None:
            timer.cancel()
        for task in workers:
            task.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
    end_of_run = time.perf_counter() - zero
    start = window_start if window_start is not None else began
    end = window_end if window_end is not None else end_of_run
    if requests is not None:
        measured = results[warmup : warmup + requests]
    else:
        measured = [r for r in results if start < r.ended_at <= end]
    return ClosedLoopRun(results, measured, (start, end), truncated or window_end is None)


@dataclass(slots=True)
class OpenLoopRun:
    """Every arrival's result, in the order they ended."""

    results: list[RequestResult] = field(default_factory=list)
    overloaded: int = 0
    unfinished: int = 0


async def run_open_loop(
    session: aiohttp.ClientSession,
    base_url: str,
    due_at: Sequence[float],
    make_spec: Callable[[int], RequestSpec],
    *,
    zero: float,
    max_in_flight: int,
    drain_timeout_s: float,
    on_result: OnResult | None = None,
) -> OpenLoopRun:
    """Send request ``i`` at ``due_at[i]`` (seconds after ``zero``), whatever came before.

    Arrivals never wait for answers (that would turn the open loop into a
    closed one and hide the overload). The one exception is the generator's
    own safety cap: past ``max_in_flight`` unanswered requests an arrival is
    recorded as ``generator_overloaded`` instead of sent, and counted.
    Request bodies are built at send time, so a long schedule costs memory
    for its times only.
    """
    run = OpenLoopRun()
    pending: dict[asyncio.Task[None], int] = {}

    async def deliver(index: int, spec: RequestSpec) -> None:
        result = await send_one(
            session, base_url, spec, index=index, zero=zero, due_at=due_at[index]
        )
        run.results.append(result)
        if on_result is not None:
            on_result(result)

    try:
        for index, due in enumerate(due_at):
            delay = zero + due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if len(pending) >= max_in_flight:
                run.overloaded += 1
                run.results.append(
                    _unsent(index, make_spec(index), zero, "generator_overloaded", due_at[index])
                )
                continue
            task = asyncio.create_task(deliver(index, make_spec(index)))
            pending[task] = index
            task.add_done_callback(lambda done: pending.pop(done, None))
        if pending:
            await asyncio.wait(list(pending), timeout=drain_timeout_s)
    finally:
        left = dict(pending)
        for task in left:
            task.cancel()
        await asyncio.gather(*left, return_exceptions=True)
        for index in left.values():
            run.unfinished += 1
            result = _unsent(index, make_spec(index), zero, "unfinished_at_end", due_at[index])
            result.started_at = due_at[index]
            run.results.append(result)
    return run


def _unsent(index: int, spec: RequestSpec, zero: float, error: str, due_at: float) -> RequestResult:
    """A result for an arrival that got no answer (never sent, or cut off at the end)."""
    now = time.perf_counter() - zero
    return RequestResult(
        index=index,
        started_at=now,
        ended_at=now,
        error=error,
        input_tokens=spec.input_tokens,
        tenant=spec.tenant,
        request_class=spec.request_class,
        phase=spec.phase,
        due_at=due_at,
    )
