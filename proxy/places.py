"""The seam between the local dispatcher and places shared with other processes.

With ``state.backend: local`` the dispatcher's own counts are the whole truth
and it holds no ``SharedPlaces`` (``Dispatcher.shared is None``: not one await
more per request). With ``redis`` (``proxy/state/places.py``) a ticket the
local pump granted must also take its tenant place and its replica seat in
the shared state before it goes upstream; a refusal sends it back to its
queue, and the place that was full is held off locally until it frees
(``Dispatcher.freed``). The dispatcher's pass stays synchronous; only the
granted ticket's waiter does I/O. No I/O here.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Literal, Protocol

#: What kind of shared place was full: a tenant's ``max_concurrency`` or a replica's seats.
PlaceKind = Literal["tenant", "replica"]


@dataclass(frozen=True, slots=True)
class Elsewhere:
    """A replica's seats as other instances hold them, seen in a take's answer.

    ``held``: seats other instances hold; ``backlogged``: of those, the ones held by
    instances with a backlog there too (``waiting`` of them). The waits of this
    instance count them (``waits.py``): a backlogged instance keeps taking its part
    of every seat that frees; one with no queue only frees its seats.
    """

    held: int
    backlogged: int
    waiting: int


@dataclass(frozen=True, slots=True)
class Held:
    """The shared places one grant holds (opaque handles, given back one by one)."""

    place: object | None
    seat: object
    #: What the seat's answer said of the other instances (None: nothing seen).
    elsewhere: Elsewhere | None = None


@dataclass(frozen=True, slots=True)
class Blocked:
    """No shared place: ``kind`` ``name`` is full, try again in ``retry_in_s`` at the latest."""

    kind: PlaceKind
    name: str
    retry_in_s: float
    #: A replica seat was free, but another tenant waiting there had the fair turn: the
    #: refusal concerns this tenant only, not the replica (``Dispatcher._turn_refused``).
    turn: bool = False
    #: As in ``Held``, when the replica's seat answered.
    elsewhere: Elsewhere | None = None


class SharedPlaces(Protocol):
    async def take(
        self, tenant: str, cap: int | None, replica: str, seats: int, weight: float = 1.0,
        *, headroom: bool = False, backlog_s: float = 0.0,
    ) -> Held | Blocked:  # fmt: skip
        """The tenant's place (when ``cap``) and one of ``seats`` seats of ``replica``,
        the seat in the tenant's fair turn (``weight``) among the tenants waiting there;
        ``headroom``: a headroom seat, outside the turn (this process found the tenant
        below its fair share of recent work); ``backlog_s``: how long this process
        counts as backlogged for the replica (the other instances' waits count it;
        0: it has no backlog).

        Both or neither; raises ``StateUnavailable`` when the state is down and
        ``on_failure`` is ``reject``.
        """
        ...

    async def take_seat(self, replica: str, seats: int) -> Held | Blocked:
        """A replica seat alone (a retry keeps its tenant place)."""
        ...

    def give_back(self, handle: object) -> None:
        """A place or seat back; never blocks (released in the background)."""
        ...

    def waiting_at(self, tenant: str) -> Collection[str]:
        """Replicas where a seat refused to ``tenant`` lately counts it as waiting (for
        the other instances' fair turns) on this process's behalf; empty for a tenant
        not refused (the common case: a dict lookup)."""
        ...

    def stop_waiting(self, tenant: str, replicas: Iterable[str]) -> None:
        """``tenant`` has nothing queued here for those replicas any more: it no longer
        counts as waiting there (or it would refuse others their turn for nothing);
        never blocks."""
        ...
