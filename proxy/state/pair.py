"""Two leases on two hash tags (a tenant place, then a replica seat), with compensation.

A script never touches two entities' keys (Redis Cluster slots), so a
dispatch that needs both takes them in two calls. When the second is refused
or Redis fails in between, the first is released at once; should that
release fail too, the first lease is simply never renewed and frees within
``lease_ms``. Either way no place stays taken for a request that did not go.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from proxy.state.client import StateDown
from proxy.state.leases import Full, Lease, LeaseStore, Share


@dataclass(frozen=True, slots=True)
class Want:
    """One place to take: ``limit`` places at ``key``, announced on ``channel``."""

    key: str
    limit: int
    channel: str
    #: A replica seat: who asks, for fair sharing across processes.
    share: Share | None = None


@dataclass(frozen=True, slots=True)
class Refused:
    """Which of the two had no place (0: the first, 1: the second), and its answer."""

    which: int
    full: Full


async def acquire_pair(
    store: LeaseStore, first: Want, second: Want
) -> tuple[Lease, Lease] | Refused:
    """Both leases, or neither: ``Refused`` when one is full, ``StateDown`` raised as is."""
    one = await store.acquire(first.key, first.limit, first.channel, first.share)
    if isinstance(one, Full):
        return Refused(0, one)
    try:
        two = await store.acquire(second.key, second.limit, second.channel, second.share)
    except BaseException:
        with contextlib.suppress(StateDown):
            await store.release(one)
        raise
    if isinstance(two, Full):
        with contextlib.suppress(StateDown):
            await store.release(one)
        return Refused(1, two)
    return one, two
