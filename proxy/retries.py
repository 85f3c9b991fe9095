"""Which failures are retried, how long to wait, and whether the fleet can afford it.

``RetryPolicy`` classifies a failed attempt into one of the ``retry_on``
classes (docs/REFERENCE.md) and decides, with the request's deadline, whether
another attempt is allowed and after what backoff. ``RetryBudget`` is the
fleet-wide guard that keeps retries from amplifying an overload: retries may
be at most ``budget_ratio`` of the requests dispatched in the recent window,
plus ``min_retries_per_s`` (Finagle's and Envoy's rule).

Never retried, whatever the config says: anything after the first byte went
to the client (the relay never reports those here), client cancellation, 4xx
other than 429, and on routes that are not inference routes anything but a
connection failure, since a repeat may have side effects.

No I/O and no sleeping here; the clock and the random source are injected (an
upstream ``Retry-After`` given as an HTTP date is read against the wall clock,
injectable too).
"""

from __future__ import annotations

import email.utils
import math
import random
import time
from dataclasses import dataclass

from proxy.clock import Clock
from proxy.settings import RetryConfig

#: Retry classes that are safe on any route: the request never reached the replica.
CONNECTION_CLASSES = frozenset({"connect_error", "connect_timeout"})
#: Upstream statuses that have a retry class.
STATUS_CLASSES = {429: "http_429", 500: "http_500", 502: "http_502", 503: "http_503",
                  504: "http_504"}  # fmt: skip
#: Seconds of history the retry budget counts over (Finagle deposits expire after 10 s).
BUDGET_WINDOW_S = 10


def status_class(status: int) -> str | None:
    return STATUS_CLASSES.get(status)


def parse_retry_after(value: str | None, wall_now: float | None = None) -> float | None:
    """An upstream ``Retry-After`` in seconds from now, or None when absent or unreadable.

    Both of RFC 9110's forms: delay seconds, and an HTTP-date (what a gateway in
    front of an engine may send), counted from ``wall_now`` (Unix seconds; the
    system clock by default). A date already past means no wait.
    """
    if value is None:
        return None
    text = value.strip()
    try:
        seconds = float(text)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(text)
        except (TypeError, ValueError, IndexError):
            return None
        if when.tzinfo is None:
            return None  # RFC 9110 dates are GMT; a date without a zone is not one
        now = time.time() if wall_now is None else wall_now
        return max(0.0, when.timestamp() - now)
    return seconds if seconds >= 0 and math.isfinite(seconds) else None


@dataclass(frozen=True, slots=True)
class RetryDecision:
    retry: bool
    delay_s: float = 0.0
    #: Why not, for the log and the tests: "class", "attempts", "deadline".
    refused_by: str | None = None


class RetryPolicy:
    __slots__ = ("_config", "_on", "_rng")

    def __init__(self, config: RetryConfig, rng: random.Random | None = None) -> None:
        self._config = config
        self._on = frozenset(config.retry_on)
        self._rng = rng or random.Random()

    def backoff(self, n: int) -> float:
        """Seconds to wait before retry ``n`` (0 for the first retry)."""
        c = self._config
        ceiling = min(c.max_backoff_ms, c.base_backoff_ms * (1 << n)) / 1000.0
        if c.jitter == "full":
            return self._rng.uniform(0.0, ceiling)
        if c.jitter == "equal":
            return ceiling / 2.0 + self._rng.uniform(0.0, ceiling / 2.0)
        return ceiling

    def decide(
        self,
        retry_class: str | None,
        *,
        attempts: int,
        inference_route: bool,
        remaining_s: float,
        upstream_retry_after_s: float | None = None,
    ) -> RetryDecision:
        """May a request that made ``attempts`` attempts try again, and when?

        An upstream ``Retry-After`` is honoured only when it fits the deadline;
        otherwise the upstream answer is passed through at once.
        """
        if retry_class is None or retry_class not in self._on:
            return RetryDecision(False, refused_by="class")
        if not inference_route and retry_class not in CONNECTION_CLASSES:
            return RetryDecision(False, refused_by="class")
        if attempts >= self._config.max_attempts:
            return RetryDecision(False, refused_by="attempts")
        delay = self.backoff(attempts - 1)
        if upstream_retry_after_s is not None:
            delay = max(delay, upstream_retry_after_s)
        if delay >= remaining_s:
            return RetryDecision(False, refused_by="deadline")
        return RetryDecision(True, delay_s=delay)


class RetryBudget:
    """Retries allowed: ``ratio`` x requests in the window + ``min_per_s`` x window.

    Counts live in one-second buckets of a ring, so recording and checking are
    O(1) and old history falls out by itself.
    """

    __slots__ = ("_clock", "_requests", "_retries", "_stamps", "min_per_s", "ratio")

    def __init__(self, ratio: float, min_per_s: float, clock: Clock) -> None:
        self.ratio = ratio
        self.min_per_s = min_per_s
        self._clock = clock
        self._requests = [0] * BUDGET_WINDOW_S
        self._retries = [0] * BUDGET_WINDOW_S
        self._stamps = [-1] * BUDGET_WINDOW_S

    def _bucket(self, now: float) -> int:
        second = int(now)
        i = second % BUDGET_WINDOW_S
        if self._stamps[i] != second:
            self._stamps[i], self._requests[i], self._retries[i] = second, 0, 0
        return i

    def _totals(self, now: float) -> tuple[int, int]:
        oldest = int(now) - BUDGET_WINDOW_S
        requests = retries = 0
        for i in range(BUDGET_WINDOW_S):
            if self._stamps[i] > oldest:
                requests += self._requests[i]
                retries += self._retries[i]
        return requests, retries

    def record_request(self) -> None:
        """A request was dispatched (its first attempt)."""
        self._requests[self._bucket(self._clock.now())] += 1

    def allowance(self) -> float:
        requests, _ = self._totals(self._clock.now())
        return self.ratio * requests + self.min_per_s * BUDGET_WINDOW_S

    def counts(self) -> tuple[int, int]:
        """Requests and retries in the window now (a worker group's ``/admin/state`` adds
        each worker's up: their allowances would count the floor once per worker)."""
        return self._totals(self._clock.now())

    def try_spend(self, min_per_s: float | None = None) -> bool:
        """Take one retry from the budget if it has one; ``min_per_s`` replaces the floor
        (this process's share of the fleet's while shared state is down)."""
        now = self._clock.now()
        requests, retries = self._totals(now)
        floor = self.min_per_s if min_per_s is None else min_per_s
        if retries + 1 > self.ratio * requests + floor * BUDGET_WINDOW_S:
            return False
        self._retries[self._bucket(now)] += 1
        return True

    def refill_in(self) -> float:
        """Seconds until the oldest counted retry leaves the window: its second's
        bucket stops counting once that second is ``BUDGET_WINDOW_S`` old."""
        now = self._clock.now()
        oldest = int(now) - BUDGET_WINDOW_S
        stamps = [s for i, s in enumerate(self._stamps) if s > oldest and self._retries[i]]
        if not stamps:
            return 1.0
        return max(0.001, min(stamps) + BUDGET_WINDOW_S - now)

    def __repr__(self) -> str:
        requests, retries = self._totals(self._clock.now())
        return f"<RetryBudget {retries} retries / {requests} requests in {BUDGET_WINDOW_S} s>"
