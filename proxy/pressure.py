"""Budget pressure: how much of its queue budget a class's requests use, lately.

``admission_budget_pressure{priority}`` is the p95, over the last 30 s, of
each queue wait divided by the queue budget the request was admitted under
(its tenant's merged ``budgets.queue_ms``, clipped by its total): 0 when
nobody waits, 1 when the budget is used up. A request refused for its
predicted wait (``predicted_wait_exceeds_budget``) or expired in the queue
without a free seat (``queue_timeout``) counts as 1: the fleet could not
serve it within the budget, and predictive refusals otherwise keep the waits
themselves below the budget exactly while the class is overloaded. Refusals
for a tenant's own limits (``tenant_queue_full``, ``tenant_concurrency``) are
not counted: they say nothing about the fleet's capacity, and one tenant
bursting must not scale it. A client that leaves while queued is not
counted either (its wait says nothing about the budget).

It is the autoscaling signal (docs/DEPLOYMENT.md) and the trigger of
``overload.max_tokens_cap`` (``degrade.py``): it rises as soon as waits
take a growing share of the budget, well before queues time out. With model
pools each sample is also kept per (class, model): a request is degraded by
its own pool's pressure, since each pool has its own queue and one congested
model must not shorten an idle one's answers. The gauge stays per class.

The window is 30 one-second slices of fixed ratio buckets (0.01 wide, and
one bucket for "used up"), with running totals, so recording is O(1) and a
query walks 101 buckets whatever the traffic; the p95 is its bucket's lower
bound (rounded down to 0.01: a class that never waits reads exactly 0). No
I/O and no clock reads but the injected one.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable

from proxy.clock import Clock

#: The window the p95 is taken over, in one-second slices.
WINDOW_S = 30
#: Ratio buckets below 1 (0.01 wide); one more holds "budget used up" (>= 1).
BUCKETS = 100
QUANTILE = 0.95


class _Window:
    """One class's samples: a slice per second and the totals over the window."""

    __slots__ = ("slices", "totals")

    def __init__(self) -> None:
        #: (second, counts per bucket), oldest first; at most ``WINDOW_S``.
        self.slices: deque[tuple[int, list[int]]] = deque()
        self.totals = [0] * (BUCKETS + 1)

    def expire(self, second: int) -> None:
        """Drop the slices that left the window ending at ``second``."""
        slices, totals = self.slices, self.totals
        while slices and slices[0][0] <= second - WINDOW_S:
            _, counts = slices.popleft()
            for i, n in enumerate(counts):
                totals[i] -= n

    def add(self, second: int, bucket: int) -> None:
        self.expire(second)
        slices = self.slices
        if not slices or slices[-1][0] != second:
            slices.append((second, [0] * (BUCKETS + 1)))
        slices[-1][1][bucket] += 1
        self.totals[bucket] += 1

    def quantile(self, q: float) -> float:
        totals = self.totals
        n = sum(totals)
        if not n:
            return 0.0
        rank = max(1, math.ceil(q * n))
        seen = 0
        for i, count in enumerate(totals):
            if seen + count >= rank:
                if i == BUCKETS:
                    return 1.0
                return i / BUCKETS
            seen += count
        return 1.0  # not reached: the counts add up to n


class BudgetPressure:
    """Per class, the p95 share of the queue budget waits used over the last 30 s.

    >>> pressure = BudgetPressure(clock)
    >>> pressure.waited("batch", waited_s=1.5, budget_s=2.0)   # a ticket got its seat
    >>> pressure.refused("batch")                               # or was refused
    >>> pressure.of("batch")                                    # 0.0 .. 1.0
    """

    __slots__ = ("_clock", "_pools", "_swept", "_windows")

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._windows: dict[str, _Window] = {}
        #: Per (class, model pool); a window left empty is dropped (models come and go).
        self._pools: dict[tuple[str, str], _Window] = {}
        self._swept = 0

    def waited(
        self, priority: str, waited_s: float, budget_s: float, model: str | None = None
    ) -> None:
        """A ticket left the queue for a seat after ``waited_s`` of its ``budget_s``."""
        ratio = waited_s / budget_s if budget_s > 0 else 1.0
        self._add(priority, min(BUCKETS, max(0, int(ratio * BUCKETS))), model)

    def refused(self, priority: str, model: str | None = None) -> None:
        """A ticket was refused at the queue or expired in it: its budget was used up."""
        self._add(priority, BUCKETS, model)

    def _add(self, priority: str, bucket: int, model: str | None) -> None:
        second = math.floor(self._clock.now())
        window = self._windows.get(priority)
        if window is None:
            window = self._windows[priority] = _Window()
        window.add(second, bucket)
        if model is None:
            return
        if second - self._swept >= WINDOW_S:
            self._sweep(second)
        key = (priority, model)
        pool = self._pools.get(key)
        if pool is None:
            pool = self._pools[key] = _Window()
        pool.add(second, bucket)

    def _sweep(self, second: int) -> None:
        """Drop the pool windows with nothing left in the window (once per window)."""
        self._swept = second
        for key, pool in list(self._pools.items()):
            pool.expire(second)
            if not pool.slices:
                del self._pools[key]

    def of(self, priority: str, model: str | None = None) -> float:
        """The class's pressure now (within ``model``'s pool when given): 0.0 with no
        sample in the window."""
        if model is None:
            window = self._windows.get(priority)
        else:
            window = self._pools.get((priority, model))
        if window is None:
            return 0.0
        window.expire(math.floor(self._clock.now()))
        return window.quantile(QUANTILE)

    def by_class(self, classes: Iterable[str]) -> dict[str, float]:
        """Every configured class's pressure (``/metrics`` reads it at scrape time)."""
        return {name: self.of(name) for name in classes}

    def __repr__(self) -> str:
        shown = ", ".join(f"{name}={self.of(name):.2f}" for name in sorted(self._windows))
        return f"<BudgetPressure {shown or 'idle'}>"
