"""What admission predicts from: seat time, the others' recent dispatches, output tokens.

Three small estimators, each fed by the request path and read by it:

- ``SeatTime``: how long a request holds its replica seat. The serving seats
  divided by it is the number of dispatches per second the fleet sustains, the
  capacity every wait estimate and ``Retry-After`` starts from.
- ``RecentDispatches``: dispatches per second per tenant and in all,
  exponentially decayed, so a flow's estimate can leave room for the others
  that come back while it waits.
- ``OutputTokens``: each tenant's moving average of output tokens, the cost of
  a request that names no output limit.

Why samples and not rates: a seat time measured during a quiet period is as
valid as one measured under load, whereas a rate measured over a quiet period
says how little was asked, not how much can be served (a burst after a pause
was refused for a rate of a few requests a minute). Rates here are recent
(seconds), and only ever say what *others* take.

No I/O and no clock reads here: callers pass ``now``.
"""

from __future__ import annotations

import math
from collections import deque
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from proxy.replicas import Replica, ReplicaPool
    from proxy.scheduler import Scheduler

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

    def per_second(self, now: float) -> float:
        """The fleet's recent dispatch rate."""
        return self._fleet.read(now, self._tau_s) / self._tau_s

    def others_per_second(self, tenant: str, now: float) -> float:
        """The recent dispatch rate of every tenant but ``tenant``."""
        own = self._own(tenant, now)
        return max(0.0, self._fleet.read(now, self._tau_s) - own) / self._tau_s

    def active(self, now: float) -> list[str]:
        """Tenants with about one dispatch or more in the last ``RECENT_TAU_S``. O(tenants)."""
        return [t for t, c in self._tenants.items() if c.read(now, self._tau_s) >= ACTIVE_COUNT]


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


# -- the wait a new ticket expects, and Retry-After ----------------------------------

#: Retry-After when nothing is known yet about seat times.
DEFAULT_FREE_PLACE_S = 1.0
#: The wait estimator fails open until it has seen this many dispatches end
#: (their seat times), so a cold proxy never refuses on no data.
MIN_DISPATCHES_TO_PREDICT = 20


class Waits:
    """The wait and ``Retry-After`` estimates, from the capacity the seats give now.

    Fed by the dispatcher (``started`` when a seat is granted, ``ended`` when
    it is given back) and read by its admission decisions. It reads the
    pool's serving seats and the scheduler's queues but changes neither. What
    only the dispatcher knows (the tenant's cap, whether it is at it now, the
    retries waiting for a seat) is passed in.
    """

    __slots__ = ("_pool", "_recent", "_running", "_scheduler", "seat_time")

    def __init__(self, pool: ReplicaPool, scheduler: Scheduler) -> None:
        self._pool = pool
        self._scheduler = scheduler
        self.seat_time = SeatTime()
        self._recent = RecentDispatches()
        #: When each running request got its seat, and where (for the release times).
        self._running: dict[int, tuple[float, Replica]] = {}

    def started(self, ticket_id: int, tenant: str, replica: Replica, now: float) -> None:
        self._running[ticket_id] = (now, replica)
        self._recent.record(tenant, now)

    def ended(self, ticket_id: int, held_s: float | None) -> None:
        """A seat went back; ``held_s`` is its seat time when it counts (no grace)."""
        if held_s is not None:
            self.seat_time.record(held_s)
        self._running.pop(ticket_id, None)

    def forget_idle(self, now: float) -> None:
        self._recent.forget_idle(now)

    def predict_wait(
        self,
        tenant: str,
        priority: str,
        now: float,
        *,
        cap: int | None,
        at_cap: bool,
        reseating: int,
    ) -> float | None:
        """Expected queue wait of a new ticket under the fair-share rule; None: no data.

        Fails open until ``MIN_DISPATCHES_TO_PREDICT`` seat times are known.
        """
        if self.seat_time.count < MIN_DISPATCHES_TO_PREDICT:
            return None
        return self.estimate_wait(
            tenant, priority, now, cap=cap, at_cap=at_cap, reseating=reseating
        )

    def time_to_free_place(self, tenant: str, priority: str, now: float, cap: int | None) -> float:
        """Expected time until the tenant's queue moves by one (Retry-After of 429s).

        One over the rate its flow drains at now (``drain_rates``); only a
        proxy that has seen no seat time yet says ``DEFAULT_FREE_PLACE_S``.
        """
        rates = self.drain_rates(tenant, priority, now, cap)
        return 1.0 / rates[0] if rates else DEFAULT_FREE_PLACE_S

    def wait_or_default(
        self,
        tenant: str,
        priority: str,
        now: float,
        *,
        cap: int | None,
        at_cap: bool,
        reseating: int,
    ) -> float:
        """The wait a new ticket of this flow expects now (Retry-After of queue_timeout)."""
        estimate = self.estimate_wait(
            tenant, priority, now, cap=cap, at_cap=at_cap, reseating=reseating
        )
        return DEFAULT_FREE_PLACE_S if estimate is None else estimate

    def capacity(self) -> float | None:
        """Dispatches per second the serving seats sustain: seats over the mean seat time.

        What the fleet *can* serve now, whatever it was asked lately: the seats
        of replicas serving now (a lost replica's seats are gone at once; the
        rate dispatched before the loss is not), and a seat time that a quiet
        period does not change.
        """
        seats = sum(r.limit for r in self._pool.replicas if r.serving)
        mean = self.seat_time.mean_s
        if not seats or not mean:
            return None
        return seats / mean

    def drain_rates(
        self, tenant: str, priority: str, now: float, cap: int | None
    ) -> tuple[float, float] | None:
        """Dispatches per second for this flow, and for the queue as a whole; None: no data.

        Both start from the capacity the seats give now (``capacity``), never
        from a rate measured over the tenant's own recent past: after a quiet
        period that rate is a few requests a minute, and a burst that the
        seats would serve in a second was refused.

        The flow gets its fair share among the flows backlogged now (a lone
        flow: all of it), less what other tenants, not queued at this
        instant, have been taking over the last seconds beyond what the
        backlogged ones are due: fair queuing lets them keep what they use
        below their share, so a snapshot of the queues alone rated a flow far
        too fast whenever the others' queues happened to be empty. The queue
        as a whole drains at the capacity less everything the others take.
        Neither falls below the flow's share if every recently active tenant
        were backlogged too (each counted as one more flow of its weight):
        that much fair queuing guarantees it. A tenant with a concurrency cap
        drains no faster than its cap turns over.
        """
        capacity = self.capacity()
        if capacity is None:
            return None
        scheduler = self._scheduler
        share = scheduler.share_of(tenant, priority)
        others = self._recent.others_per_second(tenant, now)
        idle_take = max(0.0, others - (1.0 - share) * capacity)
        returning = sum(
            1 for t in self._recent.active(now) if t != tenant and not scheduler.depth(t)
        )
        floor = capacity / (1.0 / share + returning)
        flow = max(min(share * capacity, capacity - idle_take), floor)
        mean = self.seat_time.mean_s
        if cap and mean:
            flow = min(flow, cap / mean)
        return flow, max(capacity - others, floor)

    def estimate_wait(
        self,
        tenant: str,
        priority: str,
        now: float,
        *,
        cap: int | None,
        at_cap: bool,
        reseating: int,
    ) -> float | None:
        """Time until a new ticket of this flow gets a seat.

        It gets one when the seats have freed as many times as the work ahead
        of it takes: its place in its flow scaled by the flow's share, or
        everything queued now scaled by the queue's, whichever is sooner
        (unless its own cap holds it back: then its own seats turn over).
        Retries waiting for a seat (``reseating``) take one ahead of every
        queued ticket.
        """
        rates = self.drain_rates(tenant, priority, now, cap)
        if rates is None:
            return None
        flow, whole = rates
        own = self._scheduler.depth_by_class(tenant, priority) + 1
        if at_cap:
            return own / flow
        capacity = self.capacity()
        assert capacity is not None  # known whenever the rates are
        queued = len(self._scheduler) + 1
        releases = min(own * capacity / flow, queued * capacity / whole) + reseating
        return self._time_to_release(max(1, math.ceil(releases - 1e-9)), now)

    def _time_to_release(self, n: int, now: float) -> float:
        """When the serving seats will have freed ``n`` times, from what they run now.

        Each busy seat frees when its request has held it the mean seat time
        (at once if it is past that), then every mean seat time; a free seat
        counts as freeing now. Seats that started together free together, so
        this is a staircase, not ``n`` over the capacity: near the budget the
        difference decides.
        """
        mean = self.seat_time.mean_s
        seats = sum(r.limit for r in self._pool.replicas if r.serving)
        if not mean or not seats:
            return 0.0
        due = sorted(
            max(0.0, mean - (now - granted_at))
            for granted_at, replica in self._running.values()
            if replica.serving
        )[:seats]
        due.extend([0.0] * (seats - len(due)))
        due.sort()
        rounds, index = divmod(n - 1, seats)
        return due[index] + rounds * mean
