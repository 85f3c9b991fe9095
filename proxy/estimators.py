"""What admission predicts from: seat time, recent dispatches and usage, output tokens.

Five small estimators, each fed by the request path and read by it (the
predictions made from them are in ``waits.py``):

- ``SeatTime``: how long a request holds its replica seat. The serving seats
  divided by it is the number of dispatches per second the fleet sustains, the
  capacity every wait estimate and ``Retry-After`` starts from.
- ``RecentDispatches``: dispatches per second per tenant and in all,
  exponentially decayed, so a flow's estimate can leave room for the others
  that come back while it waits.
- ``OutputTokens``: each tenant's moving average of output tokens, the cost of
  a request that names no output limit.
- ``RecentUsage``: each tenant's decayed share of the dispatched work, which
  decides who may take a headroom seat (below).
- ``BackloggedTurnover``: how fast a flow's queue actually drains, measured
  only while that queue has never been empty (below).

Why samples and not rates: a seat time measured during a quiet period is as
valid as one measured under load, whereas a rate measured over a quiet period
says how little was asked, not how much can be served (a burst after a pause
was refused for a rate of a few requests a minute). Rates here are recent
(seconds), and say what *others* take, or, for ``BackloggedTurnover``, what a
flow's own queue drains at while it has had a queue the whole time.

No I/O and no clock reads here: callers pass ``now``.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Container

#: Seat times kept: the mean is over the last this many requests.
SEAT_TIME_WINDOW = 64
#: A seat time counts at most this many times the window's median: a few
#: stragglers (a stuck or timed-out request) do not stand for the fleet.
STRAGGLER_FACTOR = 4.0
#: Time constant of the recent dispatch rates: a few seconds of seat turnover.
RECENT_TAU_S = 2.0
#: A tenant whose decayed dispatch count is at least this is recently active.
ACTIVE_COUNT = 0.5
#: Output tokens assumed for a request with no limit, before its tenant has history.
DEFAULT_OUTPUT_TOKENS = 256
#: The output estimate of a request with no limit is capped here.
MAX_OUTPUT_TOKENS_ESTIMATE = 4096
#: Smoothing of each tenant's mean output tokens (exponentially weighted).
OUTPUT_TOKENS_ALPHA = 0.1
#: A flow's drain is measured over its dispatches of the last this many seconds, or
#: its last ``MIN_BACKLOGGED_DISPATCHES`` if that is longer (a slow flow)...
BACKLOG_WINDOW_S = 2.0
#: ...once there are at least this many, all made while its queue stayed non-empty.
MIN_BACKLOGGED_DISPATCHES = 8


class SeatTime:
    """Mean seat-holding time of the last ``SEAT_TIME_WINDOW`` requests, stragglers clipped.

    Each sample counts at most ``STRAGGLER_FACTOR`` times the window's median,
    so three slow requests among sixty fast ones barely move it, while a
    genuinely wide spread (short and long answers) keeps its mean. Computed
    when read after a change: O(window log window), at most once per record.

        >>> seat = SeatTime()
        >>> for held in (0.05, 0.05, 0.05, 2.0):
        ...     seat.record(held)
        >>> round(seat.mean_s or 0, 4)
        0.0875
    """

    __slots__ = ("_mean", "_samples", "count")

    def __init__(self) -> None:
        self._samples: deque[float] = deque(maxlen=SEAT_TIME_WINDOW)
        self._mean: float | None = None
        #: Seat times recorded since start (the estimators fail open below a minimum).
        self.count = 0

    def record(self, held_s: float) -> None:
        self._samples.append(max(0.0, held_s))
        self._mean = None
        self.count += 1

    @property
    def mean_s(self) -> float | None:
        """None before the first sample."""
        if self._mean is None and self._samples:
            ordered = sorted(self._samples)
            ceiling = STRAGGLER_FACTOR * ordered[len(ordered) // 2]
            self._mean = sum(min(s, ceiling) for s in ordered) / len(ordered)
        return self._mean

    def __repr__(self) -> str:
        mean = self.mean_s
        shown = f"{mean * 1000:.1f} ms" if mean is not None else "none"
        return f"<SeatTime mean {shown} over {len(self._samples)}>"


class BackloggedTurnover:
    """Dispatches per second of each flow, counted only while its queue stays non-empty.

    The capacity the seats give (``SeatTime``) says how fast the *fleet*
    turns over; how much of that a flow gets under fair queuing depends on
    the cost of its tickets against the others' (shares are in tokens) and on
    how the others' queues come and go. While a flow has been backlogged the
    whole time, the rate its own tickets leave the queue is that share,
    measured. It must never be a rate measured while the queue was empty or
    idle (that says how little was asked: the bug of a burst refused after a
    quiet period), so the record of a flow is dropped whenever its backlog
    starts afresh (``began``) or its queue empties (a dispatch with nothing
    left behind it, or a seat granted without queueing). ``rate`` counts the
    current backlog's dispatches of the last ``BACKLOG_WINDOW_S``, or its last
    ``MIN_BACKLOGGED_DISPATCHES`` when those span longer (a flow of slow
    requests), and is None until there are that many. O(1) amortised per
    dispatch.

        >>> turnover = BackloggedTurnover()
        >>> turnover.began("t")
        >>> for i in range(10):
        ...     turnover.dispatched("t", i * 0.1, still_backlogged=True)
        >>> turnover.rate("t", 1.0)
        10.0
        >>> turnover.dispatched("t", 1.0, still_backlogged=False)
        >>> turnover.rate("t", 1.0) is None
        True
    """

    __slots__ = ("_flows",)

    def __init__(self) -> None:
        self._flows: dict[object, deque[float]] = {}

    def began(self, flow: object) -> None:
        """The flow's queue was empty and has a ticket now: nothing before counts."""
        self._flows.pop(flow, None)

    def dispatched(self, flow: object, now: float, *, still_backlogged: bool) -> None:
        """A ticket of the flow got a seat; ``still_backlogged``: from its queue, with
        more of its tickets still queued behind it."""
        if not still_backlogged:
            self._flows.pop(flow, None)
            return
        times = self._flows.get(flow)
        if times is None:
            times = self._flows[flow] = deque()
        times.append(now)
        self._trim(times, now)

    def rate(self, flow: object, now: float) -> float | None:
        """Dispatches per second over the window; None while not measured (see above).

        ``n`` over the time from the window's first dispatch to ``now``: a stall
        since the last dispatch slows the rate at once.
        """
        times = self._flows.get(flow)
        if times is None or len(times) < MIN_BACKLOGGED_DISPATCHES:
            return None
        self._trim(times, now)
        span = now - times[0]
        return len(times) / span if span > 0.0 else None

    @staticmethod
    def _trim(times: deque[float], now: float) -> None:
        while len(times) > MIN_BACKLOGGED_DISPATCHES and times[0] < now - BACKLOG_WINDOW_S:
            times.popleft()

    def forget_idle(self, now: float) -> None:
        """Drop flows with no dispatch in the window (bounded memory)."""
        for flow in [f for f, t in self._flows.items() if not t or t[-1] < now - BACKLOG_WINDOW_S]:
            del self._flows[flow]

    def __len__(self) -> int:
        return len(self._flows)


class _Decayed:
    __slots__ = ("at", "value")

    def __init__(self, at: float) -> None:
        self.value = 0.0
        self.at = at

    def read(self, now: float, tau_s: float) -> float:
        if now > self.at:
            self.value *= math.exp((self.at - now) / tau_s)
            self.at = now
        return self.value


class _DecayedTotals:
    """One exponentially decayed sum per tenant and one for the fleet. O(1) per record."""

    __slots__ = ("_fleet", "_tau_s", "_tenants")

    def __init__(self, tau_s: float) -> None:
        self._tau_s = tau_s
        self._fleet = _Decayed(0.0)
        self._tenants: dict[str, _Decayed] = {}

    def _add(self, tenant: str, amount: float, now: float) -> None:
        counter = self._tenants.get(tenant)
        if counter is None:
            counter = self._tenants[tenant] = _Decayed(now)
        counter.value = counter.read(now, self._tau_s) + amount
        self._fleet.value = self._fleet.read(now, self._tau_s) + amount

    def _own(self, tenant: str, now: float) -> float:
        counter = self._tenants.get(tenant)
        return counter.read(now, self._tau_s) if counter is not None else 0.0

    def forget_idle(self, now: float, below: float = 1e-3) -> None:
        """Drop tenants whose counters decayed to nothing (bounded memory)."""
        tau = self._tau_s
        for tenant in [t for t, c in self._tenants.items() if c.read(now, tau) < below]:
            del self._tenants[tenant]

    def __len__(self) -> int:
        return len(self._tenants)


class RecentDispatches(_DecayedTotals):
    """Dispatches per second over the last few seconds, per tenant and in all.

    Each counter is an exponentially decayed count (time constant
    ``RECENT_TAU_S``); a steady rate r brings it to r * tau, so the rate is
    the count over tau. O(1) per dispatch and per read.
    """

    __slots__ = ()

    def __init__(self) -> None:
        super().__init__(RECENT_TAU_S)

    def record(self, tenant: str, now: float) -> None:
        self._add(tenant, 1.0, now)

    def others_per_second(self, tenant: str, now: float) -> float:
        """The recent dispatch rate of every tenant but ``tenant``."""
        own = self._own(tenant, now)
        return max(0.0, self._fleet.read(now, self._tau_s) - own) / self._tau_s

    def active(self, now: float) -> list[str]:
        """Tenants with about one dispatch or more in the last ``RECENT_TAU_S``. O(tenants)."""
        return [t for t, c in self._tenants.items() if c.read(now, self._tau_s) >= ACTIVE_COUNT]

    def add_counts(self, now: float, into: dict[str, float]) -> None:
        """Add each tenant's decayed count to ``into`` (several replicas' records summed:
        a model pool's). A count over ``RECENT_TAU_S`` is a rate; ``ACTIVE_COUNT`` or
        more is a tenant active in the last seconds. O(tenants)."""
        tau = self._tau_s
        for tenant, counter in self._tenants.items():
            into[tenant] = into.get(tenant, 0.0) + counter.read(now, tau)


class OutputTokens:
    """Each tenant's moving average of output tokens (the cost of a request with no limit).

    ``DEFAULT_OUTPUT_TOKENS`` before a tenant's first answer, then an
    exponentially weighted mean of the real counts, capped at
    ``MAX_OUTPUT_TOKENS_ESTIMATE``.
    """

    __slots__ = ("_means",)

    def __init__(self) -> None:
        self._means: dict[str, float] = {}

    def record(self, tenant: str, tokens: int) -> None:
        mean = self._means.get(tenant)
        count = float(max(0, tokens))
        self._means[tenant] = count if mean is None else mean + OUTPUT_TOKENS_ALPHA * (count - mean)

    def expected(self, tenant: str) -> float:
        mean = self._means.get(tenant)
        if mean is None:
            return float(DEFAULT_OUTPUT_TOKENS)
        return min(float(MAX_OUTPUT_TOKENS_ESTIMATE), mean)

    def keep_tenants(self, keep: Container[str]) -> None:
        """Forget the tenants not in ``keep`` (a reload removed them)."""
        for tenant in [t for t in self._means if t not in keep]:
            del self._means[tenant]

    def __len__(self) -> int:
        return len(self._means)

    def __repr__(self) -> str:
        return f"<OutputTokens {len(self._means)} tenants>"


# -- recent usage (headroom) ------------------------------------------------------
# Who has been using less than their fair share lately: decayed token counters.
#
# Why: fair queuing decides the order of *waiting* tickets, but without
# preemption a light tenant that arrives while a flood holds every seat still
# waits for a seat to free; under a 10x neighbour that wait is its whole p99.
# Replicas may therefore offer a few ``headroom`` seats above their knee that
# only a tenant below its fair share may take. "Below its share" has to be a
# rate over the recent past, not a count of seats held now: a light tenant's
# Poisson bursts briefly hold more than its seat share, and must stay protected
# while they do, whereas a flooding tenant sits above its share all the time.
#
# Each tenant and the fleet keep one exponentially decayed sum of dispatched
# cost (tokens); the ratio of the two is the tenant's recent fraction of the
# work. Both decay with the same time constant, so the ratio needs no clock
# alignment beyond bringing both up to ``now``. O(1) per dispatch and per query.

#: Time constant of the decay: a few seconds of seat turnover, so a flood is
#: recognised within a second or two and a past burst is forgotten as fast.
DEFAULT_TAU_S = 2.0


class RecentUsage(_DecayedTotals):
    """Decayed dispatched cost per tenant and in total."""

    __slots__ = ()

    def __init__(self, tau_s: float = DEFAULT_TAU_S) -> None:
        super().__init__(tau_s)

    def record(self, tenant: str, cost: float, now: float) -> None:
        self._add(tenant, cost, now)

    def fraction(self, tenant: str, now: float) -> float:
        """The tenant's share of the recent work, 0 for a tenant not seen lately."""
        total = self._fleet.read(now, self._tau_s)
        if tenant not in self._tenants or total <= 0.0:
            return 0.0
        return self._own(tenant, now) / total
