"""Places held as leases: tenant ``max_concurrency`` places and replica seats.

A lease key is a ZSET of lease id -> expiry (server ms). Acquire removes the
expired leases first (``ZREMRANGEBYSCORE``), then adds one only while fewer
than ``limit`` remain, all in one script: that is what keeps the total exact
across processes, and what frees a killed process's places within
``lease_ms`` without anyone cleaning up after it. A holder renews its leases
(``LeaseKeeper``, one script call per key for all of this process's leases
there) well before they expire. Release removes the lease and, when it was
still held, publishes the key's channel so waiting processes try again at
once (notify.py).

A refusal says when the earliest lease there expires if nobody renews it:
waiting processes arm one timer for it instead of polling. A lease found
expired at renewal (this process could not reach Redis for ``lease_ms``) is
reported lost: its place may already be someone else's, so the caller must
stop counting it (the request keeps running; the replica runs at most one
more than its limit until it ends). A Redis restart without persistence loses
every lease the same way: renewals report them lost, releases answer False.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from proxy.state.client import StateClient, StateDown, lua

_ACQUIRE = lua(
    """
local now = now_ms()
local key, id, limit, lease_ms = KEYS[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
local held = redis.call('ZCARD', key)
if held >= limit then
  local first = redis.call('ZRANGE', key, 0, 0, 'WITHSCORES')
  local wait = lease_ms
  if first[2] then wait = tonumber(first[2]) - now end
  return {0, held, tostring(wait)}
end
redis.call('ZADD', key, now + lease_ms, id)
redis.call('PEXPIRE', key, 2 * lease_ms)
return {1, held + 1, '0'}
"""
)

#: Acquire of a replica seat with fair sharing across processes: members are
#: ``<tenant>|<lease id>``; KEYS[2] is the ZSET of tenants refused a seat there
#: (``<tenant>|<owner>`` -> expiry ms, one entry per process: a process whose queue
#: for the tenant empties removes its own, never another's, ``_UNWAIT``), KEYS[3]
#: their weights (per tenant). A free seat goes to the caller
#: only when its finish tag, (seats held + 1) / weight, is not above that of any
#: other waiting tenant (weighted fair queuing over the seats); a refusal records the caller as
#: waiting for ``wait_ms`` and asks it back within half of that, so a waiter that
#: is gone stops counting within ``wait_ms``. ARGV[8] ``0``: a headroom seat,
#: granted whenever one is free (the caller's process found the tenant below its
#: fair share of recent work, the rule of headroom; the seats held now would count
#: its headroom seats against it and hand the turn to the flood). ARGV[9]: the
#: owner (the process) whose waiting entry a refusal writes and a grant removes.
#:
#: KEYS[4] (``<waiting>:instances``) is the same for processes: owner (ARGV[9]) ->
#: expiry, the processes with a backlog for the replica: recorded with every refusal
#: (for ``wait_ms``: it asks again within half of that), and with a grant for the
#: ``backlog_ms`` the caller says (ARGV[10], 0: none; a process holding every seat
#: it can see asks again only when one of its own frees, so it says a few seat
#: times). A grant never removes it: seats freed together are taken at once by
#: requests that did not queue, while the process stays saturated. Every answer also
#: says what the prediction of waits needs (``Seen``): the seats held by the *other*
#: processes backlogged there (they keep taking their part of every seat that
#: frees), and how many there are. Counted only while there is one: a lone process
#: pays nothing.
_ACQUIRE_FAIR = lua(
    """
local now = now_ms()
local key, waiting, weights, instances = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local id, limit, lease_ms = ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local tenant, weight, wait_ms, owner = ARGV[5], tonumber(ARGV[6]), tonumber(ARGV[7]), ARGV[9]
local mine = tenant .. '|' .. owner
redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
redis.call('ZREMRANGEBYSCORE', waiting, '-inf', now)
redis.call('ZREMRANGEBYSCORE', instances, '-inf', now)
local held = redis.call('ZCARD', key)
local refuse = nil
if held >= limit then
  local first = redis.call('ZRANGE', key, 0, 0, 'WITHSCORES')
  refuse = lease_ms
  if first[2] then refuse = tonumber(first[2]) - now end
elseif ARGV[8] ~= '0' then
  local others = redis.call('ZRANGE', waiting, 0, -1)
  local least = nil
  local counts = nil
  for _, entry in ipairs(others) do
    local t = string.match(entry, '^(.*)|') or entry
    if t ~= tenant then
      if counts == nil then
        counts = {}
        for _, m in ipairs(redis.call('ZRANGE', key, 0, -1)) do
          local owner = string.match(m, '^(.*)|')
          if owner then counts[owner] = (counts[owner] or 0) + 1 end
        end
      end
      local v = ((counts[t] or 0) + 1) / (tonumber(redis.call('HGET', weights, t)) or 1)
      if least == nil or v < least then least = v end
    end
  end
  if least ~= nil and ((counts[tenant] or 0) + 1) / weight > least + 1e-9 then
    refuse = wait_ms
  end
end
local function elsewhere()
  local others = redis.call('ZCARD', instances)
  if redis.call('ZSCORE', instances, owner) then others = others - 1 end
  if others == 0 then return 0, 0 end
  local backlogged = 0
  for _, m in ipairs(redis.call('ZRANGE', key, 0, -1)) do
    local o = string.match(m, '([^|]*):%d+$')
    if o and o ~= owner and redis.call('ZSCORE', instances, o) then
      backlogged = backlogged + 1
    end
  end
  return backlogged, others
end
if refuse then
  redis.call('ZADD', waiting, now + wait_ms, mine)
  redis.call('HSET', weights, tenant, ARGV[6])
  redis.call('ZADD', instances, now + wait_ms, owner)
  redis.call('PEXPIRE', waiting, 2 * wait_ms)
  redis.call('PEXPIRE', weights, 2 * wait_ms)
  if redis.call('PTTL', instances) < 2 * wait_ms then
    redis.call('PEXPIRE', instances, 2 * wait_ms)
  end
  local backlogged, others = elsewhere()
  return {0, held, tostring(math.min(refuse, math.floor(wait_ms / 2))), backlogged, others}
end
redis.call('ZREM', waiting, mine)
redis.call('ZADD', key, now + lease_ms, tenant .. '|' .. id)
redis.call('PEXPIRE', key, 2 * lease_ms)
local backlog_ms = tonumber(ARGV[10])
if backlog_ms > 0 then
  redis.call('ZADD', instances, now + backlog_ms, owner)
  if redis.call('PTTL', instances) < 2 * backlog_ms then
    redis.call('PEXPIRE', instances, 2 * backlog_ms)
  end
end
local backlogged, others = elsewhere()
return {1, held + 1, '0', backlogged, others}
"""
)

#: A tenant no longer waits for a seat here (this process's queue for it emptied):
#: its waiting entry (ARGV[2], ``<tenant>|<owner>``) goes now rather than at its
#: expiry, where it could still refuse other tenants their turn. When others still
#: wait and a seat is free (below ARGV[3]), the replica's channel (ARGV[4]) is told,
#: as for a release: a tenant refused its turn for that entry asks again at once.
#: Returns 0 (no entry), 1 (removed) or 2 (removed and told).
_UNWAIT = lua(
    """
local now = now_ms()
local waiting, seats = KEYS[1], KEYS[2]
if redis.call('ZREM', waiting, ARGV[2]) == 0 then return 0 end
redis.call('ZREMRANGEBYSCORE', waiting, '-inf', now)
if redis.call('ZCARD', waiting) == 0 then return 1 end
if redis.call('ZCOUNT', seats, '(' .. now, '+inf') >= tonumber(ARGV[3]) then return 1 end
redis.call('PUBLISH', ARGV[4], seats)
return 2
"""
)

_RELEASE = lua(
    """
local removed = redis.call('ZREM', KEYS[1], ARGV[2])
if removed == 1 then redis.call('PUBLISH', ARGV[3], KEYS[1]) end
return removed
"""
)

_RENEW = lua(
    """
local now = now_ms()
local key, lease_ms = KEYS[1], tonumber(ARGV[2])
local lost = {}
for i = 3, #ARGV do
  local expiry = redis.call('ZSCORE', key, ARGV[i])
  if expiry and tonumber(expiry) > now then
    redis.call('ZADD', key, 'XX', now + lease_ms, ARGV[i])
  else
    redis.call('ZREM', key, ARGV[i])
    lost[#lost + 1] = ARGV[i]
  end
end
if redis.call('EXISTS', key) == 1 then redis.call('PEXPIRE', key, 2 * lease_ms) end
return lost
"""
)

#: Renewal that puts back a lease Redis lost (a restart, an expiry while it was
#: unreachable): the request behind it still runs, so the count must say so.
_RESTORE = lua(
    """
local now = now_ms()
local key, lease_ms = KEYS[1], tonumber(ARGV[2])
local restored = {}
for i = 3, #ARGV do
  if not redis.call('ZSCORE', key, ARGV[i]) then restored[#restored + 1] = ARGV[i] end
  redis.call('ZADD', key, now + lease_ms, ARGV[i])
end
redis.call('PEXPIRE', key, 2 * lease_ms)
return restored
"""
)

_HELD = lua(
    """
return redis.call('ZCOUNT', KEYS[1], '(' .. now_ms(), '+inf')
"""
)


def waiting_instances(waiting: str) -> str:
    """The processes backlogged for the replica, beside its waiting tenants: same tag."""
    return f"{waiting}:instances"


@dataclass(frozen=True, slots=True)
class Share:
    """Who asks for a seat, for fair sharing across processes (``_ACQUIRE_FAIR``).

    ``waiting`` and ``weights`` are the seat key's siblings on its hash tag;
    ``wait_ms`` is how long a refused tenant counts as waiting unless it asks again.
    """

    tenant: str
    weight: float
    waiting: str
    weights: str
    wait_ms: int
    #: False: a headroom seat, granted outside the turn whenever one is free.
    turn: bool = True
    #: How long the asker counts as backlogged there (``_ACQUIRE_FAIR``'s KEYS[4]); 0: not.
    backlog_ms: int = 0


@dataclass(frozen=True, slots=True)
class Seen:
    """What a fair seat acquire saw of the seats (``_ACQUIRE_FAIR``), for the waits.

    ``held``: leases there after the call (the caller's included); ``backlogged``: of
    those, the ones held by other processes backlogged there (refused a seat lately, or
    granted one saying so; ``others`` of them): they take their part of every seat
    that frees.
    """

    held: int
    backlogged: int
    others: int


@dataclass(frozen=True, slots=True)
class Lease:
    key: str
    id: str
    #: Where its release is announced (``StateKeys.freed_channel``).
    channel: str
    #: A seat taken in a fair turn: what Redis said of the seats then.
    seen: Seen | None = field(default=None, compare=False)


@dataclass(frozen=True, slots=True)
class Full:
    """No place: ``held`` leases there, the earliest expiring in ``retry_in_s`` unless renewed."""

    held: int
    retry_in_s: float
    #: Below the limit: a seat was free but not the asker's fair turn (``_ACQUIRE_FAIR``).
    turn: bool = False
    seen: Seen | None = None


class LeaseStore:
    """Acquire, renew and release leases; one Redis call each."""

    __slots__ = ("_client", "_ids", "_owner", "lease_ms")

    def __init__(self, client: StateClient, owner: str, lease_ms: int) -> None:
        self._client = client
        self._owner = owner
        self._ids = itertools.count(1)
        self.lease_ms = lease_ms

    async def acquire(
        self, key: str, limit: int, channel: str, share: Share | None = None
    ) -> Lease | Full:
        """Take one of ``limit`` places at ``key``, or say when one may free.

        With ``share`` (a replica seat) the place goes to the tenant only in its
        fair turn among the tenants waiting there (still one call)."""
        lease_id = f"{self._owner}:{next(self._ids)}"
        seen = None
        if share is None:
            granted, held, wait = await self._client.run(
                _ACQUIRE, [key], [lease_id, limit, self.lease_ms]
            )
        else:
            granted, held, wait, backlogged, others = await self._client.run(
                _ACQUIRE_FAIR,
                [key, share.waiting, share.weights, waiting_instances(share.waiting)],
                [
                    lease_id,
                    limit,
                    self.lease_ms,
                    share.tenant,
                    repr(share.weight),
                    share.wait_ms,
                    int(share.turn),
                    self._owner,
                    share.backlog_ms,
                ],
            )
            lease_id = f"{share.tenant}|{lease_id}"
            seen = Seen(int(held), int(backlogged), int(others))
        if int(granted):
            return Lease(key, lease_id, channel, seen)
        turn = share is not None and int(held) < limit
        return Full(int(held), max(0.0, float(wait)) / 1000, turn, seen)

    async def release(self, lease: Lease) -> bool:
        """Give the place back; False when it was no longer held (expired or lost)."""
        removed = await self._client.run(_RELEASE, [lease.key], [lease.id, lease.channel])
        return bool(removed)

    async def unwait(self, seats: str, waiting: str, tenant: str, limit: int, channel: str) -> int:
        """Remove this process's entry for ``tenant`` from ``waiting``, the waiting ZSET
        of the seat key ``seats`` (``_UNWAIT``: 0 none, 1 removed, 2 removed and
        ``channel`` told, a seat being free below ``limit`` for the others waiting)."""
        member = f"{tenant}|{self._owner}"
        return int(await self._client.run(_UNWAIT, [waiting, seats], [member, limit, channel]))

    async def renew(self, key: str, lease_ids: Iterable[str]) -> set[str]:
        """Extend every given lease at ``key`` by ``lease_ms``; returns the ids lost."""
        lost = await self._client.run(_RENEW, [key], [self.lease_ms, *lease_ids])
        return set(lost)

    def local(self, key: str, channel: str, share: Share | None = None) -> Lease:
        """A lease taken without Redis (``on_failure: local_share`` while it is down);
        the keeper's first renewal once Redis answers puts it there (``restore``), in
        its tenant's name when it is a seat (``share``)."""
        lease_id = f"{self._owner}:{next(self._ids)}"
        if share is not None:
            lease_id = f"{share.tenant}|{lease_id}"
        return Lease(key, lease_id, channel)

    async def restore(self, key: str, lease_ids: Iterable[str]) -> set[str]:
        """Renew every given lease at ``key``, adding back those Redis no longer has
        (returned): the place is in use whatever Redis remembers."""
        restored = await self._client.run(_RESTORE, [key], [self.lease_ms, *lease_ids])
        return set(restored)

    async def held(self, key: str) -> int:
        """Leases not expired at ``key``: the ground truth the tests count."""
        return int(await self._client.run(_HELD, [key], []))

    def __repr__(self) -> str:
        return f"<LeaseStore {self._owner} lease {self.lease_ms} ms>"


class LeaseKeeper:
    """This process's held leases, renewed together every third of ``lease_ms``.

    ``run`` is a background loop for the owner's ``cleanup_ctx``; a renewal
    that fails is retried at the next tick (the client counts the error).
    ``on_lost`` hears of each lease Redis no longer holds; it is no longer
    renewed, and the caller stops counting it.
    """

    __slots__ = ("_by_key", "_on_lost", "_restore", "_soon", "_store", "on_restored")

    def __init__(
        self,
        store: LeaseStore,
        on_lost: Callable[[Lease], None] | None = None,
        *,
        restore: bool = False,
    ) -> None:
        """``restore``: a lease Redis lost is added back rather than reported lost (the
        request path's keeper: what runs is what counts, even over the limit)."""
        self._store = store
        self._on_lost = on_lost
        self._restore = restore
        self._by_key: dict[str, dict[str, Lease]] = {}
        self._soon = asyncio.Event()
        #: ``restore``: told when Redis had lost leases this process holds (a restart).
        self.on_restored: Callable[[], None] | None = None

    def add(self, lease: Lease) -> None:
        self._by_key.setdefault(lease.key, {})[lease.id] = lease

    def discard(self, lease: Lease) -> None:
        held = self._by_key.get(lease.key)
        if held is not None:
            held.pop(lease.id, None)
            if not held:
                del self._by_key[lease.key]

    async def renew_once(self) -> list[Lease]:
        """One renewal of every held lease (one call per key); returns those lost."""
        lost: list[Lease] = []
        for key, held in list(self._by_key.items()):
            try:
                if self._restore:
                    if await self._store.restore(key, list(held)) and self.on_restored:
                        self.on_restored()
                    continue
                ids = await self._store.renew(key, list(held))
            except StateDown:
                continue
            for lease_id in ids:
                lease = held.get(lease_id)
                if lease is not None:
                    lost.append(lease)
                    self.discard(lease)
                    if self._on_lost is not None:
                        self._on_lost(lease)
        return lost

    def renew_soon(self) -> None:
        """Renew now rather than at the next tick (Redis is back: restore at once)."""
        self._soon.set()

    async def run(self) -> None:
        """Renew until cancelled."""
        interval = self._store.lease_ms / 3000
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(interval):
                    await self._soon.wait()
            self._soon.clear()
            await self.renew_once()

    def __len__(self) -> int:
        return sum(len(held) for held in self._by_key.values())

    def __repr__(self) -> str:
        return f"<LeaseKeeper {len(self)} leases on {len(self._by_key)} keys>"
