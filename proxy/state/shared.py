"""``state.backend: redis`` assembled: one client, the places, buckets, budget and quotas.

``SharedState`` is what the runtime holds when the backend is Redis (None
otherwise): the dispatcher's ``SharedPlaces`` (places.py), the entrance's
rate buckets, the retry budget's fleet counts, the token quota store, this
instance's heartbeat and the freed-seat subscription. ``run`` is its
background work for the app's ``cleanup_ctx`` (lease renewal, heartbeat,
releases, notifications, the retry budget's request counts); ``close`` leaves
the registry and closes the connections.

Each switch between shared and local (Redis down, Redis back) is logged once
and counted (``admission_state_up``, ``admission_state_errors_total``); when
Redis answers again every lease taken meanwhile is restored at once and every
place held off locally is looked at again.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import socket
from collections.abc import Callable, Coroutine
from typing import Any

import structlog

from proxy.clock import Clock
from proxy.errors import StateUnavailable
from proxy.quotas import RateTake, TokenBucket
from proxy.retries import RetryBudget
from proxy.settings import StateConfig
from proxy.state.buckets import SharedBuckets
from proxy.state.client import WARM_S, StateClient, StateDown
from proxy.state.instances import InstanceRegistry
from proxy.state.keys import StateKeys
from proxy.state.leases import LeaseKeeper, LeaseStore
from proxy.state.notify import FreedListener
from proxy.state.places import UNAVAILABLE_RETRY_AFTER_S, RedisPlaces
from proxy.state.quota import (
    Charge,
    LocalTokenQuotas,
    QuotaLimits,
    QuotaRefused,
    QuotaRemaining,
    TokenQuotaStore,
)
from proxy.state.quota_redis import RedisTokenQuotas
from proxy.state.retry_budget import SharedRetryBudget

log = structlog.get_logger(__name__)

#: The retry budget's dispatch counts go to Redis in batches this often.
REQUEST_COUNT_FLUSH_S = 0.5


def instance_id() -> str:
    """This process among every instance: host, pid and a random part (pids repeat)."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"


def unavailable(down: StateDown) -> StateUnavailable:
    return StateUnavailable(
        "the shared admission state is unavailable", retry_after_s=UNAVAILABLE_RETRY_AFTER_S
    )


class SharedState:
    """Every shared limit of one process, on one Redis."""

    __slots__ = (
        "_local_buckets",
        "_requests",
        "buckets",
        "client",
        "clock",
        "config",
        "instance_id",
        "keys",
        "listener",
        "places",
        "quotas",
        "registry",
        "retry_budget",
        "switches",
    )

    def __init__(self, config: StateConfig, clock: Clock, *, instance: str | None = None) -> None:
        self.config = config
        self.clock = clock
        self.instance_id = instance or instance_id()
        self.client = StateClient(config, on_change=self._changed)
        self.keys = keys = StateKeys(config.key_prefix)
        store = LeaseStore(self.client, self.instance_id, config.lease_ms)
        self.places = RedisPlaces(self.client, keys, store, LeaseKeeper(store, restore=True))
        self.registry = InstanceRegistry(self.client, keys, self.instance_id, config.lease_ms)
        self.registry.on_lost = self.places.recovered
        self.buckets = SharedBuckets(self.client, keys)
        self.retry_budget = SharedRetryBudget(self.client, keys)
        self.quotas = SharedTokenQuotas(self.client, RedisTokenQuotas(self.client, keys))
        self.listener = FreedListener(
            config.redis_url, [], self.places.heard,
            connect_timeout_s=max(0.05, config.timeout_ms / 1000),
            patterns=[keys.freed_channel("*")],
        )  # fmt: skip
        self._local_buckets: dict[str, TokenBucket] = {}
        self._requests = 0
        #: Switches between shared and local so far (tests wait on it).
        self.switches = 0

    def __repr__(self) -> str:
        return f"<SharedState {self.instance_id} {self.client!r} {self.places!r}>"

    def _changed(self, up: bool, exc: BaseException | None) -> None:
        self.switches += 1
        if up:
            log.info("shared state up", instances=self.client.instances)
            self.places.recovered()
            self.places.heard("")
        else:
            log.warning(
                "shared state down",
                on_failure=self.config.on_failure,
                instances=self.client.instances,
                error=f"{type(exc).__name__}: {exc}" if exc is not None else None,
            )

    # -- the entrance's rate buckets ---------------------------------------------------

    async def take_rate(self, tenant: str, rate_per_s: float, burst: float) -> RateTake:
        """The tenant's turn at its shared bucket (its local share while Redis is down)."""
        try:
            return await self.buckets.take(tenant, rate_per_s, burst)
        except StateDown as down:
            if down.on_failure == "reject":
                raise unavailable(down) from down
            return self._local_bucket(tenant, down, rate_per_s, burst).take()

    def _local_bucket(
        self, tenant: str, down: StateDown, rate_per_s: float, burst: float
    ) -> TokenBucket:
        rate, share = down.local_share(rate_per_s), max(1.0, down.local_share(burst))
        bucket = self._local_buckets.get(tenant)
        if bucket is None:
            bucket = self._local_buckets[tenant] = TokenBucket(rate, share, self.clock)
        elif (bucket.rate, bucket.burst) != (rate, share):
            bucket.reconfigure(rate, share)
        return bucket

    # -- the retry budget --------------------------------------------------------------

    def record_request(self) -> None:
        """A dispatch: counted here, sent to Redis in batches (``REQUEST_COUNT_FLUSH_S``)."""
        self._requests += 1

    async def spend_retry(self, budget: RetryBudget) -> float:
        """0.0: a retry spent from the fleet's budget; > 0: seconds until one. While Redis
        is down (``local_share``) it comes from this process's own ``budget``, which counts
        its own requests, with its share of the ``min_retries_per_s`` floor: the whole floor
        in every process would let the fleet retry that many times over."""
        try:
            await self._flush_requests()
            return await self.retry_budget.try_spend(budget.ratio, budget.min_per_s)
        except StateDown as down:
            if down.on_failure == "reject":
                raise unavailable(down) from down
            floor = down.local_share(budget.min_per_s)
            return 0.0 if budget.try_spend(min_per_s=floor) else budget.refill_in()

    async def _flush_requests(self) -> None:
        count, self._requests = self._requests, 0
        if count:
            try:
                await self.retry_budget.record_request(count)
            except BaseException:
                self._requests += count
                raise

    async def _count_requests(self) -> None:
        while True:
            await asyncio.sleep(REQUEST_COUNT_FLUSH_S)
            with contextlib.suppress(StateDown):
                await self._flush_requests()

    # -- lifecycle ---------------------------------------------------------------------

    async def warm(self) -> None:
        """Before serving: a connection open and every script loaded (``StateClient.warm``),
        so that a cold Redis is not taken for a down one by the first requests."""
        if not await self.client.warm():
            # The URL is not logged: it may carry a password.
            log.warning("shared state not reached at start", within_s=WARM_S)

    def background(self) -> list[Callable[[], Coroutine[Any, Any, None]]]:
        """The loops ``run`` starts (one task each)."""
        return [
            self.places.keeper.run,
            self.places.run,
            self.registry.run,
            self.listener.run,
            self._count_requests,
        ]

    async def close(self) -> None:
        """Releases still pending, leave the registry (others stop counting this one at
        once), close the connections."""
        await self.places.close()
        with contextlib.suppress(StateDown):
            await self.registry.leave()
        await self.client.aclose()


class SharedTokenQuotas:
    """``TokenQuotaStore`` on Redis with the failure rule: ``local_share`` charges a local
    store against each limit divided by the live instances, ``reject`` raises
    ``StateUnavailable``.

    A charge is corrected where it was made: one made locally while Redis was down
    is settled locally (Redis never saw it, so giving its difference back there
    would count it twice or lose it). The local charges are kept by identity until
    their one correction.
    """

    __slots__ = ("_client", "_local", "_local_charges", "_redis")

    def __init__(self, client: StateClient, redis: RedisTokenQuotas) -> None:
        self._client = client
        self._redis = redis
        self._local = LocalTokenQuotas()
        self._local_charges: dict[int, Charge] = {}

    @staticmethod
    def _shared(down: StateDown, limits: QuotaLimits) -> QuotaLimits:
        def part(limit: int | None) -> int | None:
            return None if limit is None else max(1, int(down.local_share(limit)))

        return QuotaLimits(part(limits.per_minute), part(limits.per_day))

    async def charge(
        self, tenant: str, estimate: int, limits: QuotaLimits
    ) -> Charge | QuotaRefused:
        try:
            return await self._redis.charge(tenant, estimate, limits)
        except StateDown as down:
            if down.on_failure == "reject":
                raise unavailable(down) from down
            answer = await self._local.charge(tenant, estimate, self._shared(down, limits))
            if isinstance(answer, Charge):
                self._local_charges[id(answer)] = answer
            return answer

    async def correct(self, charge: Charge, actual: int) -> QuotaRemaining:
        if self._local_charges.pop(id(charge), None) is charge:
            return await self._local.correct(charge, actual)
        try:
            return await self._redis.correct(charge, actual)
        except StateDown:
            # The correction is lost with Redis (the estimate stays charged there:
            # the quota errs on the safe side); what is left is reported unknown.
            return await self._local.remaining(charge.tenant, QuotaLimits())

    async def remaining(self, tenant: str, limits: QuotaLimits) -> QuotaRemaining:
        try:
            return await self._redis.remaining(tenant, limits)
        except StateDown as down:
            if down.on_failure == "reject":
                raise unavailable(down) from down
            return await self._local.remaining(tenant, self._shared(down, limits))

    def __repr__(self) -> str:
        return f"<SharedTokenQuotas {self._client!r}>"


def token_quota_store(state: SharedState | None, clock: Clock | None = None) -> TokenQuotaStore:
    """The token quota store for the runtime: the shared one with ``state.backend: redis``,
    else one in memory on ``clock`` (the construction point ``build_runtime`` calls)."""
    if state is None:
        return LocalTokenQuotas(clock)
    return state.quotas
