"""``SharedPlaces`` on Redis: tenant places and replica seats as leases, with a local fallback.

``take`` acquires the tenant's place (when it has ``max_concurrency``) and
then the replica's seat (``pair.py``: both or neither); ``give_back`` never
blocks the request path: the lease leaves this process's counts and its
keeper at once and is released in Redis by ``run`` (or by the next ``take``,
which first sends the releases still pending, so this process can reuse a
seat it just freed without waiting for its own notification). A release that
fails is tried again until the lease would have expired anyway.

Redis down (``StateDown``): ``reject`` raises ``StateUnavailable``;
``local_share`` grants against this process's own counts, each limit divided
by the live instances last seen (``StateDown.local_seats``), with a lease id
that the keeper adds to Redis at its first renewal once Redis answers again
(``LeaseKeeper(restore=True)``). The counts are the same in both modes (every
place this process holds, whichever way it was taken), so a switch either
way neither loses nor counts twice a request in flight.

Back from down (or Redis found to have lost leases: a restart), the local
share keeps applying on top of Redis for one ``lease_ms`` (``recovered``):
another process may not have noticed yet, and its requests in flight are not
in Redis until its keeper restores them, which it does within a renewal
interval. Until then an empty Redis alone would admit the whole limit again.

A seat refused records the tenant as waiting at the replica (``_ACQUIRE_FAIR``)
for ``WAITING_MS``, one entry per process. This process remembers which entries
it wrote (``waiting_at``), so that once the tenant waits for those replicas no
more here (``stop_waiting``: its queue for their pools emptied) ``run`` removes
them at once; left to expire, they refused other tenants their turn for a tenant
that no longer waited. A tenant never refused costs nothing: no entry, no call.

``heard`` turns a freed channel (pub/sub) into ``on_freed(kind, name)``;
``None, None`` means anything may have freed (a resubscription, Redis back).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Collection, Iterable

from proxy.errors import StateUnavailable
from proxy.places import Blocked, Elsewhere, Held, PlaceKind
from proxy.state.client import StateClient, StateDown
from proxy.state.keys import StateKeys
from proxy.state.leases import Full, Lease, LeaseKeeper, LeaseStore, Seen, Share
from proxy.state.pair import Refused, Want, acquire_pair

#: While Redis is down, a place found full locally is looked at again after this long
#: at the latest (a local give-back or Redis coming back wakes it sooner).
DEGRADED_RETRY_S = 0.5
#: Pending releases that failed are tried again after this long.
RELEASE_RETRY_S = 0.2
#: A tenant refused a replica seat counts as waiting there this long unless it asks
#: again (it is asked back within half of it): what a waiter that went away can cost.
WAITING_MS = 400
#: ``Retry-After`` of ``state_unavailable``.
UNAVAILABLE_RETRY_AFTER_S = 1.0

FreedCallback = Callable[[PlaceKind | None, str | None], None]


class RedisPlaces:
    """Tenant places and replica seats shared by every process on one Redis."""

    __slots__ = (
        "_client",
        "_freed_prefix",
        "_keys",
        "_pending",
        "_shared_from",
        "_taking",
        "_unwaits",
        "_waits",
        "_wake",
        "counts",
        "keeper",
        "on_freed",
        "store",
    )

    def __init__(
        self, client: StateClient, keys: StateKeys, store: LeaseStore, keeper: LeaseKeeper
    ) -> None:
        self._client = client
        self._keys = keys
        self.store = store
        self.keeper = keeper
        #: Places this process holds now, per key (both modes): the local_share count.
        self.counts: dict[str, int] = {}
        #: Releases not yet done in Redis: (lease, when it was given back).
        self._pending: list[tuple[Lease, float]] = []
        self._wake = asyncio.Event()
        self._freed_prefix = keys.freed_channel("")
        #: Until then (monotonic) the local share applies on top of Redis (``recovered``).
        self._shared_from = 0.0
        keeper.on_restored = self.recovered
        #: Told when a place may have freed (the dispatcher's ``freed``).
        self.on_freed: FreedCallback | None = None
        #: Waiting entries this process wrote in Redis (a seat refused): tenant ->
        #: replica -> (when, monotonic; the seat limit it asked under).
        self._waits: dict[str, dict[str, tuple[float, int]]] = {}
        #: Of those, the ones to remove (``stop_waiting``), sent by ``run``.
        self._unwaits: dict[tuple[str, str], tuple[float, int]] = {}
        #: Seat calls in flight per (tenant, replica): their answer settles the entry (a
        #: grant removes it, a refusal writes it afresh), so no removal is sent meanwhile.
        self._taking: dict[tuple[str, str], int] = {}

    def __repr__(self) -> str:
        return (
            f"<RedisPlaces {sum(self.counts.values())} held, {len(self._pending)} releases pending>"
        )

    # -- names -------------------------------------------------------------------------

    def tenant_channel(self, tenant: str) -> str:
        return self._keys.freed_channel(f"t:{tenant}")

    def replica_channel(self, replica: str) -> str:
        return self._keys.freed_channel(f"r:{replica}")

    def heard(self, channel: str) -> None:
        """A freed channel was published (or, a pattern: resubscribed, anything may be free)."""
        if self.on_freed is None:
            return
        name = channel.removeprefix(self._freed_prefix)
        if name.startswith("t:"):
            self.on_freed("tenant", name[2:])
        elif name.startswith("r:"):
            self.on_freed("replica", name[2:])
        else:
            self.on_freed(None, None)

    # -- taking ------------------------------------------------------------------------

    async def take(
        self, tenant: str, cap: int | None, replica: str, seats: int, weight: float = 1.0,
        *, headroom: bool = False, backlog_s: float = 0.0,
    ) -> Held | Blocked:  # fmt: skip
        if not tenant:
            return await self._take(tenant, cap, replica, seats, weight, headroom, backlog_s)
        asking = (tenant, replica)
        self._taking[asking] = self._taking.get(asking, 0) + 1
        try:
            return await self._take(tenant, cap, replica, seats, weight, headroom, backlog_s)
        finally:
            if self._taking[asking] == 1:
                del self._taking[asking]
            else:
                self._taking[asking] -= 1

    async def _take(
        self, tenant: str, cap: int | None, replica: str, seats: int, weight: float,
        headroom: bool, backlog_s: float,
    ) -> Held | Blocked:  # fmt: skip
        share = None
        if tenant:
            share = Share(
                tenant,
                weight,
                self._keys.waiting(replica),
                self._keys.waiting_weights(replica),
                WAITING_MS,
                turn=not headroom,
                backlog_ms=round(backlog_s * 1000),
            )
        seat = Want(self._keys.seats(replica), seats, self.replica_channel(replica), share)
        place = None
        if cap is not None:
            place = Want(self._keys.tenant_places(tenant), cap, self.tenant_channel(tenant))
        await self._flush()
        reserved: list[str] = []
        if not self._client.up or time.monotonic() < self._shared_from:
            # Down, or just back: the call below may be the one that finds Redis back.
            over = self._over_local_share(self._client.instances, tenant, place, replica, seat)
            if over is not None:
                return over
            # Counted before the call: takes running at once must not all pass the check.
            reserved = [w.key for w in (place, seat) if w is not None]
            self._count(reserved, 1)
        try:
            if place is None:
                got = await self.store.acquire(seat.key, seat.limit, seat.channel, seat.share)
                pair: tuple[Lease | None, Lease] | Refused = (
                    Refused(1, got) if isinstance(got, Full) else (None, got)
                )
            else:
                pair = await acquire_pair(self.store, place, seat)
        except StateDown as down:
            self._count(reserved, -1)
            reserved = []
            return self._take_locally(down, tenant, place, replica, seat)
        finally:
            self._count(reserved, -1)
        if isinstance(pair, Refused):
            kind: PlaceKind = "tenant" if pair.which == 0 else "replica"
            name = tenant if pair.which == 0 else replica
            if pair.which == 1:
                self._waited(tenant, replica, seats)
            full = pair.full
            seen = self._elsewhere(seat.key, full.seen) if pair.which == 1 else None
            return Blocked(kind, name, full.retry_in_s, full.turn, seen)
        self._seated(tenant, replica)
        return self._held(*pair)

    def _elsewhere(self, key: str, seen: Seen | None) -> Elsewhere | None:
        """A seat answer as other instances hold the seats: what Redis counted less what
        this process holds there (a granted lease already counted in ``counts``). A take
        of this process still in flight counts as another's until its answer."""
        if seen is None:
            return None
        others = max(0, seen.held - self.counts.get(key, 0))
        return Elsewhere(others, min(others, seen.backlogged), seen.others)

    def _count(self, keys: list[str], step: int) -> None:
        for key in keys:
            left = self.counts.get(key, 0) + step
            if left > 0:
                self.counts[key] = left
            else:
                self.counts.pop(key, None)

    async def take_seat(self, replica: str, seats: int) -> Held | Blocked:
        return await self.take("", None, replica, seats)

    # -- waiting entries ---------------------------------------------------------------

    def _waited(self, tenant: str, replica: str, seats: int) -> None:
        """Redis refused ``tenant`` a seat of ``replica``: it wrote our waiting entry."""
        if tenant:
            self._waits.setdefault(tenant, {})[replica] = (time.monotonic(), seats)
            self._unwaits.pop((tenant, replica), None)

    def _seated(self, tenant: str, replica: str) -> None:
        """A seat granted: the script removed our waiting entry there."""
        waits = self._waits.get(tenant)
        if waits is not None and waits.pop(replica, None) is not None and not waits:
            del self._waits[tenant]
        self._unwaits.pop((tenant, replica), None)

    def waiting_at(self, tenant: str) -> Collection[str]:
        """Replicas where ``tenant`` has a waiting entry of this process not yet expired
        (forgetting those that expired by themselves)."""
        waits = self._waits.get(tenant)
        if not waits:
            return ()
        oldest = time.monotonic() - WAITING_MS / 1000
        for replica in [r for r, (at, _) in waits.items() if at <= oldest]:
            del waits[replica]
        if not waits:
            del self._waits[tenant]
        return tuple(waits)

    def stop_waiting(self, tenant: str, replicas: Iterable[str]) -> None:
        """``tenant`` waits no more here for those replicas' seats: remove its entries
        there in the background (``run``); never blocks."""
        waits = self._waits.get(tenant)
        if not waits:
            return
        for replica in replicas:
            made = waits.pop(replica, None)
            if made is not None:
                self._unwaits[(tenant, replica)] = made
        if not waits:
            del self._waits[tenant]
        if self._unwaits:
            self._wake.set()

    async def _flush_unwaits(self) -> None:
        """Send the removals pending now; one that fails is tried again until the entry
        would have expired anyway. An entry written again since (a new refusal) stays."""
        if not self._unwaits:
            return
        batch, self._unwaits = list(self._unwaits.items()), {}
        oldest = time.monotonic() - WAITING_MS / 1000
        for index, ((tenant, replica), (at, seats)) in enumerate(batch):
            if at <= oldest or replica in self._waits.get(tenant, {}):
                continue  # expired, or refused again: it waits there once more
            if (tenant, replica) in self._taking:
                continue  # asking again: its answer removes or rewrites the entry
            try:
                await self.store.unwait(
                    self._keys.seats(replica), self._keys.waiting(replica), tenant, seats,
                    self.replica_channel(replica),
                )  # fmt: skip
            except StateDown:
                self._unwaits.setdefault((tenant, replica), (at, seats))
            except BaseException:
                for key, made in batch[index:]:
                    self._unwaits.setdefault(key, made)
                raise

    def _take_locally(
        self, down: StateDown, tenant: str, place: Want | None, replica: str, seat: Want
    ) -> Held | Blocked:
        if down.on_failure == "reject":
            raise StateUnavailable(
                "the shared admission state is unavailable",
                retry_after_s=UNAVAILABLE_RETRY_AFTER_S,
            ) from down
        over = self._over_local_share(down.instances, tenant, place, replica, seat)
        if over is not None:
            return over
        tenant_lease = None if place is None else self.store.local(place.key, place.channel)
        return self._held(tenant_lease, self.store.local(seat.key, seat.channel, seat.share))

    def _over_local_share(
        self, instances: int, tenant: str, place: Want | None, replica: str, seat: Want
    ) -> Blocked | None:
        """This process's part of each limit (divided by the live instances, at least 1)."""
        instances = max(1, instances)
        if place is not None and self.counts.get(place.key, 0) >= max(1, place.limit // instances):
            return Blocked("tenant", tenant, DEGRADED_RETRY_S)
        if self.counts.get(seat.key, 0) >= max(1, seat.limit // instances):
            return Blocked("replica", replica, DEGRADED_RETRY_S)
        return None

    def recovered(self) -> None:
        """Redis answers again (or had lost leases): local share on top of it for a lease."""
        self._shared_from = time.monotonic() + self.store.lease_ms / 1000
        self.keeper.renew_soon()

    def _held(self, place: Lease | None, seat: Lease) -> Held:
        for lease in (place, seat):
            if lease is not None:
                self.counts[lease.key] = self.counts.get(lease.key, 0) + 1
                self.keeper.add(lease)
        return Held(place, seat, self._elsewhere(seat.key, seat.seen))

    # -- giving back -------------------------------------------------------------------

    def give_back(self, handle: object) -> None:
        if not isinstance(handle, Lease):
            return
        self._count([handle.key], -1)
        self.keeper.discard(handle)
        self._pending.append((handle, time.monotonic()))
        self._wake.set()

    async def _flush(self) -> None:
        """Send the releases pending now; those that fail stay pending until they expire."""
        if not self._pending:
            return
        batch, self._pending = self._pending, []
        lease_s = self.store.lease_ms / 1000
        now = time.monotonic()
        for index, (lease, at) in enumerate(batch):
            if now - at > lease_s:
                continue  # expired in Redis by now: nothing left to release
            try:
                await self.store.release(lease)
            except StateDown:
                self._pending.append((lease, at))
            except BaseException:
                self._pending.extend(batch[index:])
                raise

    async def run(self) -> None:
        """Send releases as they come, until cancelled (owned by ``cleanup_ctx``)."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            await self._flush()
            await self._flush_unwaits()
            if self._pending or self._unwaits:
                await asyncio.sleep(RELEASE_RETRY_S)
                self._wake.set()

    async def close(self) -> None:
        """Shutting down: one last try at the pending releases."""
        with contextlib.suppress(StateDown):
            await self._flush()
            await self._flush_unwaits()
