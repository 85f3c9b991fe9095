"""Prompt work in flight on each replica, and where each affinity key's prompt is cached.

The bounded load of ``prefix_affinity`` (``affinity.py``) weighs a replica by
the prompt tokens its engine still has to compute, not by how many requests it
runs: a cold 2,000-token prefill and a turn whose history the engine's prefix
cache holds take one seat each, but the first keeps the engine busy many times
longer, and whatever is sent behind it waits for it. Counting requests let a
hot key spill to a replica where its prompt was cold (that spill was the
slowest request of the benchmark) and let two cold prefills share one replica
while each was "within the bound".

A request's *work* on a replica is its cost estimate (prompt bytes / 4 plus
its output limit, the scheduler's cost) less what that replica is thought to
hold for its key: the cost of the last request with the same key that ended
there, since the engine caches that prompt and its answer and the next turn's
prompt repeats both. A request still in flight warms nothing (an engine reuses
a prefix only once it is computed), so two concurrent requests of a new key
are both cold; and while a request of the key runs on a replica, the key
counts as cold there too: llama.cpp keeps a prompt in one slot, and a turn
that arrives while that slot still serves the previous one is computed in
full (in the benchmark such turns piled up cold on the hot session's home).
An engine whose cache is shared between requests (vLLM, SGLang) is then
overestimated, which only spreads a busy key sooner. A request counts its
work until its seat is given back, decoding included.

These are estimates the proxy makes without asking the engine: a prompt the
engine has evicted still counts as warm, and a shorter prompt of a known key
is taken as wholly cached. Only affinity hashes are kept (no prompt text), for
at most ``max_keys`` keys, the least recently ended forgotten first. No I/O.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from proxy.affinity import AffinityKey

#: Keys whose cached replicas are remembered (a few hundred bytes each).
DEFAULT_MAX_KEYS = 4_096
#: The least work a request counts for, cached or not (its decode step).
MIN_WORK = 1.0


@dataclass(frozen=True, slots=True)
class _Placement:
    replica: str
    key: AffinityKey
    cost: float
    work: float


class PrefillLedger:
    """Uncached prompt work in flight per replica, and each key's warm replicas.

    >>> ledger = PrefillLedger()
    >>> seat = object()
    >>> ledger.work(AffinityKey(7), 2000.0, "gpu-0")  # never sent: all of it
    2000.0
    >>> ledger.started(seat, "gpu-0", AffinityKey(7), 2000.0)
    >>> ledger.pending("gpu-0")
    2000.0
    >>> ledger.ended(seat)
    >>> ledger.work(AffinityKey(7), 2060.0, "gpu-0")  # the next turn: only what is new
    60.0
    """

    __slots__ = ("_busy", "_count", "_pending", "_placed", "_warm", "max_keys")

    def __init__(self, max_keys: int = DEFAULT_MAX_KEYS) -> None:
        self.max_keys = max_keys
        #: In flight, by the seat (any hashable lease) that carries it.
        self._placed: dict[object, _Placement] = {}
        self._pending: dict[str, float] = {}
        self._count: dict[str, int] = {}
        #: (key, replica) -> requests of that key in flight there.
        self._busy: dict[tuple[AffinityKey, str], int] = {}
        #: Key -> replica -> cost of the last request of that key that ended there.
        self._warm: OrderedDict[AffinityKey, dict[str, float]] = OrderedDict()

    def __repr__(self) -> str:
        pending = sum(self._pending.values())
        return (
            f"<PrefillLedger {len(self._placed)} in flight, {pending:.0f} tokens pending, "
            f"{len(self._warm)} keys warm>"
        )

    def warm_keys(self) -> int:
        """Keys remembered as cached somewhere: at most ``max_keys``."""
        return len(self._warm)

    def work(self, key: AffinityKey, cost: float, replica: str) -> float:
        """What a request of ``key`` costing ``cost`` adds to ``replica``'s prompt work."""
        if (key, replica) in self._busy:
            return max(cost, MIN_WORK)  # its cached copy is in use
        cached = self._warm.get(key, {}).get(replica, 0.0)
        return max(cost - cached, MIN_WORK)

    def pending(self, replica: str) -> float:
        """The work of the requests this ledger placed on ``replica`` that are still running."""
        return self._pending.get(replica, 0.0)

    def count(self, replica: str) -> int:
        """How many of ``replica``'s requests in flight this ledger placed."""
        return self._count.get(replica, 0)

    def started(self, seat: object, replica: str, key: AffinityKey, cost: float) -> None:
        """A request of ``key`` got ``seat`` on ``replica``: its work is pending there."""
        placement = _Placement(replica, key, cost, self.work(key, cost, replica))
        self._placed[seat] = placement
        self._pending[replica] = self._pending.get(replica, 0.0) + placement.work
        self._count[replica] = self._count.get(replica, 0) + 1
        busy = (key, replica)
        self._busy[busy] = self._busy.get(busy, 0) + 1

    def ended(self, seat: object, *, warmed: bool = True) -> None:
        """``seat`` was given back (idempotent; an unknown seat is ignored). With
        ``warmed``, its replica now holds its key's prompt; without (a grant undone
        before anything was sent), nothing changes but the pending work."""
        placement = self._placed.pop(seat, None)
        if placement is None:
            return
        name = placement.replica
        busy = (placement.key, name)
        if self._busy[busy] > 1:
            self._busy[busy] -= 1
        else:
            del self._busy[busy]
        left = self._count[name] - 1
        if left:
            self._count[name] = left
            self._pending[name] -= placement.work
        else:  # exactly zero, whatever the float sums drifted to
            del self._count[name]
            del self._pending[name]
        if warmed:
            self._warm.setdefault(placement.key, {})[name] = placement.cost
            self._warm.move_to_end(placement.key)
            while len(self._warm) > self.max_keys:
                self._warm.popitem(last=False)
