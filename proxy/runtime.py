"""The proxy's live state: the rules of one config, and the parts that outlive it.

``Rules`` is everything derived from one validated ``Config`` (key index,
per-tenant budgets): immutable, swapped whole on reload, and read once per
request, so a request keeps the rules it was admitted under (docs/REFERENCE.md,
guarantee 5). ``Runtime`` holds the long-lived components (dispatcher, seats,
client session, telemetry); ``app.py`` builds it and owns its lifecycle.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import aiohttp
from aiohttp import web

from proxy.clock import Clock
from proxy.dispatch import Dispatcher, TenantLimits
from proxy.estimators import OutputTokens
from proxy.health import Health
from proxy.models import ModelTable
from proxy.quotas import EntranceQuotas, RateTake
from proxy.record import RequestRecord
from proxy.replicas import ReplicaPool
from proxy.retries import RetryBudget, RetryPolicy
from proxy.settings import BudgetsConfig, Config
from proxy.state.quota import LocalTokenQuotas, WallClock
from proxy.telemetry import Telemetry
from proxy.telemetry.gpu import GpuSampler
from proxy.telemetry.metrics import OTHER_TENANTS
from proxy.token_quota import TokenQuotas
from proxy.upstream import upstream_timeout

if TYPE_CHECKING:
    from proxy.state.shared import SharedState


@dataclass(frozen=True, slots=True)
class Rules:
    config: Config
    keys: Mapping[str, str]
    budgets: Mapping[str, BudgetsConfig]
    #: ``timeouts.connect_ms`` as aiohttp takes it, built once per config.
    upstream_timeout: aiohttp.ClientTimeout
    #: ``routes`` as a set: the allow-list is looked up once per path segment.
    routes: frozenset[str]

    @classmethod
    def from_config(cls, config: Config) -> Rules:
        return cls(
            config=config,
            keys=config.key_index(),
            budgets={name: config.budgets_for(name) for name in config.tenants},
            upstream_timeout=upstream_timeout(config.timeouts.connect_ms / 1000.0),
            routes=frozenset(config.routes),
        )

    def tenant_limits(self) -> dict[str, TenantLimits]:
        return {
            name: TenantLimits(
                max_concurrency=t.max_concurrency, queue_capacity=t.queue_capacity, weight=t.weight
            )
            for name, t in self.config.tenants.items()
        }

    def rate_limits(self) -> dict[str, tuple[float, float] | None]:
        return {
            name: (t.rate_per_s, t.effective_burst or 1.0) if t.rate_per_s is not None else None
            for name, t in self.config.tenants.items()
        }


@dataclass(frozen=True, slots=True)
class Runtime:
    """Every long-lived part, built before start and never replaced from outside.

    Frozen: what changes while the proxy runs changes only through the
    runtime's own methods (``apply`` swaps a reload's rules in one step;
    ``begin_shutdown``, ``end_grace``, ``open_session`` and ``close_session``
    follow the lifecycle).
    """

    rules: Rules
    clock: Clock
    pool: ReplicaPool
    dispatcher: Dispatcher
    quotas: EntranceQuotas
    telemetry: Telemetry
    health: Health
    retry_policy: RetryPolicy
    retry_budget: RetryBudget
    gpu: GpuSampler
    session: aiohttp.ClientSession | None = None
    shutting_down: bool = False
    #: The shutdown grace ran out: requests still in flight are being cut by the proxy.
    grace_over: bool = False
    #: Requests inside the handler right now (graceful shutdown waits for them).
    active: set[object] = field(default_factory=set)
    _idle: list[asyncio.Event] = field(default_factory=list)
    #: Each tenant's recent mean output tokens: the cost of a request with no limit.
    output_tokens: OutputTokens = field(default_factory=OutputTokens)
    #: Which replicas serve which model (static ``models`` and discovery).
    models: ModelTable = field(default_factory=lambda: ModelTable({}, {}))
    #: Token quotas (``token_quota.py``); their counters live in its store, so a
    #: reload, which only swaps the limits, keeps every tenant's use.
    token_quotas: TokenQuotas = field(
        default_factory=lambda: TokenQuotas(LocalTokenQuotas(), WallClock())
    )
    #: ``state.backend: redis``: the limits shared with other instances; None: local.
    state: SharedState | None = None

    def _set(self, name: str, value: object) -> None:
        object.__setattr__(self, name, value)

    def begin_shutdown(self) -> None:
        """Stop admitting: readiness fails, the queue is answered, arrivals are refused."""
        if self.shutting_down:
            return
        self._set("shutting_down", True)
        self.dispatcher.close()

    def end_grace(self, drained: bool) -> None:
        """The shutdown grace is over; requests still running are cut by the proxy."""
        self._set("grace_over", not drained)

    def open_session(self, session: aiohttp.ClientSession) -> None:
        self._set("session", session)

    async def close_session(self) -> None:
        if self.session is not None:
            await self.session.close()
        self._set("session", None)

    def enter(self, request: object) -> None:
        self.active.add(request)

    def leave(self, request: object) -> None:
        self.active.discard(request)
        if not self.active and self._idle:
            self._idle[0].set()

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no request is inside the handler, at most ``timeout_s``."""
        if not self.active:
            return True
        self._idle[:] = [asyncio.Event()]
        try:
            async with asyncio.timeout(timeout_s):
                await self._idle[0].wait()
        except TimeoutError:
            return False
        return True

    def apply(self, rules: Rules) -> None:
        """Swap in a new config's rules in one step (reload)."""
        self._set("rules", rules)
        self.dispatcher.set_limits(rules.tenant_limits())
        self.dispatcher.set_observing(rules.config.mode == "observe")
        scheduler = self.dispatcher.scheduler
        scheduler.set_class_weights({n: p.weight for n, p in rules.config.priorities.items()})
        scheduler.set_tenant_weights({n: t.weight for n, t in rules.config.tenants.items()})
        self.quotas.configure(rules.rate_limits())
        configure_models(self.models, rules.config)
        self.dispatcher.refuse_unserved()  # a model the reload left no replica listing
        self.dispatcher.seats.affinity.max_load_factor = rules.config.routing.max_load_factor
        self.health.set_config(rules.config)
        # A tenant the reload removed keeps its label while its requests run here.
        busy = {record.tenant for record in self.active if isinstance(record, RequestRecord)}
        forgotten = self.telemetry.labels.reconfigure(
            rules.config.tenants, rules.config.telemetry.max_tenant_labels, busy
        )
        self.telemetry.forget_tenants(forgotten)
        keep = set(rules.config.tenants) | busy
        self.dispatcher.keep_tenants(keep, fold_into=OTHER_TENANTS)
        self.output_tokens.keep_tenants(keep)
        self.token_quotas.keep_tenants(keep)
        self.telemetry.model_labels.max_labels = rules.config.telemetry.max_tenant_labels
        self.gpu.set_interval(rules.config.gpu.sample_ms / 1000.0)
        retry = rules.config.retry
        self._set("retry_policy", RetryPolicy(retry))
        self.retry_budget.ratio, self.retry_budget.min_per_s = (
            retry.budget_ratio,
            retry.min_retries_per_s,
        )

    async def take_rate(self, tenant: str) -> RateTake | None:
        """The tenant's turn at its ``rate_per_s`` bucket (shared with other instances when
        the state is); None when it has no rate."""
        if self.state is None:
            return self.quotas.take(tenant)
        config = self.rules.config.tenants.get(tenant)
        if config is None or config.rate_per_s is None:
            return None
        return await self.state.take_rate(tenant, config.rate_per_s, config.effective_burst or 1.0)

    async def spend_retry(self) -> float:
        """Take one retry from the budget (the fleet's, with shared state): 0.0 when
        taken, else the seconds until the budget has one (``Retry-After``)."""
        budget = self.retry_budget
        if self.state is not None:
            return await self.state.spend_retry(budget)
        return 0.0 if budget.try_spend() else budget.refill_in()

    def client_session(self) -> aiohttp.ClientSession:
        if self.session is None:
            raise RuntimeError("the upstream session is not open (app not started)")
        return self.session


def configure_models(table: ModelTable, config: Config) -> None:
    """A config's static ``models``, ``model_aliases`` and access lists into the table."""
    table.reconfigure(
        {r.name: r.models for r in config.replicas},
        config.model_aliases,
        restricted=any(t.allowed_models is not None for t in config.tenants.values()),
    )


#: The typed application key under which the app holds its runtime.
RUNTIME: web.AppKey[Runtime] = web.AppKey("runtime", Runtime)
