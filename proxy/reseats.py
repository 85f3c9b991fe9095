"""Retries waiting for a seat: served ahead of every queued ticket.

A retry kept its tenant place during its backoff; only its replica seat was
given back. While another replica of its pool is dispatchable, it waits for a
seat there (up to ``RESEAT_PREFERENCE_S``) rather than go straight back to the
replica that just failed it. The dispatcher owns the one ``Reseats`` and
serves it first in every ``pump``. A retry of a model no replica lists any
more gets the entrance's 404 ``model_not_found`` at once (``refuse_unserved``)
rather than wait out its total budget for a seat that cannot come.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass

from proxy.pools import PoolSeats
from proxy.replicas import ReplicaName, Seat

#: How long a retry waits for a seat on another replica before taking one on the
#: replica that just failed it.
RESEAT_PREFERENCE_S = 1.0


@dataclass(slots=True, eq=False)
class Reseat:
    """A retry waiting for a seat."""

    future: asyncio.Future[Seat]
    exclude: frozenset[ReplicaName]
    strict: bool
    model: str | None


class Reseats:
    """The retries waiting now, in arrival order."""

    __slots__ = ("_seats", "_waiting")

    def __init__(self, seats: PoolSeats) -> None:
        self._seats = seats
        self._waiting: list[Reseat] = []

    def __len__(self) -> int:
        return len(self._waiting)

    async def wait(
        self,
        exclude: frozenset[ReplicaName],
        timeout_s: float,
        model: str | None,
        *,
        pump: Callable[[], None],
        release: Callable[[Seat], None],
    ) -> Seat:
        """A seat for a retry (``Dispatcher.reseat``); ``TimeoutError`` when none frees in time.

        ``pump`` hands out free seats (this one's turn included); ``release``
        gives back a seat granted while the waiter was being cancelled.
        """
        gone = self._seats.unserved(model)
        if gone is not None:
            raise gone.error()
        loop = asyncio.get_running_loop()
        strict = self._seats.other_dispatchable(model, exclude)
        waiter = Reseat(loop.create_future(), exclude, strict, model)
        self._waiting.append(waiter)
        relax = None
        if strict:
            delay = min(RESEAT_PREFERENCE_S, timeout_s / 2)
            relax = loop.call_later(delay, self._relax, waiter, pump)
        pump()
        try:
            async with asyncio.timeout(timeout_s):
                return await waiter.future
        except BaseException:
            future = waiter.future
            if future.done() and not future.cancelled() and future.exception() is None:
                release(future.result())
            elif not future.done():
                future.cancel()
            with contextlib.suppress(ValueError):
                self._waiting.remove(waiter)
            raise
        finally:
            if relax is not None:
                relax.cancel()

    @staticmethod
    def _relax(waiter: Reseat, pump: Callable[[], None]) -> None:
        waiter.strict = False
        pump()

    def waiting_in(self, model: str | None) -> bool:
        """A retry of ``model``'s pool waits (``None`` on either side: the whole fleet).

        A retry of another pool does not hold a new ticket back: a seat free at
        that moment is one no waiting retry would take (each ``pump`` serves the
        retries first), even on a replica the pools share.
        """
        return any(
            waiter.model is None or model is None or waiter.model == model
            for waiter in self._waiting
            if not waiter.future.done()
        )

    def ahead_in(self, model: str | None) -> int:
        """Retries waiting now that may take a seat of ``model``'s pool before its queue:
        those of a pool sharing one of its replicas (``None`` on either side: every
        replica). A retry of a pool on other replicas never takes one of its seats."""
        members = self._seats.members(model)
        ahead = 0
        for waiter in self._waiting:
            if waiter.future.done():
                continue
            theirs = self._seats.members(waiter.model)
            if members is None or theirs is None or not members.isdisjoint(theirs):
                ahead += 1
        return ahead

    def refuse_unserved(self) -> None:
        """Answer each waiting retry whose model no replica lists any more (its 404)."""
        for waiter in list(self._waiting):
            gone = self._seats.unserved(waiter.model)
            if gone is None:
                continue
            self._waiting.remove(waiter)
            if not waiter.future.done():
                waiter.future.set_exception(gone.error())

    def serve(self) -> None:
        """Lease each waiting retry a free seat of its pool, where one fits its preference."""
        pool = self._seats.pool
        for waiter in list(self._waiting):
            if waiter.future.done():
                self._waiting.remove(waiter)
                continue
            members = self._seats.members(waiter.model)
            replica = pool.choose(waiter.exclude, strict=waiter.strict, among=members)
            if replica is None:
                continue
            self._waiting.remove(waiter)
            waiter.future.set_result(pool.lease(replica))
