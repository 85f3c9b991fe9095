"""Replica seats: who may receive work, and how many requests each runs.

Each replica has ``max_concurrency`` seats (the knee found by the staircase
test), plus optional ``headroom`` seats above the knee that only a tenant
below its fair share may take (``RecentUsage`` in ``estimators.py`` says why).
``ReplicaPool.choose`` picks the available replica with the lowest
in-flight/limit ratio, ties broken at random, so load spreads evenly without a
central counter. A ``Seat`` is the lease on one of those places; it goes
back through ``Dispatcher.release``, where releasing it twice is harmless,
which lets every path release in ``finally`` without bookkeeping. No I/O
here: health probes and engine scrapes (``health.py``) only move the state
and flip the flags this module reads.

A replica's health lifecycle is one ``ReplicaState``, moved only along
``TRANSITIONS`` (``Replica.move_to``)::

    STARTING ──probe answers──▶ WARMING ──warm-up over──▶ STARTING ──came up──▶ SERVING
    SERVING ──failures──▶ EJECTED ──expired, probe answers──▶ RETURNING ──▶ EJECTED ──▶ SERVING

Beside it, three things that are not health states: ``draining`` is the
operator's flag (``/admin/replicas/{name}/drain``) and outlives an ejection;
``saturated`` (the engine's metrics) and ``gpu_guarded`` (its GPU's memory)
are hold-offs that keep a serving replica from new seats for a while. The
booleans the request path reads (``serving``, ``ejected``, ``starting``,
``warming``) are views of the state, and ``state`` is the one word
``/admin/state`` shows (draining over serving).
"""

from __future__ import annotations

import enum
import math
import random
import ssl
from collections.abc import Iterable, Mapping
from typing import NewType

from proxy.settings import ReplicaConfig
from proxy.tls import ReplicaTls

ReplicaName = NewType("ReplicaName", str)


class ReplicaState(enum.Enum):
    """Where a replica is in its health lifecycle (``health.py`` moves it)."""

    #: Never healthy since start-up or since a reload added it: probed every
    #: interval, no traffic, never ejected (an engine may load for minutes).
    STARTING = "starting"
    #: Starting, and its probe answered (or start-up): warm-up requests run;
    #: requests wait for it rather than being refused.
    WARMING = "warming"
    SERVING = "serving"
    #: Failed past the threshold: no traffic until ``ejected_until``.
    EJECTED = "ejected"
    #: Its ejection is over and its probe answered: warming up to serve again
    #: (still ejected for the request path until the warm-up succeeds).
    RETURNING = "returning"


_S = ReplicaState
#: The moves ``health.py`` makes; any other is a bug (``IllegalTransition``).
TRANSITIONS: Mapping[ReplicaState, frozenset[ReplicaState]] = {
    # probe answered: warm up; came up (no warm-up configured); or healthy once
    # through a request that was in flight, then failed past the threshold.
    _S.STARTING: frozenset({_S.WARMING, _S.SERVING, _S.EJECTED}),
    # the warm-up is over (came up or not, health decides); ejected as above.
    _S.WARMING: frozenset({_S.STARTING, _S.EJECTED}),
    # failures: ejected, or starting when never healthy yet (also a reload's
    # new replica); start-up warms every replica before its first request.
    _S.SERVING: frozenset({_S.STARTING, _S.WARMING, _S.EJECTED}),
    # expired and probed: warm up; returned; a failed return ejects it longer.
    _S.EJECTED: frozenset({_S.RETURNING, _S.SERVING, _S.EJECTED}),
    _S.RETURNING: frozenset({_S.EJECTED}),
}


class IllegalTransition(RuntimeError):
    """A move of a replica's state that ``TRANSITIONS`` does not allow."""


class Replica:
    """Live state of one upstream replica."""

    __slots__ = (
        "_health",
        "api_key",
        "config",
        "draining",
        "drops_kept_alive",
        "ejected_until",
        "ejections",
        "failures",
        "gpu_guarded",
        "headroom",
        "healthy_once",
        "inflight",
        "limit",
        "name",
        "probe_error",
        "retired",
        "saturated",
        "shared_full",
        "shared_headroom_full",
        "ssl",
        "tls",
        "url",
    )

    def __init__(
        self, config: ReplicaConfig, api_key: str | None = None, tls: ReplicaTls | None = None
    ) -> None:
        self.config = config
        self.tls = tls
        #: What aiohttp's ``ssl=`` gets on every connection to it (True: the defaults).
        self.ssl: ssl.SSLContext | bool = tls.context if tls is not None else True
        self.name = ReplicaName(config.name)
        self.url = config.url
        self.limit = config.max_concurrency
        self.headroom = config.headroom
        self.api_key = api_key
        self.inflight = 0
        self._health = ReplicaState.SERVING
        #: The operator's drain (``/admin``, or a reload's retirement): no new
        #: work; it is not a health state and outlives an ejection.
        self.draining = False
        #: Removed from the config by a reload: drains, then leaves the pool.
        self.retired = False
        #: Engine metrics say the replica is saturated (fresh readings only).
        self.saturated = False
        #: Its GPU's memory is over the guard (sidecar mode).
        self.gpu_guarded = False
        #: Shared state: its seats are all taken across the instances; held off here
        #: until one frees (``Dispatcher.freed``).
        self.shared_full = False
        #: The same for its headroom seats too. A regular seat refused (the knee
        #: full across the instances) leaves the headroom open, as it is locally:
        #: a tenant below its fair share still starts there at once.
        self.shared_headroom_full = False
        #: Consecutive failures, and how many ejections in a row (health.py).
        self.failures = 0
        self.ejections = 0
        self.ejected_until = 0.0
        #: Healthy once since the process started or a reload added it; until
        #: then a failure makes it ``starting`` (probed on the interval, no
        #: ejection backoff) instead of ejected: an engine may load for minutes.
        self.healthy_once = False
        #: Why its last probe failed (``/admin/state``); None after a success.
        self.probe_error: str | None = None
        #: It closed a kept-alive connection under us (llama.cpp does after each
        #: stream): streamed requests to it ask for ``Connection: close``.
        self.drops_kept_alive = False

    def reconfigure(self, config: ReplicaConfig, api_key: str | None) -> None:
        """The same replica in a reloaded config: new limits apply to the next dispatch."""
        self.config = config
        self.url = config.url
        self.limit = config.max_concurrency
        self.headroom = config.headroom
        self.api_key = api_key

    def set_tls(self, tls: ReplicaTls | None) -> None:
        """A new context (reload, files changed): new connections use it."""
        self.tls = tls
        self.ssl = tls.context if tls is not None else True

    @property
    def health(self) -> ReplicaState:
        return self._health

    def move_to(self, state: ReplicaState) -> None:
        """The one way the state changes; a move ``TRANSITIONS`` lacks is a bug."""
        if state not in TRANSITIONS[self._health]:
            raise IllegalTransition(f"replica {self.name}: {self._health.value} -> {state.value}")
        self._health = state

    @property
    def starting(self) -> bool:
        """Never healthy yet (warming up or waiting for its probe)."""
        return self._health is ReplicaState.STARTING or self._health is ReplicaState.WARMING

    @property
    def warming(self) -> bool:
        """Its warm-up requests are running (first start or return from ejection)."""
        return self._health is ReplicaState.WARMING or self._health is ReplicaState.RETURNING

    @property
    def ejected(self) -> bool:
        return self._health is ReplicaState.EJECTED or self._health is ReplicaState.RETURNING

    @property
    def serving(self) -> bool:
        """May take new work at all (seats aside)."""
        return self._health is ReplicaState.SERVING and not self.draining

    @property
    def dispatchable(self) -> bool:
        """Serving, and neither its engine nor its GPU says to hold off."""
        return self.serving and not (self.saturated or self.gpu_guarded)

    @property
    def has_free_seat(self) -> bool:
        return self.dispatchable and self.inflight < self.limit and not self.shared_full

    @property
    def has_headroom_seat(self) -> bool:
        """A seat above the knee is free (for tenants below their fair share)."""
        return (
            self.dispatchable
            and self.inflight < self.limit + self.headroom
            and not self.shared_headroom_full
        )

    @property
    def state(self) -> str:
        """One word for operators: ejected, starting, draining or serving.

        Returning shows as ejected and warming as starting (the request path
        treats them so); draining shows only over serving.
        """
        if self.ejected:
            return "ejected"
        if self.starting:
            return "starting"
        return "draining" if self.draining else "serving"

    @property
    def load(self) -> float:
        return self.inflight / self.limit

    def __repr__(self) -> str:
        flags = [
            f
            for f in ("ejected", "starting", "draining", "warming", "saturated", "gpu_guarded")
            if getattr(self, f)
        ]
        state = ",".join(flags) or "serving"
        return f"<Replica {self.name} {self.inflight}/{self.limit} {state}>"


class Seat:
    """One leased place on a replica; given back through ``Dispatcher.release``."""

    __slots__ = ("headroom", "lease", "released", "replica")

    def __init__(self, replica: Replica) -> None:
        self.replica = replica
        #: Set by the dispatcher when the seat is given back (maybe freed after a grace).
        self.released = False
        #: A seat above the knee (a tenant below its fair share).
        self.headroom = False
        #: Shared state: the seat's lease across instances (``proxy/places.py``).
        self.lease: object | None = None

    def __repr__(self) -> str:
        return f"<Seat {self.replica.name} {'released' if self.released else 'held'}>"


class ReplicaPool:
    """The replicas a proxy fronts, with seat accounting."""

    __slots__ = ("_by_name", "_rng")

    def __init__(
        self,
        replicas: Iterable[Replica],
        *,
        rng: random.Random | None = None,
    ) -> None:
        self._by_name: dict[ReplicaName, Replica] = {r.name: r for r in replicas}
        self._rng = rng or random.Random()

    @property
    def replicas(self) -> list[Replica]:
        return list(self._by_name.values())

    def get(self, name: str) -> Replica | None:
        return self._by_name.get(ReplicaName(name))

    def choose(
        self,
        exclude: frozenset[ReplicaName] = frozenset(),
        *,
        strict: bool = False,
        headroom: bool = False,
        among: frozenset[str] | None = None,
    ) -> Replica | None:
        """The free replica with the lowest load ratio.

        ``exclude`` is a preference: an excluded replica is chosen only when
        no other is free, and never when ``strict``. With ``headroom``, seats
        above the knee count as free too. ``among``: only these replicas (a
        model pool); ``None``: all.
        """
        best: list[Replica] = []
        best_load = math.inf
        fallback: list[Replica] = []
        for replica in self._by_name.values():
            if not (replica.has_headroom_seat if headroom else replica.has_free_seat):
                continue
            if among is not None and replica.name not in among:
                continue
            if replica.name in exclude:
                fallback.append(replica)
                continue
            load = replica.load
            if load < best_load:
                best, best_load = [replica], load
            elif load == best_load:
                best.append(replica)
        if not best and not strict:
            best = fallback
        if not best:
            return None
        return best[0] if len(best) == 1 else self._rng.choice(best)

    def choose_any(self, among: frozenset[str] | None = None) -> Replica | None:
        """A serving replica for seatless requests (GET, /v1/models): least loaded;
        one of ``among`` (the request's model pool) when given."""
        serving = [
            r
            for r in self._by_name.values()
            if r.serving and not r.ejected and (among is None or r.name in among)
        ]
        if not serving:
            return None
        return min(serving, key=lambda r: (r.load, self._rng.random()))

    def any_usable(self, among: frozenset[str] | None = None) -> bool:
        """False only when every replica is ejected or drained: then refuse at once.

        A warming or saturated replica still counts: requests wait for it. A
        starting one counts only while it warms (its engine may be minutes away).
        """
        return any(
            not (r.ejected or r.draining or (r.starting and not r.warming))
            for r in self._by_name.values()
            if among is None or r.name in among
        )

    def add(self, replica: Replica) -> None:
        """A replica new in the config (reload); it is probed and warms before it serves."""
        self._by_name[replica.name] = replica

    def retire(self, name: str) -> None:
        """Removed from the config: no new work; it leaves once its last seat is back."""
        replica = self._by_name.get(ReplicaName(name))
        if replica is None:
            return
        replica.retired = replica.draining = True
        if replica.inflight == 0:
            del self._by_name[replica.name]

    def lease(self, replica: Replica) -> Seat:
        replica.inflight += 1
        return Seat(replica)

    def free(self, replica: Replica) -> None:
        """One of ``replica``'s seats is back (the dispatcher's ``release``)."""
        replica.inflight -= 1
        # Only if the name is still this replica's: a reload may have put a new
        # replica of the same name in its place while this one drained.
        if replica.retired and replica.inflight == 0 and self._by_name.get(replica.name) is replica:
            del self._by_name[replica.name]

    def offers_headroom(self) -> bool:
        return any(r.headroom for r in self._by_name.values())

    def total_inflight(self) -> int:
        return sum(r.inflight for r in self._by_name.values())

    def __repr__(self) -> str:
        seats = sum(r.limit for r in self._by_name.values())
        return f"<ReplicaPool {len(self._by_name)} replicas, {self.total_inflight()}/{seats} seats>"
